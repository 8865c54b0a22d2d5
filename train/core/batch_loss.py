"""The loss of a batch: per-token losses (cross-entropy, chunked where the logits would be large,
or Trainer(loss=)'s), summed over the batch's weighted tokens with the MoE balance terms: what
the train step differentiates and the eval step sums. No I/O here."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from errors import UserError
from mesh.rules import logical_to_spec
from mesh.shard import axes_size
from models import context, model, registry
from models.config import LOSS_CHUNK, LOSS_CHUNK_FROM, ModelConfig
from models.loss import token_xent
from models.transformer import default_positions


def split_micro(x_BT: jax.Array, m: int) -> jax.Array:
    """[B,...] -> [M, B/M, ...] taking rows m, m+M, m+2M... into micro-batch m, so every micro-batch
    spans all batch shards (a plain reshape would put whole micro-batches on single shards)."""
    b = x_BT.shape[0]
    x = x_BT.reshape(b // m, m, *x_BT.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def token_losses(loss_fn, logits_BTV: jax.Array, batch) -> jax.Array:
    """The per-token loss [B,T] float32: cross-entropy, or `loss_fn(logits_BTV, batch)`, a custom
    loss (Trainer(loss=...)). Per token, not a mean: the step weights and sums it, and divides by
    the weight of the whole batch only once every micro-batch and data-parallel replica is summed,
    so gradient accumulation and data parallelism give exactly one big batch's mean (a mean per
    micro-batch would weigh a micro-batch of padding like a full one). Checked while tracing."""
    if loss_fn is None:
        return token_xent(logits_BTV, batch["targets"])
    loss_BT = loss_fn(logits_BTV, batch)
    want = tuple(batch["targets"].shape)
    if tuple(getattr(loss_BT, "shape", ())) != want or not jnp.issubdtype(
        getattr(loss_BT, "dtype", int), jnp.floating
    ):
        dtype = getattr(loss_BT, "dtype", type(loss_BT).__name__)
        got = f"{tuple(getattr(loss_BT, 'shape', ()))} {dtype}"
        raise UserError(
            f"loss=: returned {got}; expected per-token losses, a float array of the targets'"
            f" shape [B,T] = {want} (Brigade weights, sums and normalises them; return loss_BT,"
            " not its mean)"
        )
    return loss_BT.astype(jnp.float32)


def loss_terms(cfg: ModelConfig, params, batch, pipeline=None, loss_fn=None):
    """-> (objective sum, (loss sum, token count, MoE sums)), in float32; the loss is per-token
    cross-entropy, or `loss_fn`'s (see `token_losses`).

    The objective adds the MoE balance losses (means over MoE layers) weighted by the token count,
    so that dividing by the total count gives mean cross-entropy + coefficient x loss, also across
    micro-batches. MoE sums are additive over micro-batches: {} for a dense model. `pipeline`
    (models.config.PipelineConfig): the schedule on a mesh with pipeline > 1, any of them
    (models.model.objective)."""
    # context parallelism: the batch in the zigzag order its sequence shards hold
    # (models/context.py)
    n_context = context.context_size()
    registry.check_sequence_order(cfg, n_context)
    batch = context.to_layout(batch, n_context, default_positions)
    if batch.get("positions") is None and registry.given_positions(cfg):
        # a registered model that masks by positions gets them on every mesh, not only on a context
        # axis (where to_layout made them explicit): one device and context=2 run the same program
        positions_BT = default_positions(batch.get("segment_ids"), batch["inputs"].shape)
        batch = {**batch, "positions": positions_BT}
    n = jnp.sum(batch["weights"]) if "weights" in batch else jnp.float32(batch["targets"].size)
    weights = {"aux": n * cfg.aux_loss_coef, "z": n * cfg.z_loss_coef} if cfg.n_experts else {}
    custom = (
        None if loss_fn is None else (lambda logits_BTV, mb: token_losses(loss_fn, logits_BTV, mb))
    )
    objective, xent, stats = model.objective(
        cfg,
        params,
        batch,
        pipeline=pipeline,
        token_loss=custom,
        stat_weights=weights,
        # a custom loss reads whole logits
        loss_chunk=loss_chunk(cfg, batch["inputs"].shape) if loss_fn is None else 0,
    )
    return objective, (xent, n, moe_sums(stats, n))


def moe_sums(stats: dict, n) -> dict:
    """The MoE layers' stats (per layer) as sums over the tokens: the balance losses' means over
    layers x the token count (additive over micro-batches), the token counts as they are."""
    if not stats:
        return {}
    return {
        "aux": jnp.mean(stats["aux"]) * n,
        "z": jnp.mean(stats["z"]) * n,
        "counts": stats["counts"],
        "dropped": stats["dropped"],
        "assigned": stats["assigned"],
    }


def loss_chunk(cfg: ModelConfig, shape_BT: tuple[int, int]) -> int:
    """Tokens per chunk of the LM head + cross-entropy (models.loss.chunked_token_xent), 0 = whole:
    --model.loss_chunk, or under auto (0) LOSS_CHUNK where one device's float32 logits of this
    batch would exceed LOSS_CHUNK_FROM bytes (the rules in context say how they are split)."""
    if cfg.loss_chunk:
        return cfg.loss_chunk
    mesh = jax.sharding.get_abstract_mesh()
    shards = (
        1
        if mesh.empty
        else math.prod(
            axes_size(mesh, e) for e in logical_to_spec(("logits_batch", "seq", "act_vocab"))
        )
    )
    logit_bytes = shape_BT[0] * shape_BT[1] * cfg.vocab_size * 4 / shards
    return LOSS_CHUNK if logit_bytes > LOSS_CHUNK_FROM else 0


def loss_sums(
    cfg: ModelConfig, params, batch, pipeline=None, loss_fn=None
) -> tuple[jax.Array, jax.Array]:
    """-> (sum of token losses, number of tokens), in float32. Summing (not averaging)
    per micro-batch makes gradient accumulation exactly equal to one big batch."""
    _, (xent, n, _) = loss_terms(cfg, params, batch, pipeline, loss_fn)
    return xent, n


def eval_step(
    cfg: ModelConfig, params, batch, pipeline=None, loss_fn=None
) -> tuple[jax.Array, jax.Array]:
    """-> (sum of token losses, token count) for one held-out batch."""
    return loss_sums(cfg, params, batch, pipeline, loss_fn)
