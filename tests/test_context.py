"""Context parallelism (models/context.py): the sequence sharded over the `context` axis, attention
by all-gathered K/V or by a ring of K/V blocks, in the zigzag layout; and sequence parallelism.

The backbone: the real jitted train step on a mesh equals one device's in float32, per step after
the warm-up, in loss, gradient norm and every parameter (tests/equivalence.py), for context 2, 4
and 8, both strategies, dense and blockwise attention, grouped-query heads (the tiny preset: 4
query heads, 2 KV heads), packed documents, and with fsdp, data, model and pipeline axes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import (
    BATCH,
    SEQ,
    assert_runs_match,
    assert_trees_close,
    gradients,
    initial_params,
    run_steps,
    synthetic_batches,
    trainer_cache,
)

from errors import UserError
from mesh.build import make_mesh
from mesh.rules import DEFAULT_RULES, axis_rules
from models import context
from models.config import LOSS_CHUNK
from models.presets import preset
from models.transformer import segment_positions
from plan.report import analyze
from train.core.batch_loss import loss_chunk
from train.core.config import build
from train.run.loop import Trainer

VOCAB = 264


def packed_batches(n: int = 5, seed: int = 1) -> list[dict]:
    """synthetic_batches with 1-4 documents per row: segment ids and their restarting positions."""
    rng = np.random.default_rng(seed)
    out = []
    for b in synthetic_batches(VOCAB, n, seed):
        cuts = np.sort(rng.integers(1, SEQ, (BATCH, 3)), axis=1)
        seg = (np.arange(SEQ)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
        out.append(
            {**b, "segment_ids": seg, "positions": np.asarray(segment_positions(jnp.asarray(seg)))}
        )
    return out


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    return trainer_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(trainers):
    """(packed) -> (initial params, batches, one device's run): the dense attention by index."""
    cache = {}

    def get(packed: bool):
        if packed not in cache:
            tr = trainers("", True)
            p0, batches = (
                initial_params(tr),
                packed_batches() if packed else synthetic_batches(VOCAB),
            )
            cache[packed] = p0, batches, run_steps(tr, batches, p0)
        return cache[packed]

    return get


# mesh, strategy, packed documents, more overrides: each strategy with and without packed
# documents, with blockwise and dense attention, beside fsdp, data, model (sequence parallel,
# chunked loss) and pipeline
CASES = [
    ("context=8", "all_gather", False, {"model.attention": "blockwise"}),
    ("context=4,fsdp=2", "ring", True, {"model.attention": "blockwise"}),
    ("context=4,data=2", "all_gather", True, {}),
    (
        "context=2,fsdp=2,model=2",
        "all_gather",
        False,
        {
            "model.attention": "blockwise",
            "parallelism.sequence_parallel": True,
            "model.loss_chunk": 8,
        },
    ),
    ("pipeline=2,context=2,fsdp=2", "ring", False, {}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh,strategy,packed,over", CASES, ids=[f"{c[0]}-{c[1]}{'-packed' * c[2]}" for c in CASES]
)
def test_context_parallel_step_matches_one_device(
    trainers, reference, mesh, strategy, packed, over
):
    p0, batches, want = reference(packed)
    tr = trainers(mesh, **{"parallelism.context_strategy": strategy, **over})
    assert_runs_match(
        run_steps(tr, batches, p0), want, f"{mesh} {strategy}{' packed' * packed} {over}"
    )


@pytest.mark.slow
def test_context_parallel_moe_matches_one_device(trainers):
    """MoE (routed experts inside shard_map) with the sequence over `context` and experts over
    `expert`."""
    over = {"model.preset": "moe-tiny"}
    ref = trainers("", True, **over)
    p0, batches = initial_params(ref), synthetic_batches(VOCAB)
    tr = trainers("context=2,expert=2,fsdp=2", **{"parallelism.context_strategy": "ring", **over})
    assert_runs_match(
        run_steps(tr, batches, p0), run_steps(ref, batches, p0), "moe-tiny context=2,expert=2 ring"
    )


# ------------------------------------------------------------------ the pieces, on their own


def test_zigzag_gives_each_shard_an_early_and_a_late_chunk():
    assert context.zigzag(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    order = context.zigzag(64, 4)
    assert sorted(order.tolist()) == list(range(64))
    causal_work = [sum(int(i) + 1 for i in shard) for shard in order.reshape(4, 16)]
    assert max(causal_work) == min(causal_work)  # keys each shard's queries see: balanced exactly
    with pytest.raises(UserError, match="multiple of 8"):
        context.zigzag(60, 4)


def test_layout_permutes_every_token_array_and_makes_positions_explicit():
    b = synthetic_batches(VOCAB, 1)[0]
    out = context.to_layout(
        {k: jnp.asarray(v) for k, v in b.items()},
        2,
        lambda seg, shape: jnp.broadcast_to(jnp.arange(shape[1]), shape),
    )
    order = context.zigzag(SEQ, 2)
    for key in ("inputs", "targets", "weights"):
        np.testing.assert_array_equal(out[key], b[key][:, order])
    np.testing.assert_array_equal(out["positions"], np.broadcast_to(order, (BATCH, SEQ)))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("kind", ["dense", "blockwise"])
def test_sharded_attention_and_its_gradients_equal_one_device(strategy, kind):
    """The attention function alone on context=4 (x model=2 heads) in the zigzag layout against
    dense attention on one device in index order, packed, with a window: outputs and gradients."""
    rng = np.random.default_rng(0)
    b, t, n, k, h = 2, 64, 4, 2, 8
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.float32) for heads in (n, k, k))
    seg = jnp.asarray(np.repeat([[0] * 20 + [1] * 30 + [2] * 14], b, axis=0), jnp.int32)
    pos = segment_positions(seg)
    order = context.zigzag(t, 4)

    def dense(q, kk, v):
        return context.local_attention(q, kk, v, pos, pos, seg, seg, window=9, kind="dense")

    def sharded(q, kk, v):
        with context.strategy(strategy):
            return context.attend(q, kk, v, pos[:, order], seg[:, order], window=9, kind=kind)

    cot = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    want, want_vjp = jax.vjp(dense, q, kk, v)
    mesh = make_mesh("context=4,model=2")
    with jax.set_mesh(mesh), axis_rules(DEFAULT_RULES):
        got, got_vjp = jax.vjp(jax.jit(sharded), q[:, order], kk[:, order], v[:, order])
        grads = got_vjp(cot[:, order])
    np.testing.assert_allclose(got, want[:, order], rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_vjp(cot)):
        np.testing.assert_allclose(g, w[:, order], rtol=1e-5, atol=1e-5)


def test_merge_of_two_key_blocks_is_attention_over_both():
    rng = np.random.default_rng(3)
    q, kk, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32) for _ in range(3))
    pos = jnp.arange(6)[None]
    whole = context.local_attention(q, kk, v, pos, pos, None, None, window=0, kind="dense")
    parts = [
        context.local_attention(
            q,
            kk[:, s],
            v[:, s],
            pos,
            pos[:, s],
            None,
            None,
            window=0,
            kind="dense",
            return_lse=True,
        )
        for s in (slice(0, 3), slice(3, 6))
    ]
    merged, _ = context.merge(*parts[0], *parts[1])
    np.testing.assert_allclose(merged, whole, rtol=1e-6, atol=1e-6)
    # a query that sees nothing in the second block (rows 0-2): weight 0, no NaN
    assert np.all(np.isfinite(np.asarray(parts[1][1]))) and np.all(
        np.asarray(parts[1][0])[:, :3] == 0
    )


# ------------------------------------------------------------------ bad input, one line each


def _trainer(mesh, **over):
    d = {
        "model.preset": "tiny",
        "parallelism.mesh": mesh,
        "train.batch_size": 8,
        "train.seq_len": 32,
        "logging.progress": False,
        "logging.tensorboard": False,
    }
    return Trainer(build({**d, **over}))


@pytest.mark.parametrize(
    "mesh,over,needle",
    [
        (
            "context=4,data=2",
            {"train.seq_len": 36},
            "--seq-len 36 is not divisible by 8 (context 4 x 2 zigzag chunks)",
        ),
        (
            "fsdp=4,model=2",
            {"train.seq_len": 33, "parallelism.sequence_parallel": True},
            "--seq-len 33 is not divisible by 2 (the residual stream's 2 sequence shards)",
        ),
        (
            "context=8",
            {"parallelism.context_strategy": "ulysses"},
            "--parallelism.context_strategy 'ulysses': valid: all_gather, ring",
        ),
        ("context=8", {"model.attention": "cudnn"}, "attention 'cudnn' needs an NVIDIA GPU"),
    ],
)
def test_bad_context_settings_are_one_line(mesh, over, needle):
    with pytest.raises(UserError) as e:
        _trainer(mesh, **over)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ the chunked loss in the step


def test_chunked_loss_gradients_equal_the_whole_head(trainers):
    """The train step's objective with the LM head + cross-entropy in chunks of 8 and of 12 tokens
    (12 does not divide 32: a padded last chunk) against the whole head: loss and every gradient."""
    batch = synthetic_batches(VOCAB, 1, seed=5)[0]
    whole = trainers("", True)
    params = initial_params(whole)
    want_loss, want = gradients(whole, params, batch)
    for chunk in (8, 12):
        got_loss, got = gradients(trainers("", True, **{"model.loss_chunk": chunk}), params, batch)
        assert got_loss == pytest.approx(want_loss, rel=1e-6)
        assert_trees_close(got, want, f"loss_chunk {chunk}", rtol=1e-6)


def test_auto_chunks_the_loss_only_where_the_logits_are_large():
    tiny = preset("tiny")
    assert loss_chunk(tiny, (8, 32)) == 0  # 264 KiB of logits: whole
    assert loss_chunk(preset("1b"), (8, 8192)) == LOSS_CHUNK  # 8 x 8192 x 128k x 4 B: chunked
    assert loss_chunk(dataclasses.replace(tiny, loss_chunk=16), (8, 32)) == 16


# ------------------------------------------------------------------ plan: bytes
# (memory per device at 4k-32k tokens and a run at 32k: tests/test_context_memory.py)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh,strategy,kind",
    [("context=8", "all_gather", "all-gather"), ("context=4,fsdp=2", "ring", "collective-permute")],
)
def test_context_traffic_matches_theory(mesh, strategy, kind):
    """The compiled step's K/V collectives over `context` against plan/theory.py's formulas."""
    d = {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "parallelism.mesh": mesh,
        "train.batch_size": 16,
        "train.seq_len": 256,
        "parallelism.context_strategy": strategy,
    }
    r = analyze(Trainer(build(d)).setup)
    th, got = r["theory_on_backend_detail"], r["collectives_detail"]
    key = f"{kind}@context"
    assert got[kind]["by_axes"]["context"]["operand_bytes"] == pytest.approx(
        th[key]["operand_bytes"], rel=0.02
    )
    if (
        strategy == "all_gather"
    ):  # the K/V gradients' reduce-scatter (CPU: an all-reduce) and the weights'
        measured = got["all-reduce"]["by_axes"]["context"]["operand_bytes"]
        assert measured == pytest.approx(th["all-reduce@context"]["operand_bytes"], rel=0.02)


def test_ring_hops_hide_behind_attention_in_the_cost_model():
    """The ring's K/V permutes run beside the block in hand's attention; the pipeline's do not."""
    from plan.cost import overlappable

    assert overlappable("collective-permute", ("context",)) and overlappable(
        "all-gather", ("context",)
    )
    assert not overlappable("collective-permute", ("pipeline",)) and not overlappable(
        "all-reduce", ("model",)
    )


@pytest.mark.slow
def test_sequence_parallel_gradients_equal_the_plain_tensor_parallel_ones(trainers):
    """The same mesh with and without the residual stream split over `model`: loss and every
    gradient, 1e-6 (only the order of the partial sums' reduction changes)."""
    batch = synthetic_batches(VOCAB, 1, seed=9)[0]
    plain = trainers("fsdp=4,model=2")
    params = initial_params(plain)
    want_loss, want = gradients(plain, params, batch)
    got_loss, got = gradients(
        trainers("fsdp=4,model=2", **{"parallelism.sequence_parallel": True}), params, batch
    )
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert_trees_close(got, want, "sequence parallel", rtol=1e-6)


def test_sequence_check_needs_both_the_zigzag_chunks_and_the_residual_shards():
    """context=2 x model=3 with sequence parallelism: 4 zigzag chunks and 6 residual shards, so
    --seq-len must be a multiple of 12 (30 has 6 shards but not 4 chunks)."""
    from mesh.rules import make_rules, sequence_parallel
    from plan.run_spec import abstract_mesh
    from train.core.config import TrainConfig
    from train.core.shapes import validate_sequence

    mesh, rules = abstract_mesh({"context": 2, "model": 3}), sequence_parallel(make_rules())
    validate_sequence(mesh, rules, TrainConfig(seq_len=36))
    with pytest.raises(UserError, match="--seq-len 30 is not divisible by 12"):
        validate_sequence(mesh, rules, TrainConfig(seq_len=30))
