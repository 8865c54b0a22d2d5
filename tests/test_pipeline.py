"""Pipeline parallelism (models/pipeline/gpipe.py, the forward-scan engine): the pipelined stack
equals the sequential layer scan, forward and gradients, on pipeline meshes combined with
data/fsdp/model; activations move between stages by collective-permute over 'pipeline'; each device
keeps only its stages' parameters; and a bad schedule stops before tracing any layer (the schedule
itself: test_pipeline_schedule.py)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from errors import UserError
from mesh.build import make_mesh
from mesh.rules import axis_rules, logical_to_spec, make_rules
from models import model
from models import pipeline as pipeline_lib
from models.config import PipelineConfig
from models.presets import PRESETS
from models.transformer import Block
from plan.hlo import parse_collectives
from train.core.setup import create_state, jit_step

B, T = 16, 8
RULES = make_rules("layers=pipeline")  # each device stores only its own layers
# ... and the batch outside the pipeline (embedding, head, loss) split over 'pipeline' too
RULES_BATCH_PP = make_rules("layers=pipeline,batch=data+fsdp+expert+pipeline")


# ------------------------------------------------------------------ layers under test


def mlp_layers(n_layers=8, d=8, f=16):
    """A residual tanh-MLP stack [L, ...] and a layer that also reads a per-example batch arg."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w_DF": jax.random.normal(k1, (n_layers, d, f)) * 0.3,
        "w_FD": jax.random.normal(k2, (n_layers, f, d)) * 0.3,
    }
    axes = {"w_DF": ("layers", "embed", "mlp"), "w_FD": ("layers", "mlp", "embed")}

    def layer(x_bTD, p, pos_bT):
        return x_bTD + jnp.tanh(x_bTD @ p["w_DF"]) @ p["w_FD"] + 0.01 * pos_bT[..., None]

    return layer, params, axes, d


def block_layers(n_layers=4):
    """The real decoder Block, stacked as the Decoder stacks it, run through nnx.merge."""
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=n_layers, dtype="float32")

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(cfg, jnp.float32, jnp.float32, rngs=rngs)

    with nnx.use_eager_sharding(False):
        gdef, state = nnx.split(make(nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    axes = nnx.to_pure_dict(
        jax.tree.map(
            lambda v: tuple(v.get_metadata()["out_sharding"]),
            state,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    )

    def layer(x_bTD, p, pos_bT):
        st = jax.tree.map(lambda v: v, state)  # fresh Variables to fill
        nnx.replace_by_pure_dict(st, jax.tree.map(lambda a: a, p))
        return nnx.merge(gdef, st)(x_bTD, pos_bT.astype(jnp.int32))[0]

    return layer, params, axes, cfg.d_model


def sequential(layer, params, x_BTD, pos_BT):
    return jax.lax.scan(lambda x, p: (layer(x, p, pos_BT), None), x_BTD, params)[0]


def inputs(d):
    kx = jax.random.key(1)
    x_BTD = jax.random.normal(kx, (B, T, d))
    pos_BT = (
        jnp.broadcast_to(jnp.arange(T), (B, T)).astype(jnp.float32) + jnp.arange(B)[:, None] % 3
    )
    return x_BTD, pos_BT


def loss_of(f):
    # a non-trivial cotangent: weights differ per position, so misplaced micro-batches would show
    return lambda params, x, pos: jnp.sum(
        jnp.sin(f(params, x, pos)) * (1 + jnp.arange(B)[:, None, None])
    )


def rel_err(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def assert_close_trees(got, want, rtol=1e-5):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert rel_err(g, w) <= rtol, (jax.tree_util.keystr(path), rel_err(g, w))


def sharded_params(mesh, params, axes):
    shard = jax.tree.map(
        lambda names: jax.NamedSharding(mesh, logical_to_spec(names, RULES)),
        axes,
        is_leaf=lambda t: isinstance(t, tuple),
    )
    return jax.device_put(params, shard)


# ------------------------------------------------------------------ equivalence on meshes

CASES = [  # (mesh, layers, stages, microbatches, repeats, schedule)
    ("pipeline=2,data=2,fsdp=2", "mlp", 2, 4, 1, "gpipe"),
    ("pipeline=2,data=2,fsdp=2", "mlp-batch-pp", 2, 4, 1, "gpipe"),
    ("pipeline=2,data=2,fsdp=2", "mlp-gather-once", 2, 4, 1, "gpipe"),
    ("pipeline=4,data=2", "mlp", 4, 4, 2, "circular"),
    ("pipeline=2,data=2,fsdp=2", "mlp-stage-ordered", 2, 2, 2, "circular"),
    ("pipeline=4,data=2", "block", 4, 8, 1, "gpipe"),
    ("pipeline=2,fsdp=2,model=2", "block", 2, 2, 2, "circular"),
]


@pytest.fixture(scope="module")
def compiled_cases():
    cache = {}

    def get(case):
        if case not in cache:
            mesh_spec, kind, P, M, R, schedule = case
            layer, params, axes, d = mlp_layers() if kind.startswith("mlp") else block_layers()
            rules = RULES_BATCH_PP if kind.endswith("batch-pp") else RULES
            x, pos = inputs(d)
            want = jax.jit(
                jax.value_and_grad(
                    loss_of(lambda p, x, pos: sequential(layer, p, x, pos)), argnums=(0, 1)
                )
            )(params, x, pos)
            cfg = PipelineConfig(
                microbatches=M,
                repeats=R,
                schedule=schedule,
                gather_once=kind.endswith("gather-once"),
            )
            ordered = kind.endswith("stage-ordered")
            f = functools.partial(
                pipeline_lib.pipeline_apply,
                layer,
                stages=P,
                microbatches=cfg.microbatches_for(P),
                repeats=R,
                schedule=schedule,
                replica_axes=cfg.replica_axes,
                stage_ordered=ordered,
            )
            if ordered:  # stored in stage order; the gradients come back in that order too
                params = pipeline_lib.to_stage_order(params, P, R)
                want = (want[0], (pipeline_lib.to_stage_order(want[1][0], P, R), want[1][1]))
            mesh = make_mesh(mesh_spec)
            with jax.set_mesh(mesh), axis_rules(rules):
                p_sh = sharded_params(mesh, params, axes)
                # gradients laid out like the parameters, as the train step asks
                out_sh = (None, (jax.tree.map(lambda a: a.sharding, p_sh), None))
                compiled = (
                    jax.jit(jax.value_and_grad(loss_of(f), argnums=(0, 1)), out_shardings=out_sh)
                    .lower(p_sh, x, pos)
                    .compile()
                )
                got = compiled(p_sh, x, pos)
            cache[case] = (mesh, compiled, got, want, d, p_sh)
        return cache[case]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-M{c[3]}-{c[5]}")
def test_pipeline_matches_sequential_scan(compiled_cases, case):
    mesh, compiled, (loss, grads), (want_loss, want_grads), d, _ = compiled_cases(case)
    assert rel_err(loss, want_loss) <= 1e-5
    assert_close_trees(grads, want_grads)
    colls = parse_collectives(compiled.as_text(), mesh)
    gathers = [c for c in colls if "pipeline" in c.axes and c.kind in ("all-gather", "all-to-all")]
    # x, split over pipeline outside, is gathered onto stage 0 once
    if case[1].endswith("batch-pp"):
        x_local = B * T * d * 4 // (mesh.shape["data"] * mesh.shape["fsdp"])
        assert [(c.kind, c.count, c.result_bytes) for c in gathers] == [("all-gather", 1, x_local)]
    # weights and grads stay on their slice
    elif case[-1] == "gpipe" or case[1].endswith("stage-ordered"):
        assert not gathers, gathers
    # data parallelism: the weight gradients are summed over 'data' once per step, not once per tick
    assert all(c.count == 1 for c in colls if c.axes == ("data",)), colls
    # ... and over fsdp too: weights gathered once, grads reduced once
    if case[1].endswith("gather-once"):
        assert all(c.count == 1 for c in colls if "fsdp" in c.axes), colls


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["gpipe", "circular"])
def test_activations_move_by_collective_permute(compiled_cases, case):
    """Every tick sends one micro-batch to the next stage forward and one gradient back: the
    compiled loop's permutes over 'pipeline' match permute_bytes_theory exactly."""
    mesh, compiled, *_, d, _ = compiled_cases(case)
    _, _, P, M, R, _ = case
    colls = parse_collectives(compiled.as_text(), mesh)
    ticks = pipeline_lib.n_ticks(P, M, R)
    in_loop = [
        c
        for c in colls
        if c.kind == "collective-permute" and c.axes == ("pipeline",) and c.count == ticks
    ]
    assert len(in_loop) == 2, in_loop  # forward activations, backward gradients
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    theory = pipeline_lib.permute_bytes_theory(
        batch=B,
        seq=T,
        d_model=d,
        itemsize=4,
        stages=P,
        microbatches=M,
        repeats=R,
        batch_shards=shards,
    )
    assert sum(c.operand_bytes * c.count for c in in_loop) == theory["sent"]
    assert theory["useful"] == theory["sent"] * R * M // ticks


@pytest.mark.slow
def test_stage_params_are_a_quarter_per_device_on_pipeline4(compiled_cases):
    """Per-device argument bytes of the compiled step: parameters sharded 4 ways over 'pipeline'."""
    _, compiled, *_, d, p_sh = compiled_cases(CASES[3])
    x, pos = inputs(d)
    args = (p_sh, x, pos)
    shard_bytes = [
        int(np.prod(sh.shard_shape(a.shape))) * a.dtype.itemsize
        for a, sh in zip(jax.tree.leaves(args), jax.tree.leaves(compiled.input_shardings[0]))
    ]
    n_params = len(jax.tree.leaves(p_sh))
    total = sum(a.nbytes for a in jax.tree.leaves(p_sh))
    assert sum(shard_bytes[:n_params]) * 4 == total
    assert compiled.memory_analysis().argument_size_in_bytes == sum(shard_bytes)


def test_aux_outputs_are_per_layer_means_over_microbatches():
    """has_aux (MoE router stats): every layer's aux, averaged over the batch pieces (micro-batches
    x data replicas), with the layers inside a stage unrolled."""
    layer, params, _, d = mlp_layers()
    x, pos = inputs(d)

    def layer_aux(x_bTD, p, pos_bT):
        y = layer(x_bTD, p, pos_bT)
        return y, {"mean": jnp.mean(y), "positive": jnp.sum(y > 0)}

    ys, want = jax.lax.scan(lambda h, p: layer_aux(h, p, pos), x, params)
    f = jax.jit(
        lambda p, x, pos: pipeline_lib.pipeline_apply(
            layer_aux,
            p,
            x,
            pos,
            stages=2,
            microbatches=4,
            repeats=2,
            schedule="circular",
            has_aux=True,
            scan_layers=False,
        )
    )
    y, aux = f(params, x, pos)
    assert rel_err(y, ys) <= 1e-6
    assert aux["mean"].shape == (8,) and rel_err(aux["mean"], want["mean"]) <= 1e-5
    np.testing.assert_allclose(aux["positive"] * 4, want["positive"])
    with jax.set_mesh(make_mesh("pipeline=2,data=2,fsdp=2")), axis_rules(RULES):  # 2 data replicas
        y, aux = f(params, x, pos)
    assert rel_err(y, ys) <= 1e-6 and rel_err(aux["mean"], want["mean"]) <= 1e-5
    np.testing.assert_allclose(aux["positive"] * 4 * 2, want["positive"])


def test_no_mesh_and_stage_remat_match():
    """Without any mesh (one device) the same schedule arithmetic runs; full-stage remat and no
    remat give the same gradients."""
    layer, params, _, d = mlp_layers()
    x, pos = inputs(d)
    want = jax.grad(loss_of(lambda p, x, pos: sequential(layer, p, x, pos)), argnums=(0, 1))(
        params, x, pos
    )
    for kw in ({"remat_stage": True}, {"remat_policy": None}):
        f = functools.partial(
            pipeline_lib.pipeline_apply,
            layer,
            stages=2,
            microbatches=4,
            repeats=2,
            schedule="circular",
            **kw,
        )
        assert_close_trees(jax.jit(jax.grad(loss_of(f), argnums=(0, 1)))(params, x, pos), want)


# ------------------------------------------------------------------ bad input


def test_pipeline_apply_validates_before_tracing_layers():
    layer, params, _, d = mlp_layers(n_layers=6)
    x, pos = inputs(d)
    with pytest.raises(UserError, match="model.n_layers=6"):
        pipeline_lib.pipeline_apply(layer, params, x, pos, stages=4, microbatches=4)
    with pytest.raises(UserError, match="batch size 16"):
        pipeline_lib.pipeline_apply(layer, params, x, pos, stages=2, microbatches=5)


# ----------------------------------------------------------------- end to end: model, trainer, plan


def trainer_for(mesh: str, tmp_path, **over):
    from train.core.config import build
    from train.run.loop import Trainer

    d = {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "parallelism.mesh": mesh,
        "train.batch_size": 8,
        "train.seq_len": 32,
        "train.steps": 3,
        "train.eval_every": 0,
        "train.sample_tokens": 0,
        "logging.progress": False,
        "logging.tensorboard": False,
        "logging.run_dir": str(tmp_path),
    }  # default rules: layers -> pipeline
    return Trainer(build({**d, **over}))


def step_losses(tr, steps=3):
    """Losses of `steps` train steps on one fixed batch (the same on every mesh)."""
    from train.data import make_pipeline

    batch = make_pipeline(
        tr.cfg.data,
        batch_size=8,
        seq_len=32,
        seed=0,
        batch_sharding=tr.setup.batch_sharding,
        vocab_size=tr.setup.model_cfg.vocab_size,
    ).device_batch(0)
    state, losses = create_state(tr.setup), []
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        step = jit_step(tr.setup)
        for _ in range(steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.array(losses), state


# (mesh, overrides); the Trainer's step on the other pipeline meshes, gradients included,
TRAIN_CASES = [
    # is compared with one device in test_equivalence_pipeline.py and test_equivalence_schedules.py
    # layers unrolled in each stage
    (
        "pipeline=4,data=2",
        {"model.n_layers": 4, "model.scan_layers": False},
    ),
]


@pytest.fixture(scope="module")
def data_parallel_losses(tmp_path_factory):
    cache = {}

    def get(n_layers: int):
        if n_layers not in cache:
            tr = trainer_for(
                "data=8", tmp_path_factory.mktemp("ref"), **{"model.n_layers": n_layers}
            )
            cache[n_layers] = step_losses(tr)[0]
        return cache[n_layers]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mesh, over", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_training_on_pipeline_mesh_matches_data_parallel(
    tmp_path, data_parallel_losses, mesh, over
):
    """The Trainer's step on a pipeline mesh: the same losses as plain data parallelism, and with
    the rule layers=pipeline each pipeline device stores only its stages' layers."""
    want = data_parallel_losses(over.get("model.n_layers", 2))
    tr = trainer_for(mesh, tmp_path / "pp", **over)
    got, state = step_losses(tr)
    assert np.all(np.isfinite(want)) and want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    w = state.params["blocks"]["mlp"]["w_gate_DF"]
    stored = (
        w.shape[0] // tr.setup.mesh.shape["pipeline"]
        if tr.setup.rules["layers"] == ("pipeline",)
        else w.shape[0]
    )
    assert w.addressable_shards[0].data.shape[0] == stored


@pytest.mark.slow
def test_moe_on_pipeline_mesh_matches_data_parallel(tmp_path):
    """moe-tiny (dropless) on pipeline=2,data=4: the same losses and router counts as data=8. The
    balance loss is off: like gradient accumulation, the pipeline computes it per micro-batch, and
    a mean of per-micro-batch Switch losses is not the whole batch's (documented)."""
    over = {"model.preset": "moe-tiny", "model.aux_loss_coef": 0.0}
    ref, pp = (
        trainer_for("data=8", tmp_path / "ref", **over),
        trainer_for("pipeline=2,data=4", tmp_path / "pp", **over),
    )
    (want, want_state), (got, _) = step_losses(ref), step_losses(pp)
    assert want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    tokens = jnp.arange(8 * 32).reshape(8, 32) % 264
    counts = []
    # token counts per expert are sums over the batch, not means over micro-batches
    for tr in (
        ref,
        pp,
    ):  # token counts per expert are sums over the batch, not means over micro-batches
        with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
            fwd = jax.jit(functools.partial(model.forward, tr.setup.model_cfg))
            counts.append(fwd(want_state.params, tokens)[1]["counts"])
    assert float(counts[0].sum()) == 8 * 32 * 2 * 2  # tokens x top-2 x 2 MoE layers
    np.testing.assert_array_equal(np.asarray(counts[1]), np.asarray(counts[0]))


@pytest.mark.slow
def test_plan_reports_pipeline(tmp_path):
    """`plan` on pipeline=4: a quarter of the layer-stack bytes per device of pipeline=1, the
    stage-to-stage permutes of the compiled step equal to the schedule's count, and the chart."""
    from plan.render import render
    from plan.report import analyze

    over = {"model.n_layers": 4}
    flat, pp = (
        analyze(trainer_for(mesh, tmp_path, **over).setup)
        for mesh in ("data=8", "pipeline=4,data=2")
    )

    def stack(r):
        return sum(row["local_bytes"] for row in r["sharding"] if row["name"].startswith("blocks/"))

    assert stack(pp) * 4 == stack(flat)
    # embedding and head stay whole
    assert pp["memory"]["params_bytes"] < 0.6 * flat["memory"]["params_bytes"]
    assert "pipeline" not in flat
    r = pp["pipeline"]
    assert (r["stages"], r["microbatches"], r["repeats"], r["schedule"]) == (4, 4, 1, "gpipe")
    assert r["bubble"] == pytest.approx(3 / 7)
    # 8 rows / 2 data shards / 4 micro-batches x 32 x 64 x 4 bytes, 7 ticks x forward and backward
    assert r["permute_bytes_hlo"] == r["permute_bytes_theory"] == 1 * 32 * 64 * 4 * 7 * 2
    text = render(pp, False)
    assert "stage 3 (layers 3-3)" in text and "HLO 0.11 MiB vs theory 0.11 MiB" in text


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (
            ["--mesh", "pipeline=2,data=4", "--pipeline.microbatches", "1"],
            "--pipeline.microbatches=1 is less than",
        ),
        (
            ["--mesh", "pipeline=4,data=2", "--model.n_layers", "6"],
            "model.n_layers=6 is not divisible",
        ),
        (
            [
                "--mesh",
                "pipeline=2,data=4",
                "--model.n_layers",
                "6",
                "--pipeline.schedule",
                "circular",
                "--pipeline.repeats",
                "2",
            ],
            "model.n_layers=6 is not divisible by --mesh pipeline=2 x --pipeline.repeats=2",
        ),
        (
            ["--pipeline.schedule", "pipedream"],
            "--pipeline.schedule 'pipedream' is not one of gpipe, circular, 1f1b",
        ),
        (
            ["--mesh", "pipeline=2,data=4", "--pipeline.microbatches", "3"],
            "batch size 8 (train.batch_size per forward pass) is not divisible by"
            " --pipeline.microbatches=3",
        ),
    ],
)
def test_cli_bad_pipeline_config_is_one_line(tmp_path, capsys, argv, culprit):
    from train.cli.main import main

    rc = main(
        ["--model", "tiny", "--steps", "1", "--batch-size", "8", "--run-dir", str(tmp_path), *argv]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and culprit in err[0], err
