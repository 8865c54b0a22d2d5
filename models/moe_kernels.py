"""Grouped matmuls of the dropless MoE: rows of several experts, each row through its own expert's
SwiGLU FFN. Shape letters as in models/moe.py: R rows, X experts on this device, D d_model,
F expert width, G blocks of b rows.

Two kernels:
- `gmm_ragged`: lax.ragged_dot on rows sorted by expert (GPU/TPU: only the real rows are computed);
- `gmm_blocks`: each expert's rows padded to whole blocks (MegaBlocks), a loop over the used blocks
  only, one small dense FFN per block. XLA:CPU computes ragged_dot about like every expert on every
  row, so this is the CPU kernel. Its backward is written by hand (`blocked_ffn`): autodiff of a
  per-block weight index writes a whole [X,D,F] cotangent per block, and gathering each block's
  weights up front copies them once per block; here each block reads its expert's weights in place
  and adds its weight gradient into the expert's slice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def rank_in_group(g_A: jax.Array, n_groups: int):
    """Rank of each element among those with the same group id, in order (stable) ->
    (rank_A, sizes_G). Ids >= n_groups (padding) are not counted."""
    # (no jnp.searchsorted: it fails on shard_map-varying arrays in jax 0.10)
    order = jnp.argsort(g_A, stable=True)
    sorted_g = g_A[order]
    sizes_G = jnp.zeros((n_groups,), jnp.int32).at[g_A].add(1, mode="drop")
    start_G = jnp.cumsum(sizes_G) - sizes_G
    rank_sorted = jnp.arange(g_A.shape[0]) - start_G.at[jnp.minimum(sorted_g, n_groups - 1)].get()
    rank_A = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return rank_A, sizes_G


# ------------------------------------------------------------------ ragged_dot (GPU/TPU)


def gmm_sorted(xs_RD, sizes_X, wg_XDF, wu_XDF, wd_XFD):
    """Rows already sorted by expert, sizes_X rows each, through lax.ragged_dot; rows past
    sum(sizes_X) (padding) come out 0."""
    h_RF = jax.nn.silu(lax.ragged_dot(xs_RD, wg_XDF, sizes_X)) * lax.ragged_dot(
        xs_RD, wu_XDF, sizes_X
    )
    return lax.ragged_dot(h_RF, wd_XFD, sizes_X)


def batched_like(x_RD, *ws):
    """Under a vmap (data-parallel micro-batches, train/core/step.py) jax 0.10 batches ragged_dot
    only when every operand is batched; adding a zero computed from the rows makes the weights
    follow the rows' batching (the group sizes come from the routing, already batched). That dim is
    sharded over the data axes, so each device still holds one copy. Only used under that vmap:
    elsewhere the adds would cost a pass over the weights."""
    v = x_RD.reshape(-1)[0]
    zero = jnp.where(jnp.isfinite(v), v, 0) * 0  # 0 even for an inf/NaN row
    return tuple(w + zero.astype(w.dtype) for w in ws)


def gmm_ragged(x_RD, g_R, wg_XDF, wu_XDF, wd_XFD):
    """Rows grouped by expert id g (== X: padding, comes out 0) through lax.ragged_dot."""
    x_count = wg_XDF.shape[0]
    order = jnp.argsort(g_R, stable=True)
    sizes_X = jnp.sum(jax.nn.one_hot(g_R, x_count, dtype=jnp.int32), axis=0)
    return gmm_sorted(x_RD[order], sizes_X, wg_XDF, wu_XDF, wd_XFD)[jnp.argsort(order)]


# ------------------------------------------------------------------ padded blocks (CPU)


def block_size(rows_expected: int, x_count: int) -> int:
    """About 4 blocks per expert at a balanced load (padding wastes under a quarter of the rows),
    but at least 64 rows: on CPU, 16-row blocks ran 3x slower than 64-128 (benchmarks/moe.py)."""
    per_expert = max(rows_expected // max(x_count, 1), 1)
    return int(min(256, max(64, 2 ** math.floor(math.log2(max(per_expert // 4, 1))))))


def gmm_blocks(x_RD, g_R, wg_XDF, wu_XDF, wd_XFD, block: int):
    """Rows grouped by expert id (== X: padding, comes out 0), each expert's rows padded to whole
    blocks; only the used blocks are computed, so the cost follows the real rows, not the buffer."""
    x_count, (r, d) = wg_XDF.shape[0], x_RD.shape
    rank_R, sizes_X = rank_in_group(g_R, x_count)
    padded_X = -(-sizes_X // block) * block
    end_X = jnp.cumsum(padded_X)
    start_X = end_X - padded_X
    n_blocks = -(-(r + x_count * (block - 1)) // block)
    dest_R = jnp.where(
        g_R < x_count, start_X.at[jnp.minimum(g_R, x_count - 1)].get() + rank_R, n_blocks * block
    )
    xb_GbD = jnp.zeros((n_blocks * block, d), x_RD.dtype).at[dest_R].set(x_RD, mode="drop")
    # the used blocks come first, expert by expert
    group_G = jnp.sum(jnp.arange(n_blocks)[:, None] * block >= end_X[None, :], axis=1).astype(
        jnp.int32
    )
    used = (end_X[-1] // block).astype(jnp.int32)
    xb_GbD, wg_XDF, wu_XDF, wd_XFD = _vary_alike(
        xb_GbD.reshape(n_blocks, block, d), wg_XDF, wu_XDF, wd_XFD
    )
    yb_GbD = blocked_ffn(xb_GbD, jnp.minimum(group_G, x_count - 1), used, wg_XDF, wu_XDF, wd_XFD)
    return yb_GbD.reshape(-1, d).at[dest_R].get(mode="fill", fill_value=0)


def varying_axes(*arrays) -> tuple:
    """The shard_map axes any of `arrays` varies over."""
    return tuple(set().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays)))


def _vary_alike(*arrays):
    """Under shard_map, every array made to vary over the union of their axes, outside the custom
    VJP: each weight's cotangent is then summed over the axes it did not vary over by autodiff
    (the transpose of the cast), and the hand-written backward returns cotangents of its inputs'
    types."""
    vma = set(varying_axes(*arrays))
    return tuple(
        lax.pcast(a, tuple(vma - set(varying_axes(a))), to="varying")
        if vma - set(varying_axes(a))
        else a
        for a in arrays
    )


def _zeros(shape, dtype, *like):
    """Zeros that vary over the same shard_map axes as `like` (a loop carry must keep its type)."""
    z = jnp.zeros(shape, dtype)
    vma = varying_axes(*like)
    return lax.pcast(z, vma, to="varying") if vma else z


def _take(a, i):
    return lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _put(a, i, v):
    return lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0)


def _dot_t(a_RM, b_RN):
    """a^T b -> [M, N], accumulated in float32 (the weight gradients)."""
    return lax.dot_general(a_RM, b_RN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def blocked_ffn(xb_GbD, group_G, used, wg_XDF, wu_XDF, wd_XFD):
    """Block i < used through expert group_G[i]'s FFN -> [G, b, D]; blocks past `used` are 0."""
    return _blocked_fwd(xb_GbD, group_G, used, wg_XDF, wu_XDF, wd_XFD)[0]


def _blocked_fwd(xb_GbD, group_G, used, wg_XDF, wu_XDF, wd_XFD):
    n_blocks, block, _ = xb_GbD.shape
    f = wg_XDF.shape[2]
    like = (xb_GbD, wg_XDF, wu_XDF, wd_XFD)

    def body(i, acc):
        y_GbD, h1_GbF, h2_GbF = acc
        x_bD, g = _take(xb_GbD, i), _take(group_G, i)
        h1_bF, h2_bF = x_bD @ _take(wg_XDF, g), x_bD @ _take(wu_XDF, g)
        y_bD = (jax.nn.silu(h1_bF) * h2_bF) @ _take(wd_XFD, g)
        return _put(y_GbD, i, y_bD), _put(h1_GbF, i, h1_bF), _put(h2_GbF, i, h2_bF)

    init = (
        _zeros(xb_GbD.shape, xb_GbD.dtype, *like),
        *(_zeros((n_blocks, block, f), xb_GbD.dtype, *like) for _ in range(2)),
    )
    y_GbD, h1_GbF, h2_GbF = lax.fori_loop(0, used, body, init)
    return y_GbD, (xb_GbD, group_G, used, wg_XDF, wu_XDF, wd_XFD, h1_GbF, h2_GbF)


def _blocked_bwd(res, dy_GbD):
    xb_GbD, group_G, used, wg_XDF, wu_XDF, wd_XFD, h1_GbF, h2_GbF = res
    like = (xb_GbD, dy_GbD, wg_XDF, wu_XDF, wd_XFD)

    def body(i, acc):
        dx_GbD, dwg_XDF, dwu_XDF, dwd_XFD = acc
        x_bD, g, dy_bD = _take(xb_GbD, i), _take(group_G, i), _take(dy_GbD, i)
        h1_bF, h2_bF = _take(h1_GbF, i), _take(h2_GbF, i)
        wg_DF, wu_DF, wd_FD = _take(wg_XDF, g), _take(wu_XDF, g), _take(wd_XFD, g)
        sig_bF = jax.nn.sigmoid(h1_bF)
        silu_bF = h1_bF * sig_bF
        dwd_XFD = _put(dwd_XFD, g, _take(dwd_XFD, g) + _dot_t(silu_bF * h2_bF, dy_bD))
        dh_bF = dy_bD @ wd_FD.T
        dh2_bF = dh_bF * silu_bF
        # silu' = sig (1 + h (1 - sig))
        dh1_bF = dh_bF * h2_bF * sig_bF * (1 + h1_bF * (1 - sig_bF))
        dwg_XDF = _put(dwg_XDF, g, _take(dwg_XDF, g) + _dot_t(x_bD, dh1_bF))
        dwu_XDF = _put(dwu_XDF, g, _take(dwu_XDF, g) + _dot_t(x_bD, dh2_bF))
        dx_bD = dh1_bF @ wg_DF.T + dh2_bF @ wu_DF.T
        return _put(dx_GbD, i, dx_bD), dwg_XDF, dwu_XDF, dwd_XFD

    init = (
        _zeros(xb_GbD.shape, xb_GbD.dtype, *like),
        *(_zeros(w.shape, jnp.float32, *like) for w in (wg_XDF, wu_XDF, wd_XFD)),
    )
    dx_GbD, dwg_XDF, dwu_XDF, dwd_XFD = lax.fori_loop(0, used, body, init)
    return (
        dx_GbD,
        None,
        None,
        dwg_XDF.astype(wg_XDF.dtype),
        dwu_XDF.astype(wu_XDF.dtype),
        dwd_XFD.astype(wd_XFD.dtype),
    )


blocked_ffn.defvjp(_blocked_fwd, _blocked_bwd)
