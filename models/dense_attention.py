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
    # heads-major operands, [B, K, Q, T, H] and [B, K, S, H]: every score and probability
    # matmul is then a plain batched [T, H] x [H, S] product whose batch dims lead on both sides
    # and in the output. With the sequence-major operands the [T, S] products and their float32
    # outputs were laid out by XLA:CPU with transposes of the scores: 2.9x slower fwd + bwd at
    # T = 1,024 (BENCHMARKS.md, "The attention's and the MLP's layouts"). Transposing q, k, v
    # and the output moves [T, H] values, not [T, S] ones.
    q_BKQTH = q_BTNH.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    k_BKSH = k_BSKH.transpose(0, 2, 1, 3)
    v_BKSH = v_BSKH.transpose(0, 2, 1, 3)
    mask_B11TS = jnp.broadcast_to(mask_BTS, (mask_BTS.shape[0], t, k_BSKH.shape[1]))[:, None, None]
    out_BKQTH = _attend(q_BKQTH, k_BKSH, v_BKSH, mask_B11TS)
    return out_BKQTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


# what jax.nn.dot_product_attention puts in masked scores: finite, so a row that sees nothing
# gives a uniform softmax instead of NaN
_MASKED = float(np.float32(-0.7) * np.finfo(np.float32).max)


def _probs(q_BKQTH, k_BKSH, mask_B11TS):
    """Softmax of the masked, scaled scores: [B, K, Q, T, S] float32."""
    scale = q_BKQTH.shape[-1] ** -0.5
    s_BKQTS = jnp.einsum("bkqth,bksh->bkqts", q_BKQTH, k_BKSH, preferred_element_type=jnp.float32)
    s_BKQTS = jnp.where(mask_B11TS, s_BKQTS * scale, _MASKED)
    return jax.nn.softmax(s_BKQTS, axis=-1)


@jax.custom_vjp
def _attend(q_BKQTH, k_BKSH, v_BKSH, mask_B11TS):
    p_BKQTS = _probs(q_BKQTH, k_BKSH, mask_B11TS).astype(v_BKSH.dtype)
    return jnp.einsum("bkqts,bksh->bkqth", p_BKQTS, v_BKSH)


def _attend_fwd(q_BKQTH, k_BKSH, v_BKSH, mask_B11TS):
    p_BKQTS = _probs(q_BKQTH, k_BKSH, mask_B11TS).astype(v_BKSH.dtype)
    out_BKQTH = jnp.einsum("bkqts,bksh->bkqth", p_BKQTS, v_BKSH)
    return out_BKQTH, (q_BKQTH, k_BKSH, v_BKSH, p_BKQTS, out_BKQTH)


def _attend_bwd(res, dout_BKQTH):
    q_BKQTH, k_BKSH, v_BKSH, p_BKQTS, out_BKQTH = res
    dt, f32 = q_BKQTH.dtype, jnp.float32
    scale = q_BKQTH.shape[-1] ** -0.5
    dv_BKSH = jnp.einsum("bkqts,bkqth->bksh", p_BKQTS, dout_BKQTH, preferred_element_type=f32)
    dp_BKQTS = jnp.einsum("bkqth,bksh->bkqts", dout_BKQTH, v_BKSH, preferred_element_type=f32)
    # sum_s p_s dp_s = dout . out, per query and head: a reduction over H, not a matmul
    row_BKQT1 = jnp.sum(dout_BKQTH.astype(f32) * out_BKQTH.astype(f32), axis=-1, keepdims=True)
    ds_BKQTS = (p_BKQTS.astype(f32) * (dp_BKQTS - row_BKQT1) * scale).astype(dt)
    dq_BKQTH = jnp.einsum("bkqts,bksh->bkqth", ds_BKQTS, k_BKSH, preferred_element_type=f32)
    dk_BKSH = jnp.einsum("bkqts,bkqth->bksh", ds_BKQTS, q_BKQTH, preferred_element_type=f32)
    return (
        dq_BKQTH.astype(dt),
        dk_BKSH.astype(k_BKSH.dtype),
        dv_BKSH.astype(v_BKSH.dtype),
        None,
    )


_attend.defvjp(_attend_fwd, _attend_bwd)
