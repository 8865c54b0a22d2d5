"""Compressed data-parallel sync (int8 / int4 with error feedback) against a reference written
out by hand: each replica's gradient, clipped locally, plus its residual, through the block
quantiser of mesh/collectives.py re-implemented in numpy (quantise, sum the dequantised chunks,
re-quantise the sums), then the optimizer. The framework's real train step on data=8 must give
the same new residuals and parameters, step by step after the warm-up; the per-replica
gradients themselves are checked against one device leaf by leaf.

Each compared step starts from the framework's own state before it (its params, optimizer
state and residuals): the step is what is under test, and a quantiser's rounding would turn the
float32 noise of two runs into whole quantisation steps over a trajectory."""

import functools
import operator

import jax
import numpy as np
import optax
import pytest
from equivalence import (
    ATOL_FRAC,
    BATCH,
    RTOL,
    WARMUP,
    assert_trees_close,
    initial_params,
    initial_state,
    make_trainer,
    synthetic_batches,
)

from mesh.collectives import BLOCK, QMAX
from mesh.rules import axis_rules
from mesh.shard import spec_axes
from train.core import comm
from train.core.setup import jit_step
from train.core.step import grads_loss_stats

MESH, R = "data=8", 8
CLIP = 0.5  # per-replica clipping before the sync is part of the path: low enough that it clips
TINY = {"model.preset": "tiny", "train.grad_clip": CLIP}


# ------------------------------------------------------------------ the hand-written reference


def quantise(x, bits: int, block: int):
    """Symmetric per-block quantisation of a flat float32 x -> (dequantised x, step size per
    element)."""
    x_nb = x.reshape(-1, block)
    amax_b = np.abs(x_nb).max(axis=1)
    scale_b = np.where(amax_b > 0, amax_b / np.float32(QMAX[bits]), np.float32(1.0)).astype(
        np.float32
    )
    q_nb = np.clip(np.round(x_nb / scale_b[:, None]), -QMAX[bits], QMAX[bits])
    return (q_nb * scale_b[:, None]).reshape(-1).astype(np.float32), np.repeat(scale_b, block)


def quantised_sum(x_R, bits: int):
    """[R, size] per-replica inputs -> (the sum every replica receives, new residuals [R, size],
    and the quantisation step of every element of each): the inputs cut into R chunks of whole
    blocks, chunk j summed (dequantised, float32) and re-quantised by replica j, whose residual
    also keeps that re-quantisation's error."""
    n, size = x_R.shape
    block = min(BLOCK, 2 * -(-size // (2 * n)))
    chunk = -(-size // (n * block)) * block
    x = np.zeros((n, n * chunk), np.float32)
    x[:, :size] = x_R
    deq, step_res = (np.stack(a) for a in zip(*(quantise(x[r], bits, block) for r in range(n))))
    residual = x - deq
    # [owner, chunk], summed over sources
    part_JC = deq.reshape(n, n, chunk).sum(axis=0, dtype=np.float32)
    total, step_total = np.zeros(n * chunk, np.float32), np.zeros(n * chunk, np.float32)
    for j in range(n):
        own = slice(j * chunk, (j + 1) * chunk)
        total[own], step_total[own] = quantise(part_JC[j], bits, block)
        residual[j, own] += part_JC[j] - total[own]
    step_res = np.maximum(step_res, step_total[None])
    return total[:size], residual[:, :size], step_total[:size], step_res[:, :size]


def clip_replicas(grads_R):
    """Each replica's gradient clipped to global norm CLIP -> (clipped, norms before [R])."""
    leaves = jax.tree.leaves(grads_R)
    norms_R = R * np.sqrt(
        sum(np.sum(np.square(g.reshape(R, -1), dtype=np.float64), axis=1) for g in leaves)
    )
    scale_R = np.minimum(1.0, CLIP / np.maximum(norms_R, 1e-30)).astype(np.float32)
    return jax.tree.map(lambda g: g * scale_R.reshape(-1, *[1] * (g.ndim - 1)), grads_R), norms_R


def reference_sync(grads_R, residual_R, specs, bits: int) -> dict:
    """Add each replica's residual to its gradient, sum with `quantised_sum` once per group of
    leaves that share their mesh axes (their local shards are what one device holds) -> trees
    {synced, residual, and their quantisation steps synced_step, residual_step; inputs}."""
    g_leaves, treedef = jax.tree.flatten(grads_R)
    r_leaves = treedef.flatten_up_to(residual_R)
    x = [g + r for g, r in zip(g_leaves, r_leaves)]
    groups = {}
    for i, s in enumerate(treedef.flatten_up_to(specs)):
        groups.setdefault(frozenset(spec_axes(s)), []).append(i)
    out = {k: [None] * len(x) for k in ("synced", "residual", "synced_step", "residual_step")}
    for idx in groups.values():
        flat = quantised_sum(np.concatenate([x[i].reshape(R, -1) for i in idx], axis=1), bits)
        start = 0
        for i in idx:
            size, shape = x[i][0].size, x[i].shape
            for k, v in zip(out, flat):
                out[k][i] = v[..., start : start + size].reshape(
                    shape if v.ndim == 2 else shape[1:]
                )
            start += size
    return {**{k: treedef.unflatten(v) for k, v in out.items()}, "inputs": treedef.unflatten(x)}


def assert_close_up_to_ties(
    got, want, allowed, what: str, scale=None, max_share: float = 1e-3
) -> None:
    """Leaf by leaf: |got - want| <= RTOL x |want| + ATOL_FRAC x max|scale leaf| (scale: want,
    or the inputs for residuals, which are differences of nearly equal numbers), except that up to
    `max_share` of the elements (at least 2) may differ by at most `allowed` (per element): a
    rounding tie that a last-bit difference in float32 sums decided the other way moves a value
    by one quantisation step, and the residual of the same element by as much the other way."""
    scale = want if scale is None else scale
    for (path, g), w, a, sc in zip(
        jax.tree_util.tree_leaves_with_path(got),
        *(
            jax.tree.leaves(t)
            for t in (
                want,
                jax.tree.map(lambda w, a: np.broadcast_to(a, np.shape(w)), want, allowed),
                scale,
            )
        ),
    ):
        g, w = np.asarray(g), np.asarray(w)
        diff = np.abs(g - w)
        bad = diff > RTOL * np.abs(w) + ATOL_FRAC * float(np.abs(sc).max())
        name = f"{what}: {jax.tree_util.keystr(path)}"
        assert not np.any(bad & (diff > 1.01 * a)), (
            name,
            float(diff.max()),
            int(np.sum(bad)),
            g.size,
        )
        assert np.sum(bad) <= max(2, max_share * g.size), (name, int(np.sum(bad)), g.size)


# ------------------------------------------------------------------ the framework's side


def replica_gradient_fn(tr):
    """-> f(params, batch) = (mean loss, the gradient the step syncs: each replica's share of the
    mean gradient, [R, ...] per leaf), on the host; one compile for the data=8 mesh."""
    fn = jax.jit(
        functools.partial(
            grads_loss_stats,
            tr.setup.model_cfg,
            micro_batches=1,
            dp_axes=tr.setup.dp_axes,
            per_replica=True,
        ),
        in_shardings=(tr.setup.state_shardings.params, tr.setup.batch_sharding),
    )

    def run(params, batch):
        with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
            loss, g_R, _ = fn(
                jax.device_put(params, tr.setup.state_shardings.params),
                jax.device_put(batch, tr.setup.batch_sharding),
            )
        return float(loss), jax.device_get(g_R)

    return run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The one-device trainer, the initial parameters, the batches, and the data=8 per-replica
    gradient function (the same for int8 and int4: compression does not change the gradient)."""
    one = make_trainer("", tmp_path_factory.mktemp("one"), True, **TINY)
    dp = make_trainer(MESH, tmp_path_factory.mktemp("dp"), **TINY, **{"comm.compression": "int8"})
    assert dp.setup.dp_axes == ("data",) and dp.setup.sync.error_feedback
    return (
        one,
        initial_params(one),
        synthetic_batches(one.setup.model_cfg.vocab_size),
        replica_gradient_fn(dp),
    )


@pytest.mark.slow
def test_replica_gradients_match_one_device(setup):
    """Replica r's gradient is the one-device gradient of its own rows x (its tokens / all
    tokens), leaf by leaf: the sum of the shares is the mean gradient, no replica counted twice."""
    one, params0, batches, replica_gradients = setup
    batch = batches[WARMUP]
    loss, g_R = replica_gradients(params0, batch)
    rows = BATCH // R
    one_fn = jax.jit(functools.partial(grads_loss_stats, one.setup.model_cfg, micro_batches=1))
    for r in range(R):
        piece = {k: v[r * rows : (r + 1) * rows] for k, v in batch.items()}
        _, want, _ = one_fn(params0, piece)  # the mean over the replica's rows: x 1/R for its share
        assert_trees_close(
            jax.tree.map(operator.itemgetter(r), g_R),
            jax.tree.map(lambda g: g / R, want),
            f"replica {r} gradient",
        )
    want_loss, _, _ = one_fn(params0, batch)
    np.testing.assert_allclose(loss, float(want_loss), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_compressed_step_matches_hand_reference(setup, tmp_path, compression):
    """Per step after the warm-up: sync_grads on the step's inputs equals the hand reference, and
    the train step's loss, gradient norm, new residuals and parameters equal the reference's."""
    _, params0, batches, replica_gradients = setup
    tr = make_trainer(MESH, tmp_path, **TINY, **{"comm.compression": compression})
    assert tr.setup.sync.error_feedback and tr.setup.local_clip == CLIP
    specs = jax.tree.map(lambda sh: sh.spec, tr.setup.state_shardings.params)
    bits = 8 if compression == "int8" else 4
    state = initial_state(tr, params0)
    clipped = 0
    replica_sh = tr.setup.state_shardings.residual
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        step = jit_step(tr.setup)
        sync_fn = jax.jit(
            functools.partial(
                comm.sync_grads,
                compression=compression,
                dp_axes=tr.setup.dp_axes,
                param_specs=specs,
            ),
            in_shardings=(replica_sh, replica_sh),
        )

    def sync(g_R, residual_R):
        with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
            return sync_fn(g_R, residual_R)

    for i, batch in enumerate(batches):
        before = jax.device_get(state)
        with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
            state, metrics = step(state, jax.device_put(batch, tr.setup.batch_sharding))
        if i < WARMUP:
            continue
        after = jax.device_get(state)
        loss, g_R = replica_gradients(before.params, batch)
        g_R, norms_R = clip_replicas(g_R)
        clipped += int(np.sum(norms_R > CLIP))
        ref = reference_sync(g_R, before.residual, specs, bits)
        what = f"{compression} step {i + 1}"
        # the sync alone on the very same inputs: to float32 rounding of the sums (and its ties)
        got_synced, got_residual = jax.device_get(sync(g_R, before.residual))
        assert_close_up_to_ties(
            got_synced, ref["synced"], ref["synced_step"], f"{what} sync_grads: synced"
        )
        assert_close_up_to_ties(
            got_residual,
            ref["residual"],
            ref["residual_step"],
            f"{what} sync_grads: residuals",
            scale=ref["inputs"],
        )
        # the whole step: its loss, gradient norm, residuals and parameters. Its gradients match the
        # reference's to float32 rounding only, so more quantisation ties may fall the other way; an
        # element whose synced gradient moved by one step moves its parameter by at most lr x step /
        # eps.
        updates, _ = tr.setup.tx.update(ref["synced"], before.opt_state, before.params)
        params = optax.apply_updates(before.params, updates)
        np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-5, err_msg=what)
        np.testing.assert_allclose(
            float(metrics["grad_norm"]), norms_R.mean(), rtol=1e-5, err_msg=what
        )
        assert_close_up_to_ties(
            after.residual,
            ref["residual"],
            ref["residual_step"],
            f"{what} residuals",
            scale=ref["inputs"],
        )
        lr, eps = float(metrics["lr"]), tr.cfg.train.eps
        assert_close_up_to_ties(
            after.params,
            params,
            jax.tree.map(lambda s, lr=lr, eps=eps: lr * s / eps, ref["synced_step"]),
            f"{what} params",
        )
        held = max(float(np.abs(r).max()) for r in jax.tree.leaves(after.residual))
        assert held > 0, "nothing was held back: the compression did not compress"
    assert clipped > 0, "no replica was clipped: the local clipping went untested"
