"""Pipeline parallelism over the `pipeline` mesh axis: GPipe and circular (interleaved) schedules.

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
(Megatron's interleaved order), which is why circular needs M to be a multiple of P: micro-batch m
of repeat r then comes back to stage 0 exactly one tick after leaving stage P-1, so no extra buffer
is needed. Ticks per pass: R*M + P - 1, of which P - 1 are the bubble on each device.

1F1B (models/pipeline_1f1b.py) writes its backward out instead of differentiating the scan;
pipeline_apply with schedule '1f1b' or 'zb_h1' runs the same forward ticks as gpipe (eval, inspection). The
schedules' arithmetic and charts live in models/schedules.py.

Letters: L layers, P stages, R repeats, J layers per stage chunk, M micro-batches, b micro-batch
size, A data replicas, B batch, T sequence, D model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mesh.rules import axis_rules, current_rules, logical_to_spec
from mesh.shard import entry_axes
from models.config import SCHEDULES, PipelineConfig
from models.pieces import over_groups
from models.schedules import (
    bubble_fraction,
    iteration,
    n_ticks,
    permute_bytes_theory,
    plot_schedule,
    schedule_chart,
    schedule_table,
    stage_layers,
    validate,
)

# The config lives with the model's, the schedules' arithmetic, charts and checks in
# models/schedules.py; callers know both as pipeline.X.
__all__ = [
    "FULL_REMAT",
    "SCHEDULES",
    "PipelineConfig",
    "bubble_fraction",
    "iteration",
    "n_ticks",
    "permute_bytes_theory",
    "pipeline_apply",
    "plot_schedule",
    "schedule_chart",
    "schedule_table",
    "stage_layers",
    "to_model_order",
    "to_stage_order",
    "validate",
]

FULL_REMAT = jax.checkpoint_policies.nothing_saveable
_FREE = PartitionSpec.UNCONSTRAINED


# ------------------------------------------------------------------------------ layer order


def to_stage_order(params: Any, stages: int, repeats: int) -> Any:
    """Reorder a [L, ...] layer stack so that each pipeline device's circular chunks are contiguous
    (device s: chunks s, s+P, ...), i.e. the order a 'layers' -> 'pipeline' sharding splits into
    local blocks; pass the result with `stage_ordered=True`. For gpipe (R = 1) it is the identity."""

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


def _spec(names: tuple[str | None, ...], free_from: int) -> PartitionSpec:
    """The spec of `names`, with dims from `free_from` on left to the partitioner."""
    spec = list(logical_to_spec(names))
    return PartitionSpec(*spec[:free_from], *[_FREE] * (len(spec) - free_from))


def _pin(x: jax.Array, names: tuple[str | None, ...], free_from: int | None = None) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    names = names + (None,) * (x.ndim - len(names))
    return jax.lax.with_sharding_constraint(
        x, _spec(names, x.ndim if free_from is None else free_from)
    )


def _act_names(ndim: int) -> tuple[str | None, ...]:
    """Logical names of one micro-batch [b, T, D, ...] (the Decoder's activation layout)."""
    return ("batch", "seq", "act_embed")[:ndim] + (None,) * max(0, ndim - 3)


@jax.custom_vjp
def _shift(y_P: jax.Array) -> jax.Array:
    """Stage s's output becomes stage s+1's input (and the last stage's stage 0's): one
    collective-permute. jnp.roll's own transpose lowers to two half permutes (pad + slice)."""
    return jnp.roll(y_P, 1, axis=0)


_shift.defvjp(lambda y: (_shift(y), None), lambda _, ct: (jnp.roll(ct, -1, axis=0),))


def _mesh_size(axes) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape[a] for a in axes)


def _inner_rules(replica_axes: tuple[str, ...]) -> dict:
    """The rules inside the pipeline. The stage dim owns the 'stages' mesh axes and the replica
    dim (see pipeline_apply) owns `replica_axes`, so every other logical axis drops them: e.g. a
    rule batch -> data+fsdp+expert+pipeline (which splits the embedding and head's batch over
    'pipeline' too) shards a micro-batch's rows over fsdp+expert inside, data being the replica dim."""
    rules = current_rules()
    taken = set(rules.get("stages", ())) | set(replica_axes)
    inner = {name: tuple(a for a in axes if a not in taken) for name, axes in rules.items()}
    return inner | {"stages": tuple(rules.get("stages", ())), _REPLICAS: replica_axes}


_REPLICAS = "pipeline_replicas"  # logical name of the replica dim, only inside the pipeline


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
    L, B = jax.tree.leaves(params)[0].shape[0], x_BTD.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = entry_axes(logical_to_spec(("stages", "batch"))[1]) if not mesh.empty else ()
    replicas = tuple(a for a in batch_axes if a in replica_axes and mesh.shape[a] > 1)
    with axis_rules(_inner_rules(replicas)):
        validate(
            n_layers=L,
            batch=B,
            stages=stages,
            microbatches=microbatches,
            repeats=repeats,
            schedule=schedule,
            batch_shards=_mesh_size(batch_axes),
        )
        out_PMAbTD, aux = _pipeline(
            layer_fn,
            params,
            x_BTD,
            batch_args,
            stages,
            microbatches,
            repeats,
            _mesh_size(replicas),
            remat_policy,
            remat_stage,
            has_aux,
            scan_layers,
            stage_ordered,
        )
    # rows other than the last stage's are zeros: the sum is one reduction over 'pipeline' per step
    y = out_PMAbTD.sum(axis=0)  # [M, A, b/A, ...]
    y_BTD = _pin(jnp.moveaxis(y, 0, 2).reshape(x_BTD.shape), _act_names(x_BTD.ndim))
    return (y_BTD, aux) if has_aux else y_BTD


def _pipeline(
    layer_fn,
    params,
    x_BTD,
    batch_args,
    P,
    M,
    R,
    A,
    remat_policy,
    remat_stage,
    has_aux,
    scan_layers,
    stage_ordered,
):
    """-> (outputs [P, M, A, b/A, ...], zero except the last stage's row; aux [L, ...] or ())."""
    # One function on purpose (~85 lines): the tick body and the schedule's masks and shifts are
    # closures over the same shapes (P, M, R, A, J) and names; split, each piece would take them all.
    L, B = jax.tree.leaves(params)[0].shape[0], x_BTD.shape[0]
    J, b = L // (R * P), B // M
    stage_axis = (
        logical_to_spec(("stages",))[0] if not jax.sharding.get_abstract_mesh().empty else None
    )
    replica_axis = logical_to_spec((_REPLICAS,))[0] if A > 1 else None
    piece = (_REPLICAS,) + _act_names(x_BTD.ndim)  # [A, b/A, T, D]: one micro-batch
    state_names = ("stages",) + piece
    stage_P = jnp.arange(P)
    bcast = lambda mask_P, extra=0: mask_P.reshape(P, *[1] * (x_BTD.ndim + 1 + extra))

    # [L, ...] -> [A, R, P, J, ...]: layer (r*P + s)*J + k sits at [:, r, s, k]; the A copies are
    # views of the same weights, one per replica, so that each replica's gradient stays local
    to_RPJ = (
        (lambda a: a.reshape(P, R, J, *a.shape[1:]).swapaxes(0, 1))
        if stage_ordered
        else (lambda a: a.reshape(R, P, J, *a.shape[1:]))
    )
    params_ARPJ = jax.tree.map(
        lambda a: _pin(
            jnp.broadcast_to(to_RPJ(a), (A, R, P, J, *a.shape[1:])), (_REPLICAS, None, "stages"), 3
        ),
        params,
    )

    def split(
        a,
    ):  # [B, ...] -> [M, A, b/A, ...]; micro-batch m = rows m, m+M, ... keeps batch shards local
        return _pin(
            a.reshape(A, b // A, M, *a.shape[1:]).transpose(2, 0, 1, *range(3, a.ndim + 2)),
            (None, _REPLICAS) + _act_names(a.ndim),
        )

    # Fresh micro-batches enter from a stage-sharded copy whose other rows are zero: every tick's
    # read stays on its device, and the backward pass sums the input gradients over 'pipeline' once
    # at the end instead of once per tick.
    in_names = ("stages", None) + piece
    in_PMAbTD = _pin(jnp.where(bcast(stage_P == 0, 1), split(x_BTD)[None], 0), in_names)
    args_M = [split(a) for a in batch_args]

    def layer_at(x_bTD, p_RJ, r, k, *args_b):
        # Picking the layer's weights inside the remat region keeps per-tick copies of them out of
        # the residuals saved for the backward pass (only the loop-invariant stack is kept).
        out = layer_fn(x_bTD, jax.tree.map(lambda a: a[r, k], p_RJ), *args_b)
        return out if has_aux else (out, ())

    layer = layer_at if remat_policy is None else jax.checkpoint(layer_at, policy=remat_policy)

    def stage(x_bTD, p_RJ, r, *args_b):  # -> (x_bTD, aux stacked [J, ...])
        return jax.lax.scan(
            lambda x, k: layer(x, p_RJ, r, k, *args_b),
            x_bTD,
            jnp.arange(J),
            unroll=1 if scan_layers else J,
        )

    if remat_stage:
        stage = jax.checkpoint(stage, policy=FULL_REMAT)
    n_args = len(args_M)
    per_replica = jax.vmap(stage, in_axes=(0, 0, None) + (0,) * n_args, spmd_axis_name=replica_axis)
    run_stages = jax.vmap(per_replica, in_axes=(0, 2, 0) + (0,) * n_args, spmd_axis_name=stage_axis)

    def tick(carry, t):
        state_PAbTD, out_PMAbTD, aux_RPAJ = carry
        i_P = t - stage_P  # the pair index each stage runs now
        m_P, r_P = iteration(jnp.clip(i_P, 0, R * M - 1), P, M, R)
        # stage 0 takes a fresh micro-batch on its first repeat, else what the last stage just rolled in
        m0, _ = iteration(jnp.clip(t, 0, R * M - 1), P, M, R)
        fresh = (stage_P == 0) & (r_P == 0)
        new_P = jax.lax.dynamic_index_in_dim(in_PMAbTD, m0, axis=1, keepdims=False)
        in_P = _pin(jnp.where(bcast(fresh), new_P, state_PAbTD), state_names)
        args_P = [_pin(a[m_P], ("stages", _REPLICAS) + _act_names(a.ndim - 2)) for a in args_M]
        y_P, aux_PAJ = run_stages(in_P, params_ARPJ, r_P, *args_P)
        y_P = _pin(y_P, state_names)
        # each stage adds its layers' aux of this micro-batch into its (repeat, stage) slot, bubbles excluded
        valid_P = (i_P >= 0) & (i_P < R * M)
        aux_RPAJ = jax.tree.map(
            lambda acc, a: (
                acc
                + jax.vmap(
                    lambda a_AJ, r, ok: (
                        jnp.zeros((R,) + a_AJ.shape, acc.dtype)
                        .at[r]
                        .set(jnp.where(ok, a_AJ / (M * A), 0))
                    ),
                    out_axes=1,
                    spmd_axis_name=stage_axis,
                )(a, r_P, valid_P)
            ),
            aux_RPAJ,
            aux_PAJ,
        )
        # only the last stage on its last repeat finishes a micro-batch; it writes it to its own row
        i_last = t - (P - 1)
        m_last, r_last = iteration(jnp.clip(i_last, 0, R * M - 1), P, M, R)
        done = (stage_P == P - 1) & (r_last == R - 1) & (i_last >= 0)
        cur = jax.lax.dynamic_index_in_dim(out_PMAbTD, m_last, axis=1, keepdims=False)
        out_PMAbTD = jax.lax.dynamic_update_index_in_dim(
            out_PMAbTD, jnp.where(bcast(done), y_P, cur), m_last, axis=1
        )
        return (_pin(_shift(y_P), state_names), out_PMAbTD, aux_RPAJ), None

    state0 = _pin(jnp.zeros((P, A, b // A, *x_BTD.shape[1:]), x_BTD.dtype), state_names)
    out0 = _pin(jnp.zeros((P, M, A, b // A, *x_BTD.shape[1:]), x_BTD.dtype), in_names)
    aux0 = ()
    if has_aux:  # the aux tree's shapes, from tracing one layer on one piece
        aux_shapes = jax.eval_shape(
            lambda: layer_fn(
                state0[0, 0], jax.tree.map(lambda a: a[0], params), *[a[0, 0] for a in args_M]
            )[1]
        )
        acc_dtype = lambda dt: (
            dt if jnp.issubdtype(dt, jnp.floating) else jnp.float32
        )  # means of counts
        aux0 = jax.tree.map(
            lambda sd: _pin(
                jnp.zeros((R, P, A, J) + sd.shape, acc_dtype(sd.dtype)), (None, "stages", _REPLICAS)
            ),
            aux_shapes,
        )
    (_, out_PMAbTD, aux_RPAJ), _ = jax.lax.scan(
        tick, (state0, out0, aux0), jnp.arange(n_ticks(P, M, R))
    )
    # [R, P, J] is layer order; the replicas' means are averaged once, here
    aux = jax.tree.map(lambda a: a.sum(axis=2).reshape(L, *a.shape[4:]), aux_RPAJ)
    return out_PMAbTD, aux


# ------------------------------------------------------------------------------ a model's stack


def stages() -> int:
    """The pipeline axis's size on the mesh in context (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "pipeline" not in mesh.shape else mesh.shape["pipeline"]


def replicas(replica_axes: tuple[str, ...]) -> int:
    """How many data replicas pipeline_apply splits each micro-batch into (its dim A)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = [a for a in current_rules()["batch"] if a not in current_rules()["stages"]]
    return math.prod(mesh.shape[a] for a in batch_axes if a in replica_axes)


def sum_counts(stats: dict, names: tuple[str, ...], pieces: int) -> dict:
    """Stats that are sums over tokens (`names`) from the pipeline's means over `pieces` of the batch."""
    return {k: v * pieces if k in names else v for k, v in stats.items()}


def stack_forward(pieces, stack, x_BTD, positions_BT, segment_ids_BT=None, *, pipeline=None):
    """The model's layer groups on x_BTD -> (x_BTD, stats stacked [G, ...]): through pipeline_apply
    on a mesh with pipeline > 1 (`pipeline`'s schedule, default PipelineConfig(); the explicit
    schedules run the same forward ticks), else a scan (or unrolled loop) over the groups."""
    seg = () if segment_ids_BT is None else (segment_ids_BT,)
    policy, P = pieces.remat_policy, stages()
    if P > 1:
        pc = pipeline or PipelineConfig()
        M = pc.microbatches_for(P)
        x_BTD, stats = pipeline_apply(
            pieces.group,
            stack,
            x_BTD,
            positions_BT,
            *seg,
            stages=P,
            microbatches=M,
            repeats=pc.repeats,
            schedule=pc.schedule,
            remat_policy=policy,
            remat_stage=pc.remat_stage,
            has_aux=True,
            scan_layers=pieces.scan_layers,
            replica_axes=pc.replica_axes,
        )
        return x_BTD, sum_counts(stats, pieces.count_stats, M * replicas(pc.replica_axes))
    step = lambda x_BTD, params_G: pieces.group(x_BTD, params_G, positions_BT, *seg)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy, prevent_cse=not pieces.scan_layers)
    return over_groups(step, x_BTD, stack, pieces.scan_layers)
