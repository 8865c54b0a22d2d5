"""Cross-entropy of the LM head: per token from logits, or chunked from the hidden states so that
the [B,T,V] float32 logits never exist at once (at long sequences they dominate memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.layers import head_logits
from models.softcap import softcap as cap_logits


def token_xent(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Cross-entropy per token [B,T], float32. The target's logit is read by a gather (`_pick`)
    whose gradient is a masked select (an iota compared with the target), not a gather's scatter
    into a [B,T,V] buffer: the select fuses into the softmax's gradient, so the backward makes one
    pass over the logits. With the vocabulary sharded (a vocab-parallel head) the gather is local
    plus one small all-reduce over [B,T]."""
    shift_BT1 = jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1, keepdims=True))
    shifted_BTV = logits_BTV - shift_BT1
    lse_BT = jnp.log(jnp.sum(jnp.exp(shifted_BTV), axis=-1))
    return lse_BT - _pick(shifted_BTV, targets_BT)


@jax.custom_vjp
def _pick(x_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """x[b, t, targets[b, t]] [B,T]; 0 where a target is outside [0, V), as a masked sum gives.
    The masked sum `sum(where(iota == target, x, 0))` is a pass over [B,T,V] that XLA:CPU
    materialises before reducing it; the gather reads B x T values (measured on the peer shape:
    ~7% fewer CPU seconds per step)."""
    v = x_BTV.shape[-1]
    inside_BT = (targets_BT >= 0) & (targets_BT < v)
    idx_BT1 = jnp.clip(targets_BT, 0, v - 1)[..., None]
    return jnp.where(inside_BT, jnp.take_along_axis(x_BTV, idx_BT1, axis=-1)[..., 0], 0).astype(
        x_BTV.dtype
    )


def _pick_fwd(x_BTV, targets_BT):
    return _pick(x_BTV, targets_BT), (targets_BT, jax.ShapeDtypeStruct(x_BTV.shape, x_BTV.dtype))


def _pick_bwd(res, g_BT):
    targets_BT, x = res
    vocab_V = jax.lax.broadcasted_iota(targets_BT.dtype, x.shape, len(x.shape) - 1)
    return jnp.where(vocab_V == targets_BT[..., None], g_BT[..., None], 0).astype(x.dtype), None


_pick.defvjp(_pick_fwd, _pick_bwd)


def chunked_token_xent(
    x_BTD: jax.Array,
    head_DV: jax.Array,
    targets_BT: jax.Array,
    *,
    chunk_tokens: int,
    seq_shards: int = 1,
    compute_dtype=None,
    softcap: float = 0.0,
) -> jax.Array:
    """`token_xent` of the logits einsum("btd,dv->btv", x, head) [B,T] float32, computed
    chunk_tokens tokens at a time: a scan over sequence chunks whose body is rematerialised
    (jax.checkpoint), so the forward keeps no logits and the backward recomputes each chunk's. Peak:
    one chunk's [B,chunk,V] float32 logits (and their softmax) instead of [B,T,V]. The math per
    token is the unchunked head's, so values and gradients are the same.

    x_BTD: the final-normed hidden states; head_DV: the LM head (tied: embed_VD.T), cast to
    `compute_dtype` (default: x's) as models/pieces.py casts it; the logits accumulate in
    float32. `seq_shards`: the number of contiguous blocks the sequence dim is sharded into over a
    mesh axis; T is viewed as [seq_shards, T/seq_shards] and chunked inside each block, the block
    dim kept whole, so every chunk holds tokens of every sequence shard and GSPMD never reshards T.
    Batch and vocabulary dims may be sharded in any way: they are carried through untouched.
    `softcap`: the logits soft-capped first (models/softcap.py; 0 = none).

    A block length that chunk_tokens does not divide is padded up to a whole number of chunks
    (zeros; their losses are sliced off, so they receive no gradient) rather than shrinking the
    chunk to a divisor: a prime length would leave chunks of one token, a scan of T steps."""
    b, t, _ = x_BTD.shape
    if chunk_tokens < 1 or seq_shards < 1 or t % seq_shards:
        raise ValueError(
            f"chunked_token_xent: chunk_tokens {chunk_tokens} and seq_shards {seq_shards} must be"
            f" >= 1, and seq_shards must divide the sequence length {t}"
        )
    block = t // seq_shards
    chunk = min(chunk_tokens, block)
    n_chunks = -(-block // chunk)
    pad = n_chunks * chunk - block
    head_DV = head_DV.astype(compute_dtype or x_BTD.dtype)

    # Dims below: S sequence shards (seq_shards), J chunks per shard (n_chunks), C tokens per chunk.
    def chunks(a_BT):
        """[B,T,...] -> [J,B,S,C,...]: the scanned dim first, the others in place."""
        a = a_BT.reshape(b, seq_shards, block, *a_BT.shape[2:])
        a = jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
        a = a.reshape(b, seq_shards, n_chunks, chunk, *a.shape[3:])
        return jnp.moveaxis(a, 2, 0)

    def chunk_xent(carry, xs):
        x_BSCD, targets_BSC = xs
        logits_BSCV = cap_logits(head_logits(x_BSCD, head_DV), softcap)
        return carry, token_xent(logits_BSCV, targets_BSC)

    # Saves nothing of the body: the backward recomputes the chunk's logits. prevent_cse=False: a
    # scan body cannot have its recomputation merged into the forward, so the barrier is not needed.
    body = jax.checkpoint(chunk_xent, prevent_cse=False)
    _, xent_JBSC = jax.lax.scan(body, None, (chunks(x_BTD), chunks(targets_BT)))
    xent_BSJC = jnp.moveaxis(xent_JBSC, 0, 2)
    return xent_BSJC.reshape(b, seq_shards, n_chunks * chunk)[:, :, :block].reshape(b, t)
