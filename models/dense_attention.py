"""Attention over a whole (unsharded) sequence with the [T, S] scores materialised: the `dense`
kind, XLA's einsums with a hand-written backward.

The math is `jax.nn.dot_product_attention(implementation="xla")`'s: scores q.k accumulated and
kept in float32, scaled by 1/sqrt(H), masked, a float32 softmax, probabilities cast to the compute
dtype for the product with v. What differs is the backward, written here (`jax.custom_vjp`)
instead of derived by autodiff:

- the score gradient dS is cast to the compute dtype before its two matmuls (dq = dS k, dk = dS^T
  q), as FlashAttention's backward does. Autodiff of the float32 scores multiplies the float32 dS
  by the bf16 k and q promoted to float32: on XLA:CPU two float32 matmuls over [T, S] plus the
  conversions of q and k, where bf16 ones accumulate in float32 anyway;
- the softmax's row term sum_s p_s dp_s is computed as sum_h dout_h out_h (the same number: out =
  p v), a pass over [T, H] instead of [T, S];
- the probabilities are saved in the compute dtype (the operand of the forward's p.v), not float32.

In float32 every cast is a no-op and the dots are those of autodiff.

Shape letters: B batch, T queries, S keys, N query heads, K kv heads, Q = N / K query heads per kv
head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS) -> jax.Array:
    """Grouped-query attention (query head n uses kv head n // Q), scale 1/sqrt(H). `mask_BTS`:
    bool, broadcastable to [B, T, S] (True: the query sees the key). -> out_BTNH in q's dtype."""
    b, t, n, h = q_BTNH.shape
    k = k_BSKH.shape[2]
    q_BTKQH = q_BTNH.reshape(b, t, k, n // k, h)
    mask_B11TS = jnp.broadcast_to(mask_BTS, (mask_BTS.shape[0], t, k_BSKH.shape[1]))[:, None, None]
    out_BTKQH = _attend(q_BTKQH, k_BSKH, v_BSKH, mask_B11TS)
    return out_BTKQH.reshape(b, t, n, h)


# what jax.nn.dot_product_attention puts in masked scores: finite, so a row that sees nothing
# gives a uniform softmax instead of NaN
_MASKED = float(np.float32(-0.7) * np.finfo(np.float32).max)


def _probs(q_BTKQH, k_BSKH, mask_B11TS):
    """Softmax of the masked, scaled scores: [B, K, Q, T, S] float32."""
    scale = q_BTKQH.shape[-1] ** -0.5
    s_BKQTS = jnp.einsum("btkqh,bskh->bkqts", q_BTKQH, k_BSKH, preferred_element_type=jnp.float32)
    s_BKQTS = jnp.where(mask_B11TS, s_BKQTS * scale, _MASKED)
    return jax.nn.softmax(s_BKQTS, axis=-1)


@jax.custom_vjp
def _attend(q_BTKQH, k_BSKH, v_BSKH, mask_B11TS):
    p_BKQTS = _probs(q_BTKQH, k_BSKH, mask_B11TS).astype(v_BSKH.dtype)
    return jnp.einsum("bkqts,bskh->btkqh", p_BKQTS, v_BSKH)


def _attend_fwd(q_BTKQH, k_BSKH, v_BSKH, mask_B11TS):
    p_BKQTS = _probs(q_BTKQH, k_BSKH, mask_B11TS).astype(v_BSKH.dtype)
    out_BTKQH = jnp.einsum("bkqts,bskh->btkqh", p_BKQTS, v_BSKH)
    return out_BTKQH, (q_BTKQH, k_BSKH, v_BSKH, p_BKQTS, out_BTKQH)


def _attend_bwd(res, dout_BTKQH):
    q_BTKQH, k_BSKH, v_BSKH, p_BKQTS, out_BTKQH = res
    dt, f32 = q_BTKQH.dtype, jnp.float32
    scale = q_BTKQH.shape[-1] ** -0.5
    dv_BSKH = jnp.einsum("bkqts,btkqh->bskh", p_BKQTS, dout_BTKQH, preferred_element_type=f32)
    dp_BKQTS = jnp.einsum("btkqh,bskh->bkqts", dout_BTKQH, v_BSKH, preferred_element_type=f32)
    # sum_s p_s dp_s = dout . out, per query and head: a reduction over H, not a matmul
    row_BTKQ = jnp.sum(dout_BTKQH.astype(f32) * out_BTKQH.astype(f32), axis=-1)
    row_BKQT = jnp.moveaxis(row_BTKQ, 1, -1)
    ds_BKQTS = (p_BKQTS.astype(f32) * (dp_BKQTS - row_BKQT[..., None]) * scale).astype(dt)
    dq_BTKQH = jnp.einsum("bkqts,bskh->btkqh", ds_BKQTS, k_BSKH, preferred_element_type=f32)
    dk_BSKH = jnp.einsum("bkqts,btkqh->bskh", ds_BKQTS, q_BTKQH, preferred_element_type=f32)
    return (
        dq_BTKQH.astype(dt),
        dk_BSKH.astype(k_BSKH.dtype),
        dv_BSKH.astype(v_BSKH.dtype),
        None,
    )


_attend.defvjp(_attend_fwd, _attend_bwd)
