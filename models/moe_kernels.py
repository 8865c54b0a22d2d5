"""Grouped matmuls of the dropless MoE: rows of several experts, each row through its own expert's
SwiGLU FFN. Shape letters as in models/moe.py: R rows, X experts on this device, D d_model,
F expert width, G blocks of b rows.

Two kernels:
- `gmm_ragged`: lax.ragged_dot on rows sorted by expert (GPU/TPU: only the real rows are computed);
- `gmm_blocks`: XLA:CPU computes ragged_dot about like every expert on every row, so this is the
  CPU kernel. Each expert's first rows go through one batched einsum over a fixed number of slots
  per expert (a near-balanced load fills them), the rest padded to whole blocks (MegaBlocks) and
  looped over, the used blocks only, or under a skewed load every row through the blocks: whichever
  computes fewer rows. The blocks' backward is written by hand (`blocked_ffn`): autodiff of a
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
    """About 4 blocks per expert at a balanced load, but at least 128 rows and at most 256. The
    blocks carry a skewed load (`gmm_blocks`), whose hot experts fill big blocks: under Zipf and
    quarter-of-the-experts loads on seven layer shapes, 128-row blocks ran 1.1-1.8x faster than
    64-row ones (`python benchmarks/moe_cpu.py grouped`); 16-row ones 3x slower than 64-128."""
    per_expert = max(rows_expected // max(x_count, 1), 1)
    return int(min(256, max(128, 2 ** math.floor(math.log2(max(per_expert // 4, 1))))))


def einsum_slots(rows_expected: int, x_count: int) -> int:
    """Rows per expert that `gmm_blocks` may run through one batched einsum: 1.25 x a balanced
    load, rounded up to a multiple of 8. On seven layer shapes (2-32 experts, 256-4,096 rows) at a
    uniform load, 1.25 made the kernel 1.3-1.8x faster than the blocks alone; 1.0 was no faster
    than the blocks on four of them and 1.5 slower than 1.25 on six. Under skewed loads, mostly
    left to the blocks, 0.85-1.47x the blocks alone (`python benchmarks/moe_cpu.py grouped`)."""
    per_expert = rows_expected / max(x_count, 1)
    return max(8, 8 * math.ceil(1.25 * per_expert / 8))


# What one block costs beyond its rows' matmuls, in rows: on XLA:CPU a 64-row block took as long
# again as its compute (8 blocks of 64 against 2 of 256 for the same 512 rows: 8.5 vs 5.1 ms)
BLOCK_OVERHEAD_ROWS = 64


def gmm_blocks(x_RD, g_R, wg_XDF, wu_XDF, wd_XFD, block: int, capacity: int = 0):
    """Rows grouped by expert id (== X: padding, comes out 0) through their experts' FFNs, nothing
    dropped, by whichever of two ways computes fewer rows for this load:
    - each expert's rows padded to whole blocks and a loop over the used blocks (`_blocks_ffn`):
      the cost follows the real rows, however skewed the load;
    - with `capacity` (0: never), each expert's first `capacity` rows through one batched einsum
      over [X, capacity] slots (`_slots_ffn`, no loop) and only the rows past them through blocks:
      the cheaper one for a near-balanced load.
    Rows computed count the slots whether filled or not, and each block BLOCK_OVERHEAD_ROWS more."""
    x_count = wg_XDF.shape[0]
    rank_R, sizes_X = rank_in_group(g_R, x_count)
    ws = (wg_XDF, wu_XDF, wd_XFD)
    if not capacity:
        return _blocks_ffn(x_RD, g_R, rank_R, sizes_X, ws, block)

    def blocks_cost(sizes_X):
        return jnp.sum(-(-sizes_X // block)) * (block + BLOCK_OVERHEAD_ROWS)

    past_X = jnp.maximum(sizes_X - capacity, 0)

    def slots_then_blocks():
        past_R = (g_R < x_count) & (rank_R >= capacity)
        y_RD = _slots_ffn(x_RD, g_R, rank_R, ws, capacity)
        rest = (jnp.where(past_R, g_R, x_count), rank_R - capacity, past_X)
        return y_RD + _blocks_ffn(x_RD, *rest, ws, block)

    return lax.cond(
        x_count * capacity + blocks_cost(past_X) <= blocks_cost(sizes_X),
        slots_then_blocks,
        lambda: _blocks_ffn(x_RD, g_R, rank_R, sizes_X, ws, block),
    )


def _slots_ffn(x_RD, g_R, rank_R, ws, capacity: int):
    """Every row into slot rank of its expert's `capacity` slots, all experts in one einsum."""
    (wg_XDF, wu_XDF, wd_XFD), d = ws, x_RD.shape[1]
    x_count = wg_XDF.shape[0]
    fits_R = (g_R < x_count) & (rank_R < capacity)
    slot_R = jnp.where(fits_R, g_R * capacity + rank_R, x_count * capacity)
    x_XCD = jnp.zeros((x_count * capacity, d), x_RD.dtype).at[slot_R].set(x_RD, mode="drop")
    x_XCD = x_XCD.reshape(x_count, capacity, d)
    h_XCF = jax.nn.silu(jnp.einsum("xcd,xdf->xcf", x_XCD, wg_XDF)) * jnp.einsum(
        "xcd,xdf->xcf", x_XCD, wu_XDF
    )
    y_XCD = jnp.einsum("xcf,xfd->xcd", h_XCF, wd_XFD).reshape(-1, d)
    return y_XCD.at[slot_R].get(mode="fill", fill_value=0)


def _blocks_ffn(x_RD, g_R, rank_R, sizes_X, ws, block: int):
    """Each expert's rows padded to whole blocks, a loop over the used blocks (MegaBlocks)."""
    (wg_XDF, wu_XDF, wd_XFD), (r, d) = ws, x_RD.shape
    x_count = wg_XDF.shape[0]
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
    group_G = jnp.minimum(group_G, x_count - 1)
    # no block used (all padding, or no row past the slots): not even the loop's buffers
    yb_GbD = lax.cond(
        used > 0,
        lambda: blocked_ffn(xb_GbD, group_G, used, wg_XDF, wu_XDF, wd_XFD),
        lambda: jnp.zeros_like(xb_GbD),
    )
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


def _dot_wt(a_bN, w_MN):
    """a w^T -> [b, M], contracting both operands' last dims in one dot_general: XLA:CPU runs
    `a @ w.T` as a transpose and a matmul, 3x the time of this one (a [64, 256] block, bf16)."""
    return lax.dot_general(a_bN, w_MN, (((1,), (1,)), ((), ())))


def _dot32(a_MK, b_KN):
    """a b -> [M, N], accumulated and returned in float32 (the weight gradients)."""
    return lax.dot(a_MK, b_KN, preferred_element_type=jnp.float32)


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
    # the blocks' rows transposed once, so that each weight gradient is a plain [D, b] x [b, F]
    # matmul: contracting the rows of untransposed blocks took 2.2x as long on XLA:CPU
    xt_GDb, dyt_GDb = (jnp.swapaxes(a, 1, 2) for a in (xb_GbD, dy_GbD))

    def body(i, acc):
        # the down projection's gradient accumulates transposed ([D, F], as dy^T (silu h2))
        dx_GbD, dwg_XDF, dwu_XDF, dwdt_XDF = acc
        g, dy_bD = _take(group_G, i), _take(dy_GbD, i)
        xt_Db, dyt_Db = _take(xt_GDb, i), _take(dyt_GDb, i)
        h1_bF, h2_bF = _take(h1_GbF, i), _take(h2_GbF, i)
        wg_DF, wu_DF, wd_FD = _take(wg_XDF, g), _take(wu_XDF, g), _take(wd_XFD, g)
        sig_bF = jax.nn.sigmoid(h1_bF)
        silu_bF = h1_bF * sig_bF
        dwdt_XDF = _put(dwdt_XDF, g, _take(dwdt_XDF, g) + _dot32(dyt_Db, silu_bF * h2_bF))
        dh_bF = _dot_wt(dy_bD, wd_FD)
        dh2_bF = dh_bF * silu_bF
        # silu' = sig (1 + h (1 - sig))
        dh1_bF = dh_bF * h2_bF * sig_bF * (1 + h1_bF * (1 - sig_bF))
        dwg_XDF = _put(dwg_XDF, g, _take(dwg_XDF, g) + _dot32(xt_Db, dh1_bF))
        dwu_XDF = _put(dwu_XDF, g, _take(dwu_XDF, g) + _dot32(xt_Db, dh2_bF))
        dx_bD = _dot_wt(dh1_bF, wg_DF) + _dot_wt(dh2_bF, wu_DF)
        return _put(dx_GbD, i, dx_bD), dwg_XDF, dwu_XDF, dwdt_XDF

    init = (
        _zeros(xb_GbD.shape, xb_GbD.dtype, *like),
        *(_zeros(w.shape, jnp.float32, *like) for w in (wg_XDF, wu_XDF, wg_XDF)),
    )
    dx_GbD, dwg_XDF, dwu_XDF, dwdt_XDF = lax.fori_loop(0, used, body, init)
    return (
        dx_GbD,
        None,
        None,
        dwg_XDF.astype(wg_XDF.dtype),
        dwu_XDF.astype(wu_XDF.dtype),
        jnp.swapaxes(dwdt_XDF, 1, 2).astype(wd_XFD.dtype),
    )


blocked_ffn.defvjp(_blocked_fwd, _blocked_bwd)
