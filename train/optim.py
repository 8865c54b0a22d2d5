"""AdamW with warm-up + cosine decay, global-norm clipping and a weight-decay mask."""
from __future__ import annotations

import jax
import optax

from train.config import TrainConfig


def schedule(cfg: TrainConfig) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params: dict, decay_embeddings: bool) -> dict:
    """Decay matrices only: never norm scales or the MoE router bias (set by the train step, not by
    gradients); embeddings only when asked (GPT-3/Llama practice)."""
    def keep(path, _):
        names = [getattr(k, "key", "") for k in path]
        if any("norm" in str(n) or str(n).startswith("router_bias") for n in names):
            return False
        if any(str(n).startswith("embed_") for n in names):
            return decay_embeddings
        return True
    return jax.tree_util.tree_map_with_path(keep, params)


def make(cfg: TrainConfig, clip: bool = True) -> optax.GradientTransformation:
    """`clip` False: no clipping here; the train step clips each replica's gradient before a
    compressed sync instead (clipping the synced sum would cut error feedback's bursts)."""
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 and clip else []
    parts.append(optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mask=lambda p: decay_mask(p, cfg.decay_embeddings)))
    # Non-finite gradients (an overflow, a bad batch) skip the update instead of poisoning the
    # weights; the counts live in the optimizer state (so in checkpoints) and reach the metrics.
    # The loop, not optax, decides when too many in a row mean "restore the last checkpoint".
    return optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=2**30)
