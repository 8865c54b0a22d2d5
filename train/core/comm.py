"""Data-parallel gradient sync for the train step (plain, int8, int4, top-k, with error
feedback) and the building blocks of local SGD / DiLoCo. Pure functions; no I/O.

Per-replica arrays carry a leading [R] dim (R = n_dp, the product of the data-parallel mesh
axes) sharded over those axes, so each device holds only its own replica's slice: gradients
before the sync, error-feedback residuals, DiLoCo's parameter drift. The residuals and the drift
live in the train state, so checkpoints keep them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.collectives import compressed_psum
from mesh.shard import spec_axes
from train.core.sections import COMPRESSIONS, error_feedback_on  # noqa: F401  (jax-free: flag parsing uses it)


@dataclasses.dataclass(frozen=True)
class SyncLayout:
    """What the data-parallel sync keeps in the state: per-replica arrays, leading dim [R]."""

    dp_axes: tuple[str, ...] = ()
    error_feedback: bool = False  # residual [R, ...]
    # DiLoCo: drift, per-replica opt_state, outer_opt
    outer_tx: optax.GradientTransformation | None = None

    def replicas(self, mesh: Mesh) -> int:
        return math.prod(mesh.shape[a] for a in self.dp_axes)


# nothing kept per replica: no data-parallel axes, or a plain all-reduce of the gradients
NO_SYNC = SyncLayout()


def sync_layout(comm_cfg, dp_axes: tuple[str, ...], grad_clip: float) -> tuple[SyncLayout, float]:
    """What the --comm settings ask the state to carry over the data-parallel axes `dp_axes`
    (error-feedback residuals, or DiLoCo's drift and outer optimizer; nothing without dp axes:
    there is nothing to sync), and the norm each replica clips its gradient to before a
    compressed sync (0: the optimizer chain clips the synced gradient instead)."""
    if not dp_axes:
        return NO_SYNC, 0.0
    if comm_cfg.sync_every > 1:
        return SyncLayout(
            dp_axes, outer_tx=outer_optimizer(comm_cfg.outer_lr, comm_cfg.outer_momentum)
        ), 0.0
    compressed = comm_cfg.compression != "none"
    return (
        SyncLayout(
            dp_axes, error_feedback=error_feedback_on(comm_cfg.compression, comm_cfg.error_feedback)
        ),
        grad_clip if compressed else 0.0,
    )


def replica_spec(spec: P, dp_axes: tuple[str, ...]) -> P:
    """The PartitionSpec of a per-replica [R, ...] array whose [...] part is sharded by `spec`."""
    return P(tuple(dp_axes) or None, *spec)


def init_residual(params: Any, n_dp: int) -> Any:
    """Zero error-feedback residuals [R, ...] float32 (each sharded `replica_spec(param spec,
    dp_axes)`)."""
    return jax.tree.map(lambda p: jnp.zeros((n_dp, *p.shape), jnp.float32), params)


# ---------------------------------------------------------------------------------------------
# Gradient sync


def sync_grads(
    grads_R: Any,
    residual_R: Any | None,
    *,
    compression: str,
    dp_axes: tuple[str, ...],
    param_specs: Any,
    topk_fraction: float = 0.01,
    mesh=None,
) -> tuple[Any, Any | None]:
    """Sum the per-replica gradients over the data-parallel mesh axes.

    grads_R: [R, ...] per leaf, sharded `replica_spec(param spec, dp_axes)`; each replica's
      share of the mean gradient (its gradient sum / the global token count), so their sum is
      the mean gradient.
    residual_R: error-feedback state shaped like grads_R, or None (no error feedback).
    -> (gradient sharded by `param_specs`, identical on every replica; new residual_R or None).

    `none` is `grads_R.sum(0)`: XLA's own all-reduce, bit-identical to the step without this
    module. The others run `mesh.collectives.compressed_psum` inside shard_map, once per group
    of leaves that share a sharding (a group's bytes are the same on every device that holds
    them, so every such device quantises them alike and replicas stay identical).
    """
    if compression not in COMPRESSIONS:
        raise UserError(
            f"--comm.compression: '{compression}' is not one of {', '.join(COMPRESSIONS)}"
        )
    if compression == "none" or not dp_axes:
        return jax.tree.map(lambda g: g.sum(0), grads_R), residual_R
    g_leaves, treedef = jax.tree.flatten(grads_R)
    specs = treedef.flatten_up_to(param_specs)
    r_leaves = treedef.flatten_up_to(residual_R) if residual_R is not None else None
    groups = defaultdict(list)  # leaves whose local shards are replicated over the same axes
    for i, s in enumerate(specs):
        groups[frozenset(spec_axes(s))].append(i)

    local = functools.partial(
        _local_sync, list(groups.values()), dp_axes, compression, topk_fraction
    )
    rspecs = [replica_spec(s, dp_axes) for s in specs]
    kw = {} if mesh is None else {"mesh": mesh}
    if r_leaves is None:
        out = jax.shard_map(local, in_specs=(rspecs,), out_specs=specs, **kw)(g_leaves)
        return treedef.unflatten(out), None
    out, res = jax.shard_map(local, in_specs=(rspecs, rspecs), out_specs=(specs, rspecs), **kw)(
        g_leaves, r_leaves
    )
    return treedef.unflatten(out), treedef.unflatten(res)


def _local_sync(groups, dp_axes, compression, topk_fraction, g_leaves, r_leaves=None):
    """sync_grads's shard_map body on one device: each group of leaves (`groups`: their indices)
    flattened into one buffer, compressed and summed over `dp_axes` -> the summed leaves (and the
    new residuals with `r_leaves`)."""
    x = (
        [g[0] + r[0] for g, r in zip(g_leaves, r_leaves)]
        if r_leaves is not None
        else [g[0] for g in g_leaves]
    )
    out, res = [None] * len(x), [None] * len(x)
    for idx in groups:
        flat = jnp.concatenate([x[i].reshape(-1).astype(jnp.float32) for i in idx])
        total, residual = compressed_psum(flat, dp_axes, compression, fraction=topk_fraction)
        start = 0
        for i in idx:
            size = x[i].size
            out[i] = total[start : start + size].reshape(x[i].shape).astype(g_leaves[i].dtype)
            res[i] = residual[start : start + size].reshape((1, *x[i].shape))
            start += size
    return (out, res) if r_leaves is not None else out


def replica_norms(grads_R: Any) -> jax.Array:
    """[R] global norms of each replica's own mean gradient (R x its share), computed locally."""
    n_dp = jax.tree.leaves(grads_R)[0].shape[0]
    return n_dp * jax.vmap(optax.tree.norm)(grads_R)


def clip_replicas(grads_R: Any, max_norm: float, norms_R: jax.Array | None = None) -> Any:
    """Clip each replica's gradient to global norm `max_norm` before a compressed sync (local
    clipping, Lin et al. 2018): clipping the synced sum instead would cut the bursts that error
    feedback releases, which carry many steps' worth of a coordinate's gradient. `norms_R`:
    `replica_norms(grads_R)` when the caller has it already."""
    norms_R = replica_norms(grads_R) if norms_R is None else norms_R
    scale_R = jnp.minimum(1.0, max_norm / jnp.maximum(norms_R, 1e-30))
    return jax.tree.map(
        lambda g: g * scale_R.reshape(-1, *[1] * (g.ndim - 1)).astype(g.dtype), grads_R
    )


# ---------------------------------------------------------------------------------------------
# Local SGD / DiLoCo


@flax.struct.dataclass
class OuterState:
    params: Any  # the global parameters every replica starts a round from (replicated over dp)
    opt_state: Any  # the outer optimizer's state (Nesterov momentum buffer), like params


def outer_optimizer(lr: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer (Douillard et al. 2023: SGD, Nesterov momentum 0.9, lr 0.7);
    momentum 0 is plain SGD, and lr 1.0 with momentum 0 is parameter averaging."""
    return optax.sgd(lr, momentum=momentum or None, nesterov=momentum > 0)


def init_drift(params: Any, n_dp: int) -> Any:
    """Zero drift [R, ...]: replica r's parameters are outer.params + drift_R[r]. Keeping the
    drift rather than the replica's parameters makes the outer gradient exactly the mean of
    the inner updates (no cancellation in params_r - anchor)."""
    return jax.tree.map(lambda p: jnp.zeros((n_dp, *p.shape), p.dtype), params)


def local_step(
    grad_fn: Callable,
    tx: optax.GradientTransformation,
    outer_params: Any,
    drift_R: Any,
    inner_state_R: Any,
    batch_R: Any,
    dp_axes: tuple[str, ...],
) -> tuple[Any, Any, Any]:
    """One inner optimizer step on every replica, no data-parallel communication.

    grad_fn(params, batch) -> (aux, grads) for one replica (aux: the loss, or a dict of metrics);
    batch_R: [R, ...] per leaf; inner_state_R: the inner optimizer's state with a leading [R] dim
    (`replicate(tx.init(params), R)`). -> (aux_R, new drift_R, new inner_state_R)."""

    def one(drift, inner, batch):
        params = jax.tree.map(jnp.add, outer_params, drift)
        aux, grads = grad_fn(params, batch)
        updates, inner = tx.update(grads, inner, params)
        return aux, optax.apply_updates(drift, updates), inner

    return jax.vmap(one, spmd_axis_name=tuple(dp_axes) or None)(drift_R, inner_state_R, batch_R)


def replicate(tree: Any, n_dp: int) -> Any:
    """[...] -> [R, ...] copies (e.g. the inner optimizer state every replica starts with)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n_dp, *jnp.shape(x))), tree)


def outer_step(
    outer: OuterState, drift_R: Any, outer_tx: optax.GradientTransformation
) -> tuple[OuterState, Any]:
    """End of a round (every H local steps): the outer gradient is minus the replicas' mean drift
    (the one data-parallel all-reduce of the round); the outer optimizer applies it to the
    global parameters, and every replica restarts from them (drift zero)."""
    outer_grad = jax.tree.map(lambda d: -d.mean(0), drift_R)
    updates, opt_state = outer_tx.update(outer_grad, outer.opt_state, outer.params)
    params = optax.apply_updates(outer.params, updates)
    return OuterState(params=params, opt_state=opt_state), jax.tree.map(jnp.zeros_like, drift_R)
