"""The pure train step: (state, batch) -> (state, metrics), its gradient accumulation over
micro-batches and replicas, the sync, the guarded update and DiLoCo's local step; the loss it
differentiates is train/core/batch_loss.py's. No I/O here."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from mesh.rules import axis_rules, current_rules
from models.config import ModelConfig
from models.moe_router import bias_update
from train.core import comm
from train.core.batch_loss import loss_terms, split_micro
from train.core.optim import applied_lr
from train.core.state import TrainState


def replica_split(dp_axes: tuple[str, ...]) -> tuple[int, dict]:
    """(R, the rules inside one replica) on the mesh and rules in context: R = the product of the
    data-parallel axes' sizes; inside a replica the batch (and the LM head's) is sharded over the
    other batch axes only."""
    n_dp = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in dp_axes)
    rules = current_rules()
    return n_dp, {
        **rules,
        **{
            name: tuple(a for a in rules[name] if a not in dp_axes)
            for name in ("batch", "logits_batch")
        },
    }


def grads_loss_stats(
    cfg: ModelConfig,
    params,
    batch,
    micro_batches: int,
    dp_axes: tuple[str, ...] = (),
    per_replica: bool = False,
    pipeline=None,
    loss_fn=None,
    param_fn=None,
    terms_fn=None,
):
    """Mean loss (cross-entropy, or `loss_fn`'s: see `token_losses`) over all tokens, the gradient
    of the objective (cross-entropy + MoE balance losses) and the MoE sums, accumulated over
    micro-batches in float32.

    `dp_axes`: the leading batch mesh axes that shard no parameter (plain data parallelism). With
    micro-batches, each such replica group keeps its own partial gradient sum ([n_dp, ...], sharded
    over dp_axes) and they are reduced once at the end, so the data-parallel all-reduce runs once
    per step rather than once per micro-batch (DDP's no_sync). Axes that do shard parameters
    (fsdp) reduce-scatter every micro-batch, as ZeRO-3 does, to keep gradients sharded.
    `per_replica`: leave that reduction to the caller (train.core.comm.sync_grads): the gradient
    keeps its [n_dp, ...] dim, each replica's share of the mean (their sum is the mean gradient).
    `param_fn`: the model's params as a function of `params`, which are then what is differentiated
    (LoRA: the adapters, merged into the frozen base inside the traced loss: train/core/lora.py).
    `terms_fn(model params, micro-batch)`: the objective in loss_terms' form replacing it (the
    preference objectives' pair losses, train/core/pair_loss.py: the count is of pairs).
    """
    # One function on purpose (~60 lines, most of them this docstring): the objective, its
    # gradient and the micro-batch scan are closures over the same model, batch layout and rules.

    def objective(p, mb):
        q = p if param_fn is None else param_fn(p)
        return loss_terms(cfg, q, mb, pipeline, loss_fn) if terms_fn is None else terms_fn(q, mb)

    def sums_and_grads(p, mb):
        (_, (xent, n, sums)), g = jax.value_and_grad(objective, has_aux=True)(p, mb)
        return xent, n, sums, g

    if micro_batches == 1 and not (per_replica and dp_axes):
        total, n, sums, g = sums_and_grads(params, batch)
        n = jnp.maximum(n, 1.0)
        return total / n, _mean_grads(g, n, total), _normalise(sums, n)

    micro = jax.tree.map(lambda x: split_micro(x, micro_batches), batch)  # [M, B/M, ...]
    n_dp, inner_rules = replica_split(dp_axes)
    if n_dp > 1:  # [M, B/M, ...] -> [M, n_dp, B/(M n_dp), ...]: dim 1 is the replica group
        micro = jax.tree.map(
            lambda x: x.reshape(x.shape[0], n_dp, x.shape[1] // n_dp, *x.shape[2:]), micro
        )
        grad_fn = jax.vmap(sums_and_grads, in_axes=(None, 0), spmd_axis_name=dp_axes)
    else:
        grad_fn = sums_and_grads

    def body(carry, mb):
        with axis_rules(inner_rules):
            out = grad_fn(params, mb)
        return jax.tree.map(jnp.add, carry, out), None

    with axis_rules(inner_rules):
        shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
    (total, n, sums, g), _ = jax.lax.scan(body, zeros, micro)
    # the one data-parallel reduction of the step (of the gradient: unless per_replica)
    if n_dp > 1:
        total, n, sums = jax.tree.map(lambda x: x.sum(0), (total, n, sums))
        g = g if per_replica else jax.tree.map(lambda x: x.sum(0), g)
    n = jnp.maximum(n, 1.0)
    return total / n, _mean_grads(g, n, total), _normalise(sums, n)


def _mean_grads(g, n, total):
    """The gradient sums over `n` tokens as a mean, NaN throughout when the loss `total` is not
    finite. A non-finite loss is divergence whatever its gradient says: a custom loss's NaN can
    leave the gradient finite (a constant, a stop_gradient, a masked branch), and the step's guard
    (optax.apply_if_finite) reads the gradient only, so such a step used to be applied and the run
    went on to `loss nan` with exit status 0. Made NaN here, it is skipped, counted and recovered
    from (--train.max_bad_steps) as every non-finite step is."""
    finite = jnp.isfinite(total)
    return jax.tree.map(lambda x: jnp.where(finite, x / n, jnp.nan), g)


def _normalise(sums: dict, n) -> dict:
    """The sums that are means over the tokens (pairs) as means: the MoE balance losses, the
    preference objectives' `post/` figures."""
    return {k: v / n if k in ("aux", "z") or k.startswith("post/") else v for k, v in sums.items()}


def moe_metrics(stats: dict) -> dict:
    """Float32 scalars for the log: the worst layer's busiest and idlest expert against the mean
    load, the share of assignments dropped (capacity dispatch), the balance losses (unweighted)."""
    ratio_LE = stats["counts"] / jnp.maximum(jnp.mean(stats["counts"], -1, keepdims=True), 1e-9)
    return {
        "moe/load_max_over_mean": jnp.max(ratio_LE),
        "moe/load_min_over_mean": jnp.min(ratio_LE),
        "moe/dropped_fraction": jnp.sum(stats["dropped"])
        / jnp.maximum(jnp.sum(stats["assigned"]), 1.0),
        "moe/aux_loss": stats["aux"],
        "moe/z_loss": stats["z"],
    }


def train_step(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    lr_schedule,
    micro_batches: int,
    dp_axes: tuple[str, ...],
    state: TrainState,
    batch,
    comm_cfg=None,
    param_specs=None,
    pipeline=None,
    local_clip: float = 0.0,
    loss_fn=None,
    param_fn=None,
    terms_fn=None,
) -> tuple[TrainState, dict]:
    """`comm_cfg` (train.core.config.CommConfig) with a compression other than none, and dp axes:
    the data-parallel gradient sync is train.core.comm.sync_grads (`param_specs`: the params'
    PartitionSpecs) instead of XLA's all-reduce; `local_clip` > 0 then clips each replica's
    gradient to that global norm before the sync (`tx` has no clipping of its own: it would clip
    the error-feedback bursts). `pipeline`: the run's PipelineConfig. `loss_fn`: a custom per-token
    loss (`token_losses`). `param_fn`: the model's params from `state.params` (LoRA's merge:
    `grads_loss_stats`). `terms_fn`: the objective replacing the token loss (`grads_loss_stats`)."""
    # One function on purpose (~60 lines, a third of them its signature and docstring): it reads
    # top to bottom as the update it applies: gradients, sync, update, spike guard, router bias.
    compress = bool(dp_axes) and comm_cfg is not None and comm_cfg.compression != "none"
    loss, grads, stats = grads_loss_stats(
        cfg,
        state.params,
        batch,
        micro_batches,
        dp_axes,
        per_replica=compress,
        pipeline=pipeline,
        loss_fn=loss_fn,
        param_fn=param_fn,
        terms_fn=terms_fn,
    )
    if compress:
        grads, residual, grad_norm = _synced(
            grads, state.residual, comm_cfg, dp_axes, param_specs, local_clip
        )
    else:
        residual, grad_norm = state.residual, optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    ok = opt_state.notfinite_count == 0  # optax.apply_if_finite skipped nothing
    params = optax.apply_updates(state.params, updates)
    window, spiked = state.spike, jnp.zeros((), bool)
    if window is not None:  # --train.spike_factor: a finite update whose loss is a spike is undone
        spiked = ok & window.is_spike(loss)
        undo = lambda new, old: jnp.where(spiked, old, new)  # noqa: E731
        params, opt_state = (
            jax.tree.map(undo, params, state.params),
            jax.tree.map(undo, opt_state, state.opt_state),
        )
        window, ok = window.after(loss, applied=ok & ~spiked, spiked=spiked), ok & ~spiked
    if cfg.n_experts and cfg.router_bias_rate > 0:
        params = _router_bias_followed(params, stats["counts"], cfg.router_bias_rate, ok)
    lr = jnp.where(spiked, 0.0, applied_lr(lr_schedule, state.opt_state, opt_state))
    metrics = _step_metrics(loss, grad_norm, lr, opt_state, window, stats)
    # a skipped step (non-finite, or a spike) must leave the residuals as they were
    if residual is not None:
        residual = jax.tree.map(lambda new, old: jnp.where(ok, new, old), residual, state.residual)
    return TrainState(
        step=state.step + 1, params=params, opt_state=opt_state, residual=residual, spike=window
    ), metrics


def _step_metrics(loss, grad_norm, lr, opt_state, window, stats: dict) -> dict:
    """The step's scalars for the log. `lr`: the rate this update applied, by the optimizer's own
    count (it stops on skipped steps and rewinds with a restored checkpoint), not the step number;
    0 for a skipped step."""
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        # optax.apply_if_finite: updates skipped in a row / in total (non-finite gradients)
        "bad_in_a_row": opt_state.notfinite_count,
        "skipped_steps": opt_state.total_notfinite,
    }
    # neither count resets on the other kind's skip: their sum is the run of skips
    if window is not None:
        metrics.update(
            spike_in_a_row=window.in_a_row,
            spike_skipped_steps=window.skipped,
            loss_running_median=window.median(),
        )
    if "counts" in stats:
        metrics.update(moe_metrics(stats))
    metrics.update({k: v for k, v in stats.items() if k.startswith("post/")})
    return metrics


def _synced(grads_R, residual_R, comm_cfg, dp_axes, param_specs, local_clip: float):
    """The per-replica gradients [R, ...] clipped (`local_clip` > 0) and summed by the compressed
    sync -> (the gradient, the new residuals, the mean of the replicas' own gradient norms)."""
    norms_R = comm.replica_norms(grads_R)
    grad_norm = jnp.mean(norms_R)  # each replica's own, before compression
    if local_clip > 0:
        grads_R = comm.clip_replicas(grads_R, local_clip, norms_R)
    grads, residual = comm.sync_grads(
        grads_R,
        residual_R,
        compression=comm_cfg.compression,
        dp_axes=dp_axes,
        param_specs=param_specs,
        topk_fraction=comm_cfg.topk_fraction,
    )
    return grads, residual, grad_norm


def _router_bias_followed(params, counts_LE, rate: float, ok) -> dict:
    """Aux-loss-free balancing: the router bias follows the loads, not the gradient (it has none);
    it lives in params so that checkpoints and generation carry it. A skipped step (`ok` false)
    changes nothing."""
    moe = params["moe_blocks"]["moe"]
    new_bias = bias_update(moe["router_bias_E"], counts_LE, rate)
    bias = jnp.where(ok, new_bias, moe["router_bias_E"])
    return {**params, "moe_blocks": {**params["moe_blocks"], "moe": {**moe, "router_bias_E": bias}}}


def local_sgd_step(
    cfg: ModelConfig,
    tx: optax.GradientTransformation,
    outer_tx: optax.GradientTransformation,
    lr_schedule,
    micro_batches: int,
    dp_axes: tuple[str, ...],
    sync_every: int,
    state: TrainState,
    batch,
    pipeline=None,
    loss_fn=None,
) -> tuple[TrainState, dict]:
    """--comm.sync_every H > 1 (local SGD / DiLoCo): every data-parallel replica takes an inner
    optimizer step on its own rows of the batch with no data-parallel traffic; every H-th step the
    outer optimizer applies the replicas' mean drift to the global params (one all-reduce)."""
    n_dp, inner_rules = replica_split(dp_axes)
    # rows are sharded over the batch axes, dp axes outermost: block r of B/R rows is replica r's
    batch_R = jax.tree.map(lambda x: x.reshape(n_dp, x.shape[0] // n_dp, *x.shape[1:]), batch)

    def grad_fn(params, b):
        with axis_rules(inner_rules):
            loss, grads, _ = grads_loss_stats(
                cfg, params, b, micro_batches, pipeline=pipeline, loss_fn=loss_fn
            )
        return (loss, optax.tree.norm(grads)), grads

    (loss_R, gnorm_R), drift, opt_state = comm.local_step(
        grad_fn, tx, state.params, state.drift, state.opt_state, batch_R, dp_axes
    )
    outer = comm.OuterState(params=state.params, opt_state=state.outer_opt)
    outer, drift = jax.lax.cond(
        (state.step + 1) % sync_every == 0,
        lambda o, d: comm.outer_step(o, d, outer_tx),
        lambda o, d: (o, d),
        outer,
        drift,
    )
    metrics = {
        "loss": loss_R.mean(),
        "grad_norm": gnorm_R.mean(),
        "lr": applied_lr(lr_schedule, state.opt_state, opt_state),  # mean over replicas
        "bad_in_a_row": opt_state.notfinite_count.max(),
        "skipped_steps": opt_state.total_notfinite.max(),
    }
    return state.replace(
        step=state.step + 1,
        params=outer.params,
        opt_state=opt_state,
        drift=drift,
        outer_opt=outer.opt_state,
    ), metrics
