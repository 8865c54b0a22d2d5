"""The train state (step, params, optimizer state), created already sharded on the mesh."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.rules import axis_rules
from mesh.shard import tree_shardings
from models import model
from models.config import ModelConfig
from train.core import comm, lora, optim
from train.core.comm import NO_SYNC, SyncLayout
from train.core.memory import HOST_KIND


@flax.struct.dataclass
class TrainState:
    # int32 scalar: train steps taken so far, skipped (non-finite) ones too; the learning-rate
    # schedule runs on the optimizer's own count, in opt_state
    step: jax.Array
    # nested dict of arrays, sharded by the logical-axis rules (DiLoCo: the global params; LoRA:
    # the adapters only, the frozen base is the step's own argument: train/core/lora.py)
    params: Any
    # optax state; moments sharded exactly like params (DiLoCo: one per replica, [R, ...]), float32
    # whatever the param dtype (train/core/optim.py in_float32)
    opt_state: Any
    # The data-parallel sync's own state (train/core/comm.py), [R, ...] per param and sharded over
    # the dp axes so each device holds its own replica's; None when not in use:
    # error feedback: what the compressed gradient sync has not sent yet (float32)
    residual: Any = None
    drift: Any = None  # DiLoCo: each replica's params minus the global params since the last sync
    outer_opt: Any = None  # DiLoCo: the outer optimizer's state (Nesterov momentum), like params
    spike: Any = None  # --train.spike_factor > 0: the LossWindow the step compares each loss with


# The loss-spike guard's window: the last LOSS_WINDOW losses of applied updates; no step is
# judged until it holds SPIKE_WARMUP of them (the first steps' losses fall too fast to compare).
LOSS_WINDOW, SPIKE_WARMUP = 32, 8


@flax.struct.dataclass
class LossWindow:
    """--train.spike_factor: a ring of recent losses, kept in the state so that a checkpoint
    carries it and a resumed run judges its next step exactly as the uninterrupted run would."""

    losses: jax.Array  # [LOSS_WINDOW] float32, the ring; slot `seen % LOSS_WINDOW` is the next
    seen: jax.Array  # int32: losses pushed so far (applied updates)
    in_a_row: jax.Array  # int32: updates skipped as spikes since the last applied one
    skipped: jax.Array  # int32: updates skipped as spikes in total
    factor: float = flax.struct.field(pytree_node=False, default=0.0)  # the config's, never saved

    def median(self) -> jax.Array:
        """Median of the losses pushed so far (the last LOSS_WINDOW); +inf while empty."""
        k = jnp.minimum(self.seen, LOSS_WINDOW)
        held = jnp.sort(jnp.where(jnp.arange(LOSS_WINDOW) < k, self.losses, jnp.inf))
        lo, hi = held[jnp.maximum(k - 1, 0) // 2], held[k // 2]
        return jnp.where(k > 0, 0.5 * (lo + hi), jnp.inf)

    def is_spike(self, loss: jax.Array) -> jax.Array:
        """Whether `loss` exceeds factor x the running median, once the window is warm."""
        return (self.seen >= SPIKE_WARMUP) & (loss > self.factor * self.median())

    def after(self, loss: jax.Array, applied: jax.Array, spiked: jax.Array) -> LossWindow:
        """The window after a step: an applied update's loss pushed; a spike counted; a
        non-finite step (neither) changes nothing."""
        slot = self.seen % LOSS_WINDOW
        return self.replace(
            losses=jnp.where(
                applied, self.losses.at[slot].set(loss.astype(jnp.float32)), self.losses
            ),
            seen=self.seen + applied,
            in_a_row=jnp.where(applied, 0, self.in_a_row + spiked),
            skipped=self.skipped + spiked,
        )


def with_loss_window(state: TrainState, factor: float, mesh: Mesh) -> TrainState:
    """`state` with an empty LossWindow replicated on `mesh`, of the state's own kind (shardings,
    abstract arrays or arrays, told by its `step`); unchanged when `factor` is 0 (the guard is
    off) or the state has a window (restored from a checkpoint)."""
    if not factor or state.spike is not None:
        return state
    sh = NamedSharding(mesh, P())
    if isinstance(state.step, NamedSharding):
        leaf = lambda shape, dtype: sh  # noqa: E731
    elif isinstance(state.step, jax.ShapeDtypeStruct):
        leaf = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    else:
        leaf = lambda shape, dtype: jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sh)()  # noqa: E731
    return state.replace(
        spike=LossWindow(
            losses=leaf((LOSS_WINDOW,), jnp.float32),
            seen=leaf((), jnp.int32),
            in_a_row=leaf((), jnp.int32),
            skipped=leaf((), jnp.int32),
            factor=factor,
        )
    )


# Optimizer state that matches no parameter is replicated when it has at most this many elements
# (a per-tensor scale, a small table); a larger one would cost every device its full size.
SMALL_STATE = 1 << 16


def like_params(tx: optax.GradientTransformation, abstract_params, param_sh, mesh: Mesh, warn=None):
    """The shardings of `tx`'s state for these params, for any optax transformation. A leaf whose
    key path ends with a parameter's path (optax keeps moments in the params' tree) and has its
    shape is sharded like it; one with that shape less one dim (a factored second moment:
    Adafactor's row and column statistics) like it without that dim; else one of another
    parameter's shape like that parameter (same shape, same divisibility); scalars and leaves of
    at most SMALL_STATE elements are replicated (`warn(line)` told of those that are not scalars);
    anything larger is a one-line UserError."""
    params = {
        tuple(path): (tuple(p.shape), sh)
        for (path, p), sh in zip(
            jax.tree_util.tree_flatten_with_path(abstract_params)[0], jax.tree.leaves(param_sh)
        )
    }
    by_shape = {}
    for shape, sh in params.values():
        by_shape.setdefault(shape, sh)
    replicated, small = NamedSharding(mesh, P()), []

    def pick(path, leaf):
        shape = tuple(leaf.shape)
        own = next(
            (params[tuple(path[k:])] for k in range(len(path)) if tuple(path[k:]) in params), None
        )
        if own is not None:
            (p_shape, sh), spec = own, (*own[1].spec, *[None] * (len(own[0]) - len(own[1].spec)))
            if shape == p_shape:
                return sh
            # the last dim first: a row statistic drops it
            for dim in reversed(range(len(p_shape))):
                if shape == p_shape[:dim] + p_shape[dim + 1 :]:
                    return NamedSharding(mesh, P(*spec[:dim], *spec[dim + 1 :]))
        if shape in by_shape:
            return by_shape[shape]
        if leaf.size > SMALL_STATE:
            raise UserError(
                f"optimizer state {jax.tree_util.keystr(path)} {shape} matches no parameter's"
                " shape, so it cannot be sharded like the parameters; Brigade replicates only"
                f" optimizer state of at most {SMALL_STATE} elements; keep per-parameter state in"
                " the params' tree"
            )
        if leaf.size > 1:
            small.append(f"{jax.tree_util.keystr(path)} {shape}")
        return replicated

    out = jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, abstract_params))
    if small and warn:
        warn(
            f"warning: {len(small)} optimizer state array(s) match no parameter's shape and are"
            f" replicated on every device (each at most {SMALL_STATE} elements):"
            f" {', '.join(small[:3])}{', ...' * (len(small) > 3)}"
        )
    return out


def trainable(cfg: ModelConfig, lora_cfg=None) -> tuple[dict, dict]:
    """(logical axes, ShapeDtypeStructs) of what trains: the model's params, or with `lora_cfg` (a
    LoraConfig with rank > 0) the adapters."""
    if lora.enabled(lora_cfg):
        return lora.adapter_axes(cfg, lora_cfg), lora.abstract_adapters(cfg, lora_cfg)
    return model.param_axes(cfg), model.abstract_params(cfg)


def shardings(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules,
    sync: SyncLayout = NO_SYNC,
    warn=None,
    lora_cfg=None,
) -> TrainState:
    """A TrainState of NamedShardings: params from the rules, optimizer state like its params
    (`like_params`; `warn`: told of replicated non-scalar state), scalars (counts, step)
    replicated; per-replica state over the dp axes. `lora_cfg`: the params are its adapters."""
    axes, abstract_params = trainable(cfg, lora_cfg)
    param_sh = tree_shardings(mesh, axes, rules)

    def per_replica(tree):
        return jax.tree.map(
            lambda sh: NamedSharding(mesh, comm.replica_spec(sh.spec, sync.dp_axes)), tree
        )

    opt_sh = like_params(tx, abstract_params, param_sh, mesh, warn)
    # --train.offload_optimizer: the state lives in host memory
    if isinstance(tx, optim.HostResident):
        opt_sh = jax.tree.map(lambda sh: sh.with_memory_kind(HOST_KIND), opt_sh)
    out = TrainState(step=NamedSharding(mesh, P()), params=param_sh, opt_state=opt_sh)
    if sync.error_feedback:
        out = out.replace(residual=per_replica(param_sh))
    if sync.outer_tx is not None:
        out = out.replace(
            opt_state=per_replica(opt_sh),
            drift=per_replica(param_sh),
            outer_opt=like_params(sync.outer_tx, abstract_params, param_sh, mesh),
        )
    return out


def abstract(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules,
    sync: SyncLayout = NO_SYNC,
    lora_cfg=None,
) -> TrainState:
    """ShapeDtypeStructs with shardings: what `plan` compiles against, without allocating."""
    sh = shardings(cfg, tx, mesh, rules, sync, lora_cfg=lora_cfg)
    shapes = jax.eval_shape(
        lambda: _fresh(cfg, tx, jax.random.key(0), sync, sync.replicas(mesh), lora_cfg)
    )
    return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, sh)


def _fresh(
    cfg: ModelConfig, tx, key, sync: SyncLayout = NO_SYNC, n_dp: int = 1, lora_cfg=None
) -> TrainState:
    params = (
        lora.init_adapters(cfg, lora_cfg, key) if lora.enabled(lora_cfg) else model.init(cfg, key)
    )
    return _around(params, tx, sync, n_dp)


def _around(params, tx, sync: SyncLayout, n_dp: int) -> TrainState:
    """Step 0 and fresh optimizer (and data-parallel sync) state around `params`."""
    out = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    if sync.error_feedback:
        out = out.replace(residual=comm.init_residual(params, n_dp))
    if sync.outer_tx is not None:
        out = out.replace(
            opt_state=comm.replicate(out.opt_state, n_dp),
            drift=comm.init_drift(params, n_dp),
            outer_opt=sync.outer_tx.init(params),
        )
    return out


def create(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules,
    seed: int,
    sync: SyncLayout = NO_SYNC,
    lora_cfg=None,
) -> TrainState:
    """Initialise under jit with output shardings: every device only ever holds its own shards.
    `lora_cfg`: fresh adapters (the base is loaded apart: train/core/lora.py)."""
    sh = shardings(cfg, tx, mesh, rules, sync, lora_cfg=lora_cfg)
    with jax.set_mesh(mesh), axis_rules(rules):
        return jax.jit(
            lambda k: _fresh(cfg, tx, k, sync, sync.replicas(mesh), lora_cfg), out_shardings=sh
        )(jax.random.key(seed))


def from_params(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules,
    params,
    sync: SyncLayout = NO_SYNC,
) -> TrainState:
    """A fresh state around `params` (already sharded; donated): where fine-tuning starts. No
    random init is materialised, so the peak is one copy of the parameters plus the optimizer."""
    sh = shardings(cfg, tx, mesh, rules, sync)
    with jax.set_mesh(mesh), axis_rules(rules):
        return jax.jit(
            lambda p: _around(p, tx, sync, sync.replicas(mesh)),
            out_shardings=sh,
            donate_argnums=(0,),
        )(params)
