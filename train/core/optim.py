"""The optimizer: optax's AdamW, Adafactor, Lion, SGD or Muon (--optim.name) with warm-up + cosine
decay, global-norm clipping, decoupled weight decay under a mask and a non-finite skip; or any optax
transformation in its place (Trainer(optimizer=...)), inside the same guards."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import optax

from errors import UserError
from train.core.config import OPTIMIZERS, TrainConfig


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Learning rate as a function of the optimizer's update count (0 for the first update).

    Warm-up rises linearly from lr / warmup_steps (not from 0: a first update at rate 0 would be a
    step that changes nothing) to lr at count warmup_steps, then a cosine decays to lr *
    min_lr_ratio."""
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr / max(warmup, 1),
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def decay_mask(params: dict, decay_embeddings: bool) -> dict:
    """Decay matrices only: never norm scales, the q/k/v biases or the MoE router bias (set by the
    train step, not by gradients); embeddings only when asked (GPT-3/Llama practice)."""

    def keep(path, _):
        names = [getattr(k, "key", "") for k in path]
        if any(
            "norm" in str(n) or str(n).startswith(("router_bias", "bq_", "bk_", "bv_"))
            for n in names
        ):
            return False
        if any(str(n).startswith("embed_") for n in names):
            return decay_embeddings
        return True

    return jax.tree_util.tree_map_with_path(keep, params)


def _widen(tree):
    """Leaves narrower than float32 (the 16-bit float params and grads) -> float32; wider ones and
    optax's placeholders pass through."""
    return jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)), tree)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run `inner` in float32 whatever the parameter dtype.

    Adam kept in a 16-bit parameter dtype loses what it needs: float16 flushes eps (1e-8) and
    squared gradients below ~6e-8 to 0, and bfloat16's 8-bit mantissa (relative step 2^-8)
    cannot follow a slow average (b2 = 0.999 moves nu by 0.1% a step: rounded away). So gradients
    and parameters enter the optimizer as float32 and both moments live in float32 (optimizer
    memory as with float32 parameters; only the weights and activations shrink). The update is
    returned in float32: optax.apply_updates adds it to the weight in float32 and rounds once to
    the weight's dtype (rounding the update first would round twice). A float32 state also keeps
    optax.apply_if_finite's skip and apply branches the same type. For float32 parameters this is
    the identity. Updates under half a weight's ulp (2^-9 of it in bfloat16) still round away:
    the price of 16-bit weights (float32 parameters, the default, keep every update)."""

    def init(params):
        return inner.init(_widen(params))

    def update(updates, state, params=None):
        return inner.update(_widen(updates), state, None if params is None else _widen(params))

    return optax.GradientTransformation(init, update)


def as_schedule(lr) -> optax.Schedule:
    """Trainer(schedule=...): a function of the update count, or a number (a constant rate)."""
    if callable(lr):
        return lr
    if isinstance(lr, numbers.Real) and not isinstance(lr, bool):  # numpy scalars too
        return optax.constant_schedule(float(lr))
    raise UserError(
        f"schedule=: expected a number or a function of the update count (an optax schedule),"
        f" got {type(lr).__name__}"
    )


def check_optimizer(optimizer, lr) -> None:
    """Trainer(optimizer=..., schedule=...): an optax transformation, and the rate it applies
    (what the log reports: optax keeps a rate inside the transformation, out of Brigade's sight)."""
    if not isinstance(optimizer, optax.GradientTransformation):
        raise UserError(
            f"optimizer=: expected an optax.GradientTransformation (e.g. optax.lion(1e-4)), got"
            f" {type(optimizer).__name__}"
        )
    if lr is None:
        raise UserError(
            "optimizer=: also pass schedule= (a number, or the function of the update count the"
            " optimizer's learning rate follows), which the logged lr reports"
        )


def muon_dims(params) -> dict:
    """Muon's view of each parameter as a matrix, read from the shape letters its name ends with:
    the hidden projections (names starting with w: attention and MLP, dense or expert) map D to the
    rest or the rest to D, with the stacked-layer dim and experts (E) as batch dims, orthogonalised
    one matrix each. Everything else (embeddings, the LM head, norms, biases, the router, and
    parameters named otherwise) gets None: optax's Muon updates those with its AdamW, as the Muon
    authors prescribe for all but the hidden matrices."""

    def dims(path, p):
        head, _, axes = str(getattr(path[-1], "key", "")).rpartition("_")
        if not (
            head.startswith("w")
            and axes.isalpha()
            and axes.isupper()
            and "D" in axes
            and len(axes) <= p.ndim
        ):
            return None
        lead = p.ndim - len(axes)  # the scanned layers' dim, not in the name
        other = tuple(lead + i for i, a in enumerate(axes) if a not in "DE")
        d = (lead + axes.index("D"),)
        return optax.contrib.MuonDimensionNumbers(
            *((d, other) if axes.lstrip("E")[0] == "D" else (other, d))
        )

    return jax.tree_util.tree_map_with_path(dims, params)


def named(cfg: TrainConfig, lr: optax.Schedule) -> optax.GradientTransformation:
    """--optim.name's optimizer, optax's implementation, following the schedule `lr`.

    Weight decay is decoupled for all (AdamW's form: each update also takes lr x weight_decay x
    param off the parameters in the decay mask), so --train.weight_decay means one thing whatever
    the optimizer: optax's AdamW and Lion do this themselves; Adafactor's rate is given the
    schedule's shape; SGD (optax's has none) and Muon (optax's decays the matrices it
    orthogonalises, and its AdamW part with no mask) decay after the update. b1 is each one's
    momentum (AdamW, Lion, Muon and its AdamW; SGD's heavy ball, none at 0); b2 the second
    moment's decay (Lion: the momentum's).
    Adafactor keeps the paper's settings (no momentum, factored second moment with its own decay
    1 - t^-0.8, update clipping, steps relative to the parameter's scale). Muon scales its
    orthogonalised updates to AdamW's RMS (consistent_rms=0.2, Liu et al. 2025), so a rate tuned
    for AdamW carries over; Lion wants one 3-10x smaller (Chen et al. 2023)."""
    mask = lambda p: decay_mask(p, cfg.decay_embeddings)  # noqa: E731

    # tx's update holds the rate already: the decay follows it with -rate x weight_decay
    def decayed(tx):
        return optax.chain(
            tx, optax.add_decayed_weights(lambda count: -cfg.weight_decay * lr(count), mask)
        )

    if cfg.optimizer == "adamw":
        return optax.adamw(
            lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
        )
    if cfg.optimizer == "lion":
        return optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    if cfg.optimizer == "adafactor":
        return optax.adafactor(
            lr, weight_decay_rate=lambda count: cfg.weight_decay * lr(count), weight_decay_mask=mask
        )
    if cfg.optimizer == "sgd":
        return decayed(optax.sgd(lr, momentum=cfg.b1 or None))
    if cfg.optimizer == "muon":
        return decayed(
            optax.contrib.muon(
                lr,
                beta=cfg.b1,
                eps=cfg.eps,
                adam_b1=cfg.b1,
                adam_b2=cfg.b2,
                muon_weight_dimension_numbers=muon_dims,
                consistent_rms=0.2,
            )
        )
    raise UserError(f"--optim.name '{cfg.optimizer}': valid: {', '.join(OPTIMIZERS)}")


def make(
    cfg: TrainConfig,
    clip: bool = True,
    lr: optax.Schedule | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
    """`clip` False: no clipping here; the train step clips each replica's gradient before a
    compressed sync instead (clipping the synced sum would cut error feedback's bursts).
    `lr`: the schedule the optimizer follows (default `schedule(cfg)`). `optimizer`: a
    transformation that replaces --optim.name's; it runs inside the same guards (float32, the
    non-finite skip, --train.grad_clip before it), followed by a no-op scale whose count is the
    rate's clock (`applied_lr`: it stops on skipped updates as the named optimizers' do)."""
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 and clip else []
    if optimizer is None:
        parts.append(named(cfg, lr or schedule(cfg)))
    elif cfg.optimizer != "adamw":  # two optimizers asked for: neither may be dropped in silence
        raise UserError(
            f"optimizer=: replaces the configured optimizer; leave --optim.name at adamw (it is"
            f" '{cfg.optimizer}'), or drop optimizer="
        )
    else:
        parts += [optimizer, optax.scale_by_schedule(lambda count: 1.0)]
    # Non-finite gradients (an overflow, a bad batch) skip the update instead of poisoning the
    # weights; the counts live in the optimizer state (so in checkpoints) and reach the metrics.
    # The loop, not optax, decides when too many in a row mean "restore the last checkpoint".
    tx = in_float32(optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30))
    return HostResident(tx.init, tx.update) if cfg.offload_optimizer else tx


class HostResident(optax.GradientTransformation):
    """A transformation whose state is kept in pinned host memory between steps
    (--train.offload_optimizer): train/core/state.py gives that state host shardings, and the jitted
    step (train/core/setup.py) brings it to the device before the update and back after it."""


def _schedule_states(opt_state) -> list[optax.ScaleByScheduleState]:
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    return [s for s in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(s)]


def applied_lr(lr_schedule: optax.Schedule, opt_state_before, opt_state_after) -> jax.Array:
    """The learning rate an update from `opt_state_before` to `opt_state_after` applied.

    The schedule runs on the optimizer's own count, not the train step: a skipped (non-finite)
    update does not advance it, and restoring a checkpoint's optimizer state rewinds it. A skipped
    update applied no rate at all, so it reports 0 (the next applied update uses the count this
    one left unchanged). With per-replica optimizer states (DiLoCo: a leading [R] dim, each
    replica skipping on its own), the mean over replicas of the rate each applied. The last count
    is Brigade's own (a user optimizer may keep schedule counts of its own before it: they advance
    together)."""
    before = _schedule_states(opt_state_before)[-1]
    applied = opt_state_after.notfinite_count == 0  # optax.apply_if_finite took the update
    return jnp.mean(jnp.where(applied, lr_schedule(before.count), 0.0))
