"""Decoding with the KV cache of a layer that attends within a window: a ring of S slots, position p
in slot p % S, so a local layer keeps min(window, length) positions instead of the whole sequence
(Gemma 3's five local layers of six at a 1,024-token window; Mistral's every layer). S = the whole
length is the plain cache, never wrapping: the same code serves a global layer whose scores are
soft-capped (Gemma 2), which jax.nn.dot_product_attention cannot do.

Each call attends its queries to the slots as they were (the positions before this call) and to
its own new keys, masked by positions (models/blockwise.py `visible`: the window and causality),
then writes the last min(T, S) new keys into their slots. A prefill longer than the window thus
sees every key it needs although the ring keeps only the last S.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import context

# the position of an empty slot: after every query's, so causality hides it
EMPTY = jnp.iinfo(jnp.int32).max


def slot_positions(index: jax.Array, s: int) -> jax.Array:
    """[S] the position each slot holds when `index` positions were written (EMPTY: none yet):
    the largest p < index with p % S == slot."""
    slot_S = jnp.arange(s, dtype=jnp.int32)
    p_S = index - 1 - jnp.remainder(index - 1 - slot_S, s)
    return jnp.where(p_S >= 0, p_S, EMPTY)


def attend_and_write(q_BTNH, k_BTKH, v_BTKH, positions_BT, cache, *, window: int, softcap: float):
    """-> (out_BTNH, the cache with the new keys written). `cache`: models.attention.KVCache of one
    layer, k/v [B,S,K,H]; the new tokens are at positions index .. index + T - 1."""
    b, t = k_BTKH.shape[:2]
    s = cache.k.shape[1]
    dt = q_BTNH.dtype
    k_pos_BS = jnp.broadcast_to(slot_positions(cache.index, s), (b, s))
    out_BTNH = context.local_attention(
        q_BTNH,
        jnp.concatenate([cache.k.astype(dt), k_BTKH], axis=1),
        jnp.concatenate([cache.v.astype(dt), v_BTKH], axis=1),
        positions_BT,
        jnp.concatenate([k_pos_BS, positions_BT.astype(jnp.int32)], axis=1),
        None,
        None,
        window=window,
        kind="dense",
        softcap=softcap,
    )
    n = min(t, s)  # the ring keeps the last S positions
    slots_N = jnp.remainder(cache.index + t - n + jnp.arange(n), s)
    k = cache.k.at[:, slots_N].set(k_BTKH[:, t - n :].astype(cache.k.dtype))
    v = cache.v.at[:, slots_N].set(v_BTKH[:, t - n :].astype(cache.v.dtype))
    return out_BTNH, type(cache)(k, v, cache.index + t)
