"""The forward-scan engine: GPipe and circular (interleaved) schedules, whose backward pass is
autodiff of a scan of forward ticks.

The L stacked layers are cut into P stages (logical axis 'stages' -> mesh axis 'pipeline'); the
batch is cut into M micro-batches that flow through the stages, one stage per tick. Sharding-driven,
no shard_map: a state buffer [P, b, T, D] (b = B/M) is sharded over the stage dim, every tick runs
the stage function vmapped over that dim (each pipeline device computes its own stage), then
`jnp.roll`s the buffer one stage forward, which XLA lowers to one collective-permute over
`pipeline`. The ticks are one `lax.scan`, so compile time does not grow with M; the backward pass
is plain autodiff of that scan (a reverse scan whose permutes carry the activation gradients back).
Each data-parallel replica also gets its own broadcast view of the weights (dim A), so that weight
gradients accumulate locally across ticks and are reduced over 'data' once per step.

Circular (`repeats` R > 1): virtual stage v = r*P + s holds layers [v*J, (v+1)*J), J = L/(R*P), so
device s holds the non-adjacent chunks s, s+P, s+2P, ...; a micro-batch leaving the last stage
re-enters stage 0 for its next repeat through the same roll. Micro-batches go round in groups of P
(Megatron's interleaved order, timetables.iteration), which is why circular needs M to be a
multiple of P: micro-batch m of repeat r then comes back to stage 0 exactly one tick after leaving
stage P-1, so no extra buffer is needed. Ticks per pass: R*M + P - 1, of which P - 1 are the
bubble on each device.

The explicit schedules (1f1b, interleaved_1f1b, zb_h1: explicit.py) write their backward out
instead; `pipeline_apply` with one of them runs the same forward ticks as gpipe or circular (a
forward without gradient: evaluation, logits).

Letters as in models/pipeline/__init__.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mesh.rules import axis_rules
from models.pipeline.checks import validate
from models.pipeline.layout import (
    REPLICAS,
    act_names,
    batch_axes,
    inner_rules,
    mesh_size,
    pin,
    replica_axes_of,
    replica_axis,
    split_microbatches,
    stage_axis,
)
from models.pipeline.timetables import iteration, n_ticks

FULL_REMAT = jax.checkpoint_policies.nothing_saveable


# ------------------------------------------------------------------------------ layer order


def to_stage_order(params: Any, stages: int, repeats: int) -> Any:
    """Reorder a [L, ...] layer stack so that each pipeline device's circular chunks are contiguous
    (device s: chunks s, s+P, ...), i.e. the order a 'layers' -> 'pipeline' sharding splits into
    local blocks; pass the result with `stage_ordered=True`. For gpipe (R = 1) it is the
    identity."""

    def f(a):
        k = a.shape[0] // (stages * repeats)
        return a.reshape(repeats, stages, k, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)

    return jax.tree.map(f, params)


def to_model_order(params: Any, stages: int, repeats: int) -> Any:
    """The inverse of `to_stage_order`."""

    def f(a):
        k = a.shape[0] // (stages * repeats)
        return a.reshape(stages, repeats, k, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)

    return jax.tree.map(f, params)


# ------------------------------------------------------------------------------ the pipeline


@jax.custom_vjp
def _shift(y_P: jax.Array) -> jax.Array:
    """Stage s's output becomes stage s+1's input (and the last stage's stage 0's): one
    collective-permute. jnp.roll's own transpose lowers to two half permutes (pad + slice)."""
    return jnp.roll(y_P, 1, axis=0)


_shift.defvjp(lambda y: (_shift(y), None), lambda _, ct: (jnp.roll(ct, -1, axis=0),))


def pipeline_apply(
    layer_fn: Callable[..., jax.Array],
    params: Any,
    x_BTD: jax.Array,
    *batch_args: jax.Array,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    schedule: str = "gpipe",
    remat_policy=FULL_REMAT,
    remat_stage: bool = False,
    has_aux: bool = False,
    scan_layers: bool = True,
    replica_axes: tuple[str, ...] = ("data",),
    stage_ordered: bool = False,
):
    """Apply the L stacked layers of `params` (every leaf [L, ...]) to x_BTD through a P-stage
    pipeline; equals `lax.scan(lambda x, p: (layer_fn(x, p, *args), None), x, params)`.

    layer_fn(x_bTD, layer_params, *args_b) -> x_bTD runs one layer on a piece of the batch; it must
    treat examples independently. `batch_args` are arrays with a leading batch dim (positions,
    segment ids) split alongside x. With `has_aux` layer_fn returns (x_bTD, aux) (e.g. MoE router
    stats) and pipeline_apply returns (y_BTD, aux stacked [L, ...]): the mean over the pieces of
    the batch the layer saw (micro-batches x replicas).
    `remat_policy` is applied to every layer (None: no remat); `remat_stage` also recomputes each
    stage's forward in the backward pass, so that only stage inputs are kept per tick.
    `scan_layers=False` unrolls the layers inside a stage (the ticks are always one scan).

    Sharding: params are reshaped to [R, P, J, ...] with P on 'stages'. Their L dim should be stored
    sharded over 'pipeline' (rule layers -> pipeline) so that each device keeps only its own layers;
    for gpipe that reshape is then free, for circular it regroups the layers (a per-step all-to-all
    of the weights) unless the stack is stored in stage order (`to_stage_order`, `stage_ordered`).
    `replica_axes`: batch mesh axes over which the weights are replicated (pure data parallelism).
    Each replica runs the stages with its own view of the weights (a [A, ...] broadcast, A = their
    size), so the weight gradients accumulate locally over the ticks and are summed over those axes
    once per step instead of once per tick and layer. Listing an axis that shards the weights
    (fsdp) all-gathers them over it once per step (MaxText's pipeline_fsdp_ag_once: fewer
    collectives, the memory of the gathered stage weights and their gradients); otherwise fsdp
    gathers and reduces them every tick and layer. Never list 'expert' (expert parallelism).
    """
    # Long on purpose: the docstring above is the forward-scan engine's contract (sharding,
    # replicas, remat); the body is ~25 lines.
    L, B = jax.tree.leaves(params)[0].shape[0], x_BTD.shape[0]
    replicas = replica_axes_of(replica_axes)
    with axis_rules(inner_rules(replicas)):
        validate(
            n_layers=L,
            batch=B,
            stages=stages,
            microbatches=microbatches,
            repeats=repeats,
            schedule=schedule,
            batch_shards=mesh_size(batch_axes()),
        )
        scan = _Ticks(
            layer_fn, L, x_BTD, stages, microbatches, repeats, mesh_size(replicas), has_aux
        )
        stage = scan.stage_fn(layer_fn, remat_policy, remat_stage, scan_layers)
        out_PMAbTD, aux = scan.run(stage, params, x_BTD, batch_args, stage_ordered)
    # rows other than the last stage's are zeros: the sum is one reduction over 'pipeline' per step
    y = out_PMAbTD.sum(axis=0)  # [M, A, b/A, ...]
    y_BTD = pin(jnp.moveaxis(y, 0, 2).reshape(x_BTD.shape), act_names(x_BTD.ndim))
    return (y_BTD, aux) if has_aux else y_BTD


class _Ticks:
    """The forward ticks for one shape (P, M, R, A, J): the stage function vmapped over stages
    and replicas, the layout of the weights and micro-batches, the tick body."""

    def __init__(self, layer_fn, L, x_BTD, P, M, R, A, has_aux):
        self.layer_fn, self.L, self.P, self.M, self.R, self.A = layer_fn, L, P, M, R, A
        self.J, self.b, self.has_aux = L // (R * P), x_BTD.shape[0] // M, has_aux
        self.piece = (REPLICAS,) + act_names(x_BTD.ndim)  # [A, b/A, T, D]: one micro-batch
        self.state_names = ("stages",) + self.piece
        self.in_names = ("stages", None) + self.piece
        self.stage_P = jnp.arange(P)
        self.ndim = x_BTD.ndim

    def bcast(self, mask_P, extra=0):
        return mask_P.reshape(self.P, *[1] * (self.ndim + 1 + extra))

    def stage_fn(self, layer_fn, remat_policy, remat_stage, scan_layers):
        """(x_PAbTD, params_ARPJ, r_P, *args_PAb) -> (y_PAbTD, aux [P, A, J, ...]): every stage
        runs its J layers of chunk r on its own piece of the micro-batch."""

        def layer_at(x_bTD, p_RJ, r, k, *args_b):
            # Picking the layer's weights inside the remat region keeps per-tick copies of them out
            # of the residuals saved for the backward pass (only the loop-invariant stack is kept).
            out = layer_fn(x_bTD, jax.tree.map(lambda a: a[r, k], p_RJ), *args_b)
            return out if self.has_aux else (out, ())

        layer = layer_at if remat_policy is None else jax.checkpoint(layer_at, policy=remat_policy)

        def stage(x_bTD, p_RJ, r, *args_b):  # -> (x_bTD, aux stacked [J, ...])
            return jax.lax.scan(
                lambda x, k: layer(x, p_RJ, r, k, *args_b),
                x_bTD,
                jnp.arange(self.J),
                unroll=1 if scan_layers else self.J,
            )

        if remat_stage:
            stage = jax.checkpoint(stage, policy=FULL_REMAT)
        return stage

    def weights(self, params, stage_ordered):
        """[L, ...] -> [A, R, P, J, ...]: layer (r*P + s)*J + k sits at [:, r, s, k]; the A copies
        are views of the same weights, one per replica, so that each replica's gradient stays
        local."""
        P, R, J, A = self.P, self.R, self.J, self.A

        def to_ARPJ(a):
            if stage_ordered:
                a_RPJ = a.reshape(P, R, J, *a.shape[1:]).swapaxes(0, 1)
            else:
                a_RPJ = a.reshape(R, P, J, *a.shape[1:])
            a_ARPJ = jnp.broadcast_to(a_RPJ, (A, R, P, J, *a.shape[1:]))
            return pin(a_ARPJ, (REPLICAS, None, "stages"), 3)

        return jax.tree.map(to_ARPJ, params)

    def run(self, stage, params, x_BTD, batch_args, stage_ordered):
        """-> (outputs [P, M, A, b/A, ...], zero but the last stage's row; aux [L, ...] or ())."""
        P, M, R, A = self.P, self.M, self.R, self.A
        n_args = len(batch_args)
        per_replica = jax.vmap(
            stage, in_axes=(0, 0, None) + (0,) * n_args, spmd_axis_name=replica_axis(A)
        )
        run_stages = jax.vmap(
            per_replica, in_axes=(0, 2, 0) + (0,) * n_args, spmd_axis_name=stage_axis()
        )
        params_ARPJ = self.weights(params, stage_ordered)
        # Fresh micro-batches enter from a stage-sharded copy whose other rows are zero: every
        # tick's read stays on its device, and the backward pass sums the input gradients over
        # 'pipeline' once at the end instead of once per tick.
        first_P = self.bcast(self.stage_P == 0, 1)
        x_MAbTD = split_microbatches(x_BTD, M, A)
        in_PMAbTD = pin(jnp.where(first_P, x_MAbTD[None], 0), self.in_names)
        args_M = [split_microbatches(a, M, A) for a in batch_args]
        tick = functools.partial(
            self.tick,
            run_stages=run_stages,
            params_ARPJ=params_ARPJ,
            in_PMAbTD=in_PMAbTD,
            args_M=args_M,
        )
        state0 = jnp.zeros((P, A, self.b // A, *x_BTD.shape[1:]), x_BTD.dtype)
        state0 = pin(state0, self.state_names)
        out0 = pin(jnp.zeros((P, M, *state0.shape[1:]), x_BTD.dtype), self.in_names)
        aux0 = self.aux_zeros(state0, params, args_M) if self.has_aux else ()
        (_, out_PMAbTD, aux_RPAJ), _ = jax.lax.scan(
            tick, (state0, out0, aux0), jnp.arange(n_ticks(P, M, R))
        )
        # [R, P, J] is layer order; the replicas' means are averaged once, here
        aux = jax.tree.map(lambda a: a.sum(axis=2).reshape(self.L, *a.shape[4:]), aux_RPAJ)
        return out_PMAbTD, aux

    def aux_zeros(self, state0, params, args_M):
        """The aux accumulators [R, P, A, J, ...], float32 for integer aux (means of counts); the
        aux tree's shapes from tracing one layer on one piece."""
        aux_shapes = jax.eval_shape(
            lambda: self.layer_fn(
                state0[0, 0], jax.tree.map(lambda a: a[0], params), *[a[0, 0] for a in args_M]
            )[1]
        )

        def zeros(sd):
            dtype = sd.dtype if jnp.issubdtype(sd.dtype, jnp.floating) else jnp.float32
            shape = (self.R, self.P, self.A, self.J) + sd.shape
            return pin(jnp.zeros(shape, dtype), (None, "stages", REPLICAS))

        return jax.tree.map(zeros, aux_shapes)

    def tick(self, carry, t, run_stages, params_ARPJ, in_PMAbTD, args_M):
        P, M, R, stage_P, names = self.P, self.M, self.R, self.stage_P, self.state_names
        state_PAbTD, out_PMAbTD, aux_RPAJ = carry
        i_P = t - stage_P  # the pair index each stage runs now
        m_P, r_P = iteration(jnp.clip(i_P, 0, R * M - 1), P, M, R)
        # stage 0 takes a fresh micro-batch on its first repeat, else what the last stage just
        # rolled in
        m0, _ = iteration(jnp.clip(t, 0, R * M - 1), P, M, R)
        fresh = (stage_P == 0) & (r_P == 0)
        new_P = jax.lax.dynamic_index_in_dim(in_PMAbTD, m0, axis=1, keepdims=False)
        in_P = pin(jnp.where(self.bcast(fresh), new_P, state_PAbTD), names)
        args_P = [pin(a[m_P], ("stages", REPLICAS) + act_names(a.ndim - 2)) for a in args_M]
        y_P, aux_PAJ = run_stages(in_P, params_ARPJ, r_P, *args_P)
        y_P = pin(y_P, names)
        valid_P = (i_P >= 0) & (i_P < R * M)
        aux_RPAJ = self.add_aux(aux_RPAJ, aux_PAJ, r_P, valid_P)
        # only the last stage on its last repeat finishes a micro-batch; it writes it to its own row
        i_last = t - (P - 1)
        m_last, r_last = iteration(jnp.clip(i_last, 0, R * M - 1), P, M, R)
        done = (stage_P == P - 1) & (r_last == R - 1) & (i_last >= 0)
        cur = jax.lax.dynamic_index_in_dim(out_PMAbTD, m_last, axis=1, keepdims=False)
        out_PMAbTD = jax.lax.dynamic_update_index_in_dim(
            out_PMAbTD, jnp.where(self.bcast(done), y_P, cur), m_last, axis=1
        )
        return (pin(_shift(y_P), names), out_PMAbTD, aux_RPAJ), None

    def add_aux(self, aux_RPAJ, aux_PAJ, r_P, valid_P):
        """Each stage adds its layers' aux of this micro-batch into its (repeat, stage) slot,
        bubbles excluded, as a share of the mean over the M x A pieces."""
        R, pieces = self.R, self.M * self.A

        def add(acc, a):
            def one_stage(a_AJ, r, ok):
                share = jnp.where(ok, a_AJ / pieces, 0)
                return jnp.zeros((R,) + a_AJ.shape, acc.dtype).at[r].set(share)

            by_stage = jax.vmap(one_stage, out_axes=1, spmd_axis_name=stage_axis())
            return acc + by_stage(a, r_P, valid_P)

        return jax.tree.map(add, aux_RPAJ, aux_PAJ)
