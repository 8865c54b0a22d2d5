"""Attention whose memory is linear in the sequence: a `lax.scan` over blocks of keys with an
online softmax (FlashAttention's recurrence, in pure JAX), and a backward pass that scans the key
blocks again from the saved log-sum-exp instead of keeping the [T, S] probabilities.

Visibility is decided by positions, never by index: query i sees key j iff k_pos[j] <= q_pos[i],
its segment when segment ids are given, and q_pos[i] - k_pos[j] < W with a window of W keys. So
the queries and keys may be laid out in any order (a zigzag layout of a sharded sequence), and the
keys may be another device's block. The query dim is never looped or reshaped: it is treated like
a batch dim, so GSPMD may shard it over mesh axes.

Shape letters as everywhere (B batch, T queries, S keys, N query heads, K kv heads, H head dim,
Q = N / K query heads per kv head); here C is keys per block and G the number of blocks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from models.softcap import softcap as cap_scores
from models.softcap import softcap_grad

# The log-sum-exp of a query that sees no key at all (its output is 0). Finite, not -inf: callers
# that combine partial results over several key blocks (ring attention) take
# lse = logaddexp(lse_a, lse_b) and weigh each part by exp(lse_part - lse); with -inf on both sides
# that is exp(-inf - (-inf)) = NaN in the forward and in autodiff, with this value it is
# exp(0) * 0 = 0. It is below any real log-sum-exp by ~1e30, so it never shifts a real one.
NO_KEYS_LSE = -1e30
# keys per block: scores of [B, T, N, 512] float32 at a time; a multiple of 128 for GPU/TPU tiles
BLOCK_K = 512


def blockwise_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    q_pos_BT: jax.Array,
    k_pos_BS: jax.Array,
    q_seg_BT: jax.Array | None = None,
    k_seg_BS: jax.Array | None = None,
    *,
    window: int | None = None,
    block_k: int = BLOCK_K,
    return_lse: bool = False,
    softcap: float = 0.0,
):
    """Grouped-query attention (query head n uses kv head n // (N / K)), scale 1/sqrt(H), the
    scaled scores soft-capped by `softcap` (models/softcap.py; 0 = none).

    Returns out_BTNH in q's dtype, and with `return_lse` also lse_BTN (float32): the log-sum-exp
    of the query's visible scaled scores, NO_KEYS_LSE where it sees none. Both are differentiable;
    the gradient of lse lets a caller merge attention over several key blocks exactly. Scores,
    softmax statistics and accumulators are float32 whatever the input dtype. Memory: one
    [B, T, N, block_k] block of scores at a time, in the forward and in the backward.
    """
    b, t, n, h = q_BTNH.shape
    s, kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
    if k_BSKH.shape != v_BSKH.shape or (k_BSKH.shape[0], k_BSKH.shape[3]) != (b, h):
        raise ValueError(
            f"k {k_BSKH.shape} and v {v_BSKH.shape} must both be [B, S, K, H] with B={b} and H={h} "
            f"as in q {q_BTNH.shape}"
        )
    if n % kv_heads:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={kv_heads}")
    if q_pos_BT.shape != (b, t) or k_pos_BS.shape != (b, s):
        raise ValueError(
            f"positions {q_pos_BT.shape}, {k_pos_BS.shape} must be [B, T]={b, t} and [B, S]={b, s}"
        )
    if (q_seg_BT is None) != (k_seg_BS is None) or (
        q_seg_BT is not None and (q_seg_BT.shape, k_seg_BS.shape) != ((b, t), (b, s))
    ):
        raise ValueError("segment ids: give both q_seg_BT [B, T] and k_seg_BS [B, S], or neither")
    if window is not None and window < 1:
        raise ValueError(
            f"window={window}: a window holds at least 1 key (the query's own), or None"
        )
    if block_k < 1:
        raise ValueError(f"block_k={block_k}: must be at least 1")
    # no padding beyond S when one block holds every key
    out_BTNH, lse_BTN = _attention(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        q_pos_BT,
        k_pos_BS,
        q_seg_BT,
        k_seg_BS,
        window,
        min(block_k, s),
        softcap,
    )
    return (out_BTNH, lse_BTN) if return_lse else out_BTNH


def _blocks(x_BS, c: int, fill=0):
    """[B, S, ...] -> [G, B, C, ...] (G = S/C blocks), S padded up to a multiple of C with `fill`:
    the scan's xs."""
    b, s = x_BS.shape[:2]
    pad = -s % c
    x_BS = jnp.pad(x_BS, [(0, 0), (0, pad)] + [(0, 0)] * (x_BS.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x_BS.reshape(b, (s + pad) // c, c, *x_BS.shape[2:]), 1, 0)


def _key_blocks(k_BSKH, v_BSKH, k_pos_BS, k_seg_BS, c: int):
    """The scan's xs: k, v, positions, segments (None when absent) and whether each slot holds a
    key (False in the padding), every one [G, B, C, ...]."""
    real_BS = jnp.ones(k_pos_BS.shape, bool)
    seg = None if k_seg_BS is None else _blocks(k_seg_BS, c)
    return (
        _blocks(k_BSKH, c),
        _blocks(v_BSKH, c),
        _blocks(k_pos_BS, c),
        seg,
        _blocks(real_BS, c, False),
    )


def _tied(block):
    """A key block with its positions, segments and padding flags behind one optimisation barrier
    with the keys. The visibility mask depends on integers alone; under autodiff with remat JAX's
    partial evaluation would compute it for every block ahead of the loop and stack it as a
    residual, a [G, B, T, K, Q, C] = T x S x N boolean. Tied to the keys, it stays inside the
    loop."""
    return jax.lax.optimization_barrier(block)


def visible(q_pos, k_pos, q_seg, k_seg, window: int | None):
    """Whether a query sees a key (broadcasting): at an earlier or equal position, of the same
    segment (segment ids None: one segment), within a window of `window` keys (0 or None: none).
    The one visibility rule of every attention path (models/attention.py, models/context.py)."""
    seen = k_pos <= q_pos
    if window:
        seen &= k_pos > q_pos - window
    if q_seg is not None:
        seen &= q_seg == k_seg
    return seen


def _visible_BKQTC(q_pos_BT, q_seg_BT, k_pos_BC, k_seg_BC, real_BC, window):
    """Which keys of one block each query sees, broadcast over the head dims K and Q."""
    seg = (None, None) if q_seg_BT is None else (q_seg_BT[:, :, None], k_seg_BC[:, None, :])
    seen_BTC = (
        visible(q_pos_BT[:, :, None], k_pos_BC[:, None, :], *seg, window) & real_BC[:, None, :]
    )
    return seen_BTC[:, None, None]


def _scores_BKQTC(q_BKQTH, k_BCKH, scale, softcap):
    return cap_scores(
        jnp.einsum("bkqth,bckh->bkqtc", q_BKQTH, k_BCKH, preferred_element_type=jnp.float32)
        * scale,
        softcap,
    )


def _grouped(x_BTNH, kv_heads: int):
    """[B, T, N, H] -> [B, K, Q, T, H]: query head n = k * Q + j uses kv head k. Heads-major, so
    each block's score and probability matmuls are plain batched [T, H] x [H, C] products with
    their batch dims leading (as in models/dense_attention.py, which measured the sequence-major
    layout 2.5-2.9x slower on XLA:CPU); a transpose keeps T a dim of its own, shardable alike."""
    b, t, n, h = x_BTNH.shape
    return x_BTNH.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def _ungrouped(x_BKQT):
    """[B, K, Q, T, ...] -> [B, T, N, ...]: `_grouped`'s inverse."""
    b, k, q, t = x_BKQT.shape[:4]
    return jnp.moveaxis(x_BKQT, 3, 1).reshape(b, t, k * q, *x_BKQT.shape[4:])


def _forward(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, window, c, softcap):
    kv_heads = k_BSKH.shape[2]
    scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
    q_BKQTH = _grouped(q_BTNH, kv_heads)

    def step(carry, block):
        # running max m, denominator l and unnormalised output acc of the keys seen so far
        m_BKQT, l_BKQT, acc_BKQTH = carry
        k_BCKH, v_BCKH, k_pos_BC, k_seg_BC, real_BC = _tied(block)
        seen = _visible_BKQTC(q_pos_BT, q_seg_BT, k_pos_BC, k_seg_BC, real_BC, window)
        s_BKQTC = jnp.where(seen, _scores_BKQTC(q_BKQTH, k_BCKH, scale, softcap), -jnp.inf)
        m_new = jnp.maximum(m_BKQT, s_BKQTC.max(-1))
        # a query that has seen no key yet keeps m = -inf; shifting by 0 instead keeps exp() free
        # of -inf - (-inf): its p and correction are exp(-inf) = 0
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p_BKQTC = jnp.exp(s_BKQTC - shift[..., None])
        correction = jnp.exp(m_BKQT - shift)
        pv_BKQTH = jnp.einsum(
            "bkqtc,bckh->bkqth",
            p_BKQTC.astype(v_BCKH.dtype),
            v_BCKH,
            preferred_element_type=jnp.float32,
        )
        return (
            m_new,
            l_BKQT * correction + p_BKQTC.sum(-1),
            acc_BKQTH * correction[..., None] + pv_BKQTH,
        ), None

    bkqt = q_BKQTH.shape[:-1]
    init = (jnp.full(bkqt, -jnp.inf), jnp.zeros(bkqt), jnp.zeros(q_BKQTH.shape))
    (m_BKQT, l_BKQT, acc_BKQTH), _ = jax.lax.scan(
        step, init, _key_blocks(k_BSKH, v_BSKH, k_pos_BS, k_seg_BS, c)
    )
    seen_any = l_BKQT > 0
    # acc is 0 where nothing was seen
    out_BKQTH = acc_BKQTH / jnp.where(seen_any, l_BKQT, 1.0)[..., None]
    lse_BKQT = jnp.where(seen_any, m_BKQT + jnp.log(jnp.where(seen_any, l_BKQT, 1.0)), NO_KEYS_LSE)
    return _ungrouped(out_BKQTH).astype(q_BTNH.dtype), _ungrouped(lse_BKQT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, window, c, softcap):
    return _forward(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, window, c, softcap
    )


def _attention_fwd(
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, window, c, softcap
):
    out_BTNH, lse_BTN = _forward(
        q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, window, c, softcap
    )
    # the residuals are O(T + S): no probabilities, the backward recomputes them from lse
    return (out_BTNH, lse_BTN), (
        q_BTNH,
        k_BSKH,
        v_BSKH,
        q_pos_BT,
        k_pos_BS,
        q_seg_BT,
        k_seg_BS,
        out_BTNH,
        lse_BTN,
    )


def _attention_bwd(window, c, softcap, residuals, cotangents):
    """FlashAttention-2's backward over key blocks: with p = softmax probabilities (exp(s - lse)),
    dv = p^T dout, dp = dout v^T, ds = p * (dp - D) with D = rowsum(dout * out) - dlse (d lse/d s =
    p, so the lse cotangent enters D), dq = ds k, dk = ds^T q, both times the scale (and, with a
    soft cap, times its derivative at the score)."""
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS, out_BTNH, lse_BTN = residuals
    dout_BTNH, dlse_BTN = cotangents
    b, h = q_BTNH.shape[0], q_BTNH.shape[3]
    s, kv_heads = k_BSKH.shape[1:3]
    scale, f32 = 1.0 / math.sqrt(h), jnp.float32
    q_BKQTH, dout_BKQTH = _grouped(q_BTNH, kv_heads), _grouped(dout_BTNH, kv_heads)
    lse_BKQT = _grouped(lse_BTN[..., None], kv_heads)[..., 0]
    d_BTN = jnp.einsum("btnh,btnh->btn", dout_BTNH.astype(f32), out_BTNH.astype(f32)) - dlse_BTN
    d_BKQT = _grouped(d_BTN[..., None], kv_heads)[..., 0]

    def step(dq_BKQTH, block):
        k_BCKH, v_BCKH, k_pos_BC, k_seg_BC, real_BC = _tied(block)
        seen = _visible_BKQTC(q_pos_BT, q_seg_BT, k_pos_BC, k_seg_BC, real_BC, window)
        # hidden scores get exp(-inf) = 0; a query that sees nothing has lse = NO_KEYS_LSE and
        # only hidden scores, so its p, ds and dq are 0
        s_BKQTC = _scores_BKQTC(q_BKQTH, k_BCKH, scale, softcap)
        p_BKQTC = jnp.exp(jnp.where(seen, s_BKQTC - lse_BKQT[..., None], -jnp.inf))
        dv_BCKH = jnp.einsum(
            "bkqtc,bkqth->bckh",
            p_BKQTC.astype(dout_BKQTH.dtype),
            dout_BKQTH,
            preferred_element_type=f32,
        )
        dp_BKQTC = jnp.einsum("bkqth,bckh->bkqtc", dout_BKQTH, v_BCKH, preferred_element_type=f32)
        ds_BKQTC = p_BKQTC * (dp_BKQTC - d_BKQT[..., None]) * scale
        if softcap:
            ds_BKQTC = ds_BKQTC * softcap_grad(s_BKQTC, softcap)
        ds_BKQTC = ds_BKQTC.astype(q_BKQTH.dtype)
        dq_BKQTH = dq_BKQTH + jnp.einsum(
            "bkqtc,bckh->bkqth", ds_BKQTC, k_BCKH, preferred_element_type=f32
        )
        dk_BCKH = jnp.einsum("bkqtc,bkqth->bckh", ds_BKQTC, q_BKQTH, preferred_element_type=f32)
        return dq_BKQTH, (dk_BCKH.astype(k_BSKH.dtype), dv_BCKH.astype(v_BSKH.dtype))

    blocks = _key_blocks(k_BSKH, v_BSKH, k_pos_BS, k_seg_BS, c)
    dq_BKQTH, (dk_GBCKH, dv_GBCKH) = jax.lax.scan(step, jnp.zeros(q_BKQTH.shape, f32), blocks)

    def unblock(x_GBCKH):  # [G, B, C, K, H] -> [B, S, K, H], the padding dropped
        return jnp.moveaxis(x_GBCKH, 0, 1).reshape(b, -1, kv_heads, h)[:, :s]

    # positions and segment ids are integers: no cotangent
    return (
        _ungrouped(dq_BKQTH).astype(q_BTNH.dtype),
        unblock(dk_GBCKH),
        unblock(dv_GBCKH),
        None,
        None,
        None,
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)
