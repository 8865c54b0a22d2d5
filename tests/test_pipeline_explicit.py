"""The explicit pipeline schedules (models/pipeline/explicit.py; their timetables in
models/pipeline/timetables.py): 1F1B's, interleaved 1F1B's and ZB-H1's timetable, chart and memory
bound, the same loss and gradients as the sequential stack, the plain model and GPipe, and bad
settings in one line."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from errors import UserError
from mesh.build import make_mesh
from mesh.rules import axis_rules, make_rules
from models import model
from models import pipeline as pipeline_lib
from models.config import PipelineConfig
from models.pipeline import explicit, timetables
from models.presets import PRESETS
from plan.hlo import parse_collectives

RULES = make_rules("layers=pipeline")


# ------------------------------------------------------------------ the timetable


@pytest.mark.parametrize("P, M", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 8)])
def test_timetable_is_one_forward_one_backward(P, M):
    """Each stage runs every micro-batch forward then backward in order; a micro-batch moves one
    stage per tick (forward out, backward back, the last stage's backward in its forward's tick);
    after a warm-up of 2(P-1-s) forward-only ticks stage s runs one forward and one backward per
    tick, then as many backward-only ticks; s idle ticks at each end; never more than 2(P-1) inputs
    kept."""
    table = [
        [tuple(None if c is None else c[0] for c in fb) for fb in row]
        for row in timetables.table_1f1b(P, M)
    ]
    assert all(len(row) == M + 2 * (P - 1) for row in table)
    f_tick = [{f: t for t, (f, _) in enumerate(row) if f is not None} for row in table]
    b_tick = [{b: t for t, (_, b) in enumerate(row) if b is not None} for row in table]
    for s in range(P):
        assert list(f_tick[s]) == list(range(M)) and list(b_tick[s]) == list(range(M))
        for m in range(M):
            assert b_tick[s][m] == (f_tick[s][m] if s == P - 1 else b_tick[s + 1][m] + 1)
            assert s == 0 or f_tick[s][m] == f_tick[s - 1][m] + 1
        # X: a forward and a backward in one tick; with M < 2(P-1-s) the warm-up runs
        # out first (idle gap)
        kinds = "".join(
            "X"
            if f is not None and b is not None
            else "F"
            if f is not None
            else "B"
            if b is not None
            else "."
            for f, b in table[s]
        )
        warm, gap = min(M, 2 * (P - 1 - s)), max(0, 2 * (P - 1 - s) - M)
        assert kinds == "." * s + "F" * warm + "X" * (M - warm) + "." * gap + "B" * warm + "." * s
    assert timetables.in_flight_1f1b(P, M) == [min(M, 2 * (P - 1 - s)) for s in range(P)]
    assert max(timetables.in_flight_1f1b(P, M)) <= timetables.ring_slots(P, M) <= 2 * (P - 1)


@pytest.mark.parametrize(
    "P, M, R", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 3), (3, 6, 2), (2, 4, 4)]
)
def test_interleaved_timetable(P, M, R):
    """Interleaved 1F1B: every (micro-batch, virtual stage v = r*P + s) runs forward once and
    backward once; a micro-batch moves one virtual stage per tick forward and one back (the last
    virtual stage's backward in its forward's tick); per device at most one forward and one
    backward per tick (the table's cells); a ring of ring_slots never overwrites a stage input
    before its backward reads it; the phases cover exactly the ticks with forwards / backwards."""
    V, table = R * P, timetables.table_1f1b(P, M, R)
    fwd, bwd = {}, {}
    for s, row in enumerate(table):
        for t, (f, b) in enumerate(row):
            for got, c in ((fwd, f), (bwd, b)):
                if c is not None:
                    assert (c[0], c[1] * P + s) not in got
                    got[c[0], c[1] * P + s] = t
    assert len(fwd) == len(bwd) == M * V
    for m in range(M):
        assert all(fwd[m, v] == fwd[m, v - 1] + 1 for v in range(1, V))
        assert (
            all(bwd[m, v] == bwd[m, v + 1] + 1 for v in range(V - 1))
            and bwd[m, V - 1] == fwd[m, V - 1]
        )
    (_, _, warm), (_, start, steady), (_, end, cool) = timetables.phases_1f1b(P, M, R)
    assert warm + steady + cool == timetables.ticks_1f1b(P, M, R) == len(table[0])
    assert min(bwd.values()) == start and max(fwd.values()) == end - 1
    K = timetables.ring_slots(P, M, R)
    for s, row in enumerate(table):
        ring = {}
        for t, (f, b) in enumerate(row):
            # the head's backward reads this tick's input
            if b is not None and not (s == P - 1 and b[1] == R - 1):
                assert ring[timetables.backward_item(t, s, P, M, R)[2] % K] == b
            if f is not None:
                ring[timetables.forward_item(t, s, P, M, R)[2] % K] = f
    assert max(timetables.in_flight_1f1b(P, M, R)) <= K


@pytest.mark.parametrize("P, M", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_timetable(P, M):
    """zb_h1: 1F1B's forward and input-gradient ticks; every stage runs micro-batch m's weight
    gradients once, at tick m + 2(P-1), after its input gradient (stage s holds its W inputs s
    ticks: at most s + 1 micro-batches); the W slot runs in M ticks, 1F1B's backward in M + P - 1;
    the bubble counted in the table (F, B, W one unit each) is the formula's and below 1F1B's."""
    zb, one_f = timetables.table_zb(P, M), timetables.table_1f1b(P, M)
    assert [[(f, b) for f, b, _ in row] for row in zb] == one_f
    for row in zb:
        b_tick = {c[0]: t for t, (_, c, _) in enumerate(row) if c is not None}
        w_tick = {c[0]: t for t, (_, _, c) in enumerate(row) if c is not None}
        assert sorted(w_tick) == list(range(M)) and all(
            w_tick[m] == m + 2 * (P - 1) >= b_tick[m] for m in range(M)
        )
    assert timetables.w_in_flight(P, M) == [min(s + 1, M) for s in range(P)]
    assert max(timetables.w_in_flight(P, M)) <= timetables.w_slots(P, M)
    w_ticks = {t for row in zb for t, (_, _, c) in enumerate(row) if c is not None}
    b_ticks = {t for row in one_f for t, (_, c) in enumerate(row) if c is not None}
    assert len(w_ticks) == M and len(b_ticks) == M + P - 1
    counted = timetables.bubble_counted("zb_h1", P, M)
    assert (
        counted
        == pytest.approx(timetables.schedule_bubble("zb_h1", P, M))
        == pytest.approx(2 * (P - 1) / (3 * M + 2 * (P - 1)))
    )
    assert (
        counted
        < timetables.bubble_counted("1f1b", P, M)
        == pytest.approx(timetables.bubble_fraction(P, M))
    )
    phases = timetables.timetable("zb_h1").slots(P, M)
    assert (
        sum(c for _, _, c, _ in phases) == len(zb[0])
        and sum(c for _, _, c, k in phases if "W" in k) == M
    )


def test_chart_and_plot(tmp_path):
    chart = pipeline_lib.schedule_chart(2, 3, schedule="1f1b", n_layers=4).splitlines()
    assert "5 ticks (1 forward-only, 3 forward+backward, 1 backward-only)" in chart[0]
    assert (
        "at most 2 stage inputs in flight" in chart[0]
        and "bubble (P-1)/(M+P-1) = 25.0%" in chart[0]
    )
    assert chart[1].split() == ["stage", "0", "(layers", "0-1)", "F0", "F1", "F2B0", "B1", "B2"]
    assert chart[2].split() == ["stage", "1", "(layers", "2-3)", ".", "F0B0", "F1B1", "F2B2", "."]
    chart = pipeline_lib.schedule_chart(2, 4, 2, "interleaved_1f1b", n_layers=8).splitlines()
    assert (
        "2 stages x 4 micro-batches x 2 chunks; 12 ticks (3 forward-only, 6 forward+backward, 3"
        in chart[0]
    )
    assert "bubble (P-1)/(R*M+P-1) = 11.1%" in chart[0]
    assert chart[1].split()[:9] == [
        "stage",
        "0",
        "(layers",
        "0-1,",
        "4-5)",
        "F0.0",
        "F1.0",
        "F0.1",
        "F1.1",
    ]
    assert chart[2].split()[5:9] == [".", "F0.0", "F1.0", "F0.1B0.1"]
    chart = pipeline_lib.schedule_chart(2, 4, schedule="zb_h1", n_layers=4).splitlines()
    assert (
        "6 ticks (1 forward-only, 1 forward+backward, 3 forward+backward+weight-gradient,"
        " 1 backward+weight-gradient)"
        in chart[0]
        and "2 W inputs; bubble 2(P-1)/(3M+2(P-1)) = 14.3%" in chart[0]
    )
    assert chart[1].split()[4:] == ["F0", "F1", "F2B0W0", "F3B1W1", "B2W2", "B3W3"]
    assert chart[2].split()[4:] == [".", "F0B0", "F1B1W0", "F2B2W1", "F3B3W2", "W3"]
    pytest.importorskip("matplotlib")
    path = pipeline_lib.plot_schedule(4, 8, schedule="1f1b", path=str(tmp_path / "s.png"))
    pipeline_lib.plot_schedule(2, 4, 2, "interleaved_1f1b", path=str(tmp_path / "i.png"))
    pipeline_lib.plot_schedule(4, 8, schedule="zb_h1", path=str(tmp_path / "z.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw, culprit",
    [
        (
            {"microbatches": 2},
            "--pipeline.microbatches=2 is less than the 4 stages of --mesh pipeline=4; use"
            " microbatches >= 4",
        ),
        (
            {"repeats": 2},
            "--pipeline.repeats=2 needs --pipeline.schedule circular or interleaved_1f1b"
            " (1f1b runs each stage's layers once)",
        ),
        (
            {"schedule": "interleaved_1f1b"},
            "interleaved_1f1b needs --pipeline.repeats >= 2 (layer chunks per device)",
        ),
        (
            {"schedule": "interleaved_1f1b", "repeats": 2, "microbatches": 6, "batch": 12},
            "--pipeline.microbatches=6 must be a multiple of --mesh pipeline=4 for the"
            " interleaved_1f1b schedule",
        ),
        (
            {"schedule": "interleaved_1f1b", "repeats": 4},
            "model.n_layers=8 is not divisible by --mesh pipeline=4 x --pipeline.repeats=4 = 16",
        ),
        ({"batch": 12, "microbatches": 8}, "valid microbatches: [4, 6, 12]"),
        (
            {"schedule": "zb_h1", "repeats": 2},
            "--pipeline.repeats=2 needs --pipeline.schedule circular or"
            " interleaved_1f1b (zb_h1 runs each stage's layers once)",
        ),
        (
            {"schedule": "zb_h1", "microbatches": 3},
            "--pipeline.microbatches=3 is less than the 4 stages",
        ),
    ],
)
def test_bad_config_is_one_line(kw, culprit):
    args = {"n_layers": 8, "batch": 16, "stages": 4, "microbatches": 4, "schedule": "1f1b", **kw}
    with pytest.raises(UserError) as e:
        pipeline_lib.validate(**args)
    assert culprit in str(e.value) and "\n" not in str(e.value)
    assert PipelineConfig(schedule="1f1b").validate().schedule == "1f1b"


def test_train_step_routing(monkeypatch):
    """The train step's objective (models.pipeline.objective) runs the explicit engine for 1f1b
    and zb_h1 only on a pipeline mesh (a plain scan without one, the forward scan for gpipe); on
    CPU it runs MoE models only with threads enough in XLA:CPU's pool (mesh/xla.py), else one
    line."""
    engine_for = pipeline_lib.engine_for
    for schedule in ("1f1b", "zb_h1"):
        pc = PipelineConfig(schedule=schedule)
        assert engine_for(PRESETS["tiny"], pc) == "plain"  # no mesh
        with jax.set_mesh(make_mesh("pipeline=2,data=4")):
            assert engine_for(PRESETS["tiny"], pc) == "explicit"
            assert engine_for(PRESETS["tiny"], PipelineConfig()) == "forward_scan"
            monkeypatch.setenv("PJRT_NPROC", "32")
            assert engine_for(PRESETS["moe-tiny"], pc) == "explicit"
            monkeypatch.setenv("PJRT_NPROC", "8")
            with pytest.raises(UserError) as e:
                engine_for(PRESETS["moe-tiny"], pc)
        assert (
            f"--pipeline.schedule {schedule} runs MoE models (model.n_experts=8) on 8 CPU devices"
            " only with PJRT_NPROC=32 or more (XLA:CPU's thread pool, now 8"
            in str(e.value)
            and "use a schedule that runs MoE with any pool: gpipe, circular" in str(e.value)
            and "\n" not in str(e.value)
        )


def test_loss_validates_before_tracing():
    stack, outer, batch = toy()
    with pytest.raises(
        UserError,
        match=r"not divisible by --pipeline.microbatches=5; valid microbatches: \[2, 4, 8",
    ):
        explicit.loss(embed, layer, head, outer, stack, batch, stages=2, microbatches=5)


# ------------------------------------------------------------------ equivalence: a toy model

L, D, F, V, B, T = 8, 8, 16, 11, 16, 4


def toy():
    k = jax.random.split(jax.random.key(0), 5)
    stack = {
        "w_DF": jax.random.normal(k[0], (L, D, F)) * 0.3,
        "w_FD": jax.random.normal(k[1], (L, F, D)) * 0.3,
    }
    outer = {
        "emb_VD": jax.random.normal(k[2], (V, D)),
        "head_DV": jax.random.normal(k[3], (D, V)) * 0.3,
    }
    tokens = jax.random.randint(k[4], (B, T), 0, V)
    # weights differ per row: a micro-batch's loss or gradient in the wrong place would show
    batch = {
        "tokens": tokens,
        "targets": (tokens + 1) % V,
        "w": 1.0 + jnp.arange(B)[:, None] % 3 * jnp.ones((B, T)),
    }
    return stack, outer, batch


def embed(o, mb):
    return o["emb_VD"][mb["tokens"]]


def layer(x_bTD, p, mb):
    y = x_bTD + jnp.tanh(x_bTD @ p["w_DF"]) @ p["w_FD"] + 0.01 * mb["tokens"][..., None]
    return y, {"aux": jnp.mean(y**2), "count": jnp.sum(y > 0)}


def head(o, y_bTD, mb):
    logits = y_bTD @ o["head_DV"]
    target = jnp.take_along_axis(logits, mb["targets"][..., None], -1)[..., 0]
    return jnp.sum((jax.nn.logsumexp(logits, -1) - target) * mb["w"])


AUX_WEIGHT = 0.3


def sequential(o, stack, batch, M):
    """The plain stack with the same objective: head loss + AUX_WEIGHT x the per-layer aux summed
    over layers, averaged over M micro-batches (rows m, m+M, ...)."""
    y, aux_L = jax.lax.scan(lambda x, p: layer(x, p, batch), embed(o, batch), stack)
    micro = [jax.tree.map(lambda a, m=m: a[m::M], batch) for m in range(M)]
    per_mb = [
        jax.lax.scan(lambda x, p, mb=mb: layer(x, p, mb), embed(o, mb), stack)[1]["aux"]
        for mb in micro
    ]
    return head(o, y, batch) + AUX_WEIGHT * sum(jnp.sum(a) for a in per_mb) / M, aux_L


CASES = [  # (mesh, P, M, R): M = P, 2P and 4P; data, fsdp and model axes; R > 1: interleaved 1F1B;
    # R = 0: zb_h1 (1F1B's ticks, each backward split, the weight gradients deferred)
    ("", 2, 2, 1),
    ("pipeline=4,data=2", 4, 4, 1),
    ("pipeline=4,model=2", 4, 16, 1),
    ("", 2, 2, 2),
    ("pipeline=2,data=2,fsdp=2", 2, 4, 4),
    ("pipeline=4,data=2", 4, 8, 2),
    ("pipeline=2,fsdp=2,model=2", 2, 8, 2),
    ("", 2, 2, 0),
    ("pipeline=4,data=2", 4, 8, 0),
    ("pipeline=2,fsdp=2,model=2", 2, 8, 0),
]


@pytest.mark.parametrize(
    "mesh, P, M, R", CASES, ids=[f"{m or 'no-mesh'}-P{p}-M{n}-R{r}" for m, p, n, r in CASES]
)
def test_matches_sequential_stack(mesh, P, M, R):
    """Objective, gradient norm and every gradient (embedding, head, each layer) to 1e-5, and the
    forward-only program (no gradient) gives the same objective and aux."""
    stack, outer, batch = toy()
    (want, aux_L), want_g = jax.jit(
        jax.value_and_grad(sequential, argnums=(0, 1), has_aux=True), static_argnums=3
    )(outer, stack, batch, M)

    def f(o, s, b):
        obj, (loss_sum, aux) = explicit.loss(
            embed,
            layer,
            head,
            o,
            s,
            b,
            {"aux": AUX_WEIGHT},
            stages=P,
            microbatches=M,
            schedule="zb_h1" if R == 0 else "1f1b" if R == 1 else "interleaved_1f1b",
            repeats=max(R, 1),
            has_aux=True,
        )
        return obj, (loss_sum, aux)

    with jax.set_mesh(make_mesh(mesh)) if mesh else contextlib.nullcontext(), axis_rules(RULES):
        compiled = (
            jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
            .lower(outer, stack, batch)
            .compile()
        )
        (got, (_, aux)), got_g = compiled(outer, stack, batch)
        forward_only = (
            jax.jit(f)(outer, stack, batch)[0] if mesh.startswith("pipeline=4,data") else got
        )
    # one micro-batch forward and one back per tick that has them
    if mesh.startswith("pipeline=4,data"):
        permutes = [
            c
            for c in parse_collectives(compiled.as_text(), make_mesh(mesh))
            if c.kind == "collective-permute" and c.axes == ("pipeline",)
        ]
        theory = pipeline_lib.permute_bytes_theory(
            batch=B,
            seq=T,
            d_model=D,
            itemsize=4,
            stages=P,
            microbatches=M,
            repeats=max(R, 1),
            batch_shards=2,
        )
        assert sum(c.operand_bytes * c.count for c in permutes) == theory["sent"], permutes
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(forward_only, want, rtol=1e-5)
    np.testing.assert_allclose(optax_norm(got_g), optax_norm(want_g), rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(
            g, w, rtol=1e-5, atol=1e-6 * float(jnp.abs(w).max()), err_msg=jax.tree_util.keystr(path)
        )
    # aux: per-layer means over the batch pieces, M micro-batches x A data
    # replicas (counts / (M x A))
    replicas = dict(part.split("=") for part in mesh.split(",") if part).get("data", "1")
    np.testing.assert_allclose(aux["aux"], aux_L["aux"], rtol=1e-5)
    np.testing.assert_allclose(aux["count"] * M * int(replicas), aux_L["count"])


def optax_norm(tree):
    return float(jnp.sqrt(sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(tree))))


# ------------------------------------------------------------------ equivalence: the decoder


@pytest.mark.slow
def test_decoder_matches_plain_model_and_gpipe():
    """The tiny decoder (float32): the train step's objective (train.core.batch_loss.loss_terms) and
    its gradient on one device-group without pipeline, with GPipe, and through 1F1B (the explicit
    engine, the same entry), pipeline=2 with data and fsdp axes, M = 2P."""
    from train.core.batch_loss import loss_terms

    cfg = dataclasses.replace(PRESETS["tiny"], dtype="float32")
    params = model.init(cfg, jax.random.key(0))
    model.abstract_params(cfg)  # the module graph, built outside any mesh (it is cached)
    tok = np.random.default_rng(0).integers(0, 256, (16, 17)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "weights": np.ones((16, 16), np.float32)}
    pc = PipelineConfig(microbatches=4)
    rules = make_rules("")

    def run(mesh, fn):
        with jax.set_mesh(make_mesh(mesh)), axis_rules(rules):
            return jax.jit(jax.value_and_grad(fn))(params, batch)

    plain = run("data=8", lambda p, b: loss_terms(cfg, p, b)[0])
    gpipe = run("pipeline=2,data=2,fsdp=2", lambda p, b: loss_terms(cfg, p, b, pc)[0])
    one_f_pc = dataclasses.replace(pc, schedule="1f1b")
    one_f = run("pipeline=2,data=2,fsdp=2", lambda p, b: loss_terms(cfg, p, b, one_f_pc)[0])
    with jax.set_mesh(make_mesh("pipeline=2,data=2,fsdp=2")):
        assert pipeline_lib.engine_for(cfg, one_f_pc) == "explicit"
    for want in (plain, gpipe):
        np.testing.assert_allclose(one_f[0], want[0], rtol=1e-5)
        np.testing.assert_allclose(optax_norm(one_f[1]), optax_norm(want[1]), rtol=1e-5)
        for (path, g), w in zip(
            jax.tree_util.tree_leaves_with_path(one_f[1]), jax.tree.leaves(want[1])
        ):
            np.testing.assert_allclose(
                g,
                w,
                rtol=1e-5,
                atol=1e-6 * float(np.abs(w).max()),
                err_msg=jax.tree_util.keystr(path),
            )


# ------------------------------------------------------------------ memory


@pytest.mark.slow
def test_temp_memory_is_flat_in_microbatches():
    """Compiled temp memory of the gradient at P=4 with micro-batches of fixed size, M = 4, 8, 16:
    1F1B keeps at most 2(P-1) = 6 stage inputs whatever M (4 at M = 4), zb_h1 as many plus the W
    inputs of P micro-batches; GPipe keeps every tick's."""
    stack, outer, _ = toy()
    stack = jax.tree.map(lambda a: a[:4], stack)

    def temp(schedule, M):
        batch = {
            k: jnp.zeros((2 * M, 32), dt)
            for k, dt in (("tokens", jnp.int32), ("targets", jnp.int32), ("w", jnp.float32))
        }

        def explicit_loss(o, s, b):
            return explicit.loss(
                embed,
                layer,
                head,
                o,
                s,
                b,
                stages=4,
                microbatches=M,
                schedule=schedule,
                has_aux=True,
            )[0]

        def gpipe_loss(o, s, b):
            y = pipeline_lib.pipeline_apply(
                lambda x, p, tok: layer(x, p, {"tokens": tok})[0],
                s,
                embed(o, b),
                b["tokens"],
                stages=4,
                microbatches=M,
            )
            return head(o, y, b)

        f = explicit_loss if schedule != "gpipe" else gpipe_loss
        with jax.set_mesh(make_mesh("pipeline=4,data=2")), axis_rules(RULES):
            compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(outer, stack, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one_f = {M: temp("1f1b", M) for M in (4, 8, 16)}
    zb = {M: temp("zb_h1", M) for M in (4, 8, 16)}
    gpipe = {M: temp("gpipe", M) for M in (4, 16)}
    assert one_f[4] <= one_f[8] and one_f[16] <= 1.2 * one_f[8], one_f
    assert gpipe[16] > 2.5 * gpipe[4] and one_f[16] < gpipe[16] / 3, (one_f, gpipe)
    # zb_h1 keeps 1F1B's ring and the W inputs of at most P micro-batches: flat in M too
    assert zb[16] <= 1.2 * zb[8] and zb[16] < gpipe[16], (zb, gpipe)


def test_moe_on_a_small_cpu_pool_is_one_line_before_the_run_dir(tmp_path, monkeypatch, capfd):
    """`python -m train` with a MoE model through 1f1b and XLA:CPU's default pool (8 threads for 8
    devices on 2 cores): exit 2, one line naming PJRT_NPROC, and no run directory written."""
    from train.cli.main import main

    monkeypatch.setenv("PJRT_NPROC", "8")
    run_dir = tmp_path / "run"
    code = main(
        [
            "--model",
            "moe-tiny",
            "--mesh",
            "pipeline=2,fsdp=4",
            "--pipeline.schedule",
            "1f1b",
            "--steps",
            "1",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--run-dir",
            str(run_dir),
            "--logging.progress",
            "false",
        ]
    )
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and "PJRT_NPROC=32 or more" in err[0], err
    assert not run_dir.exists()
