"""One device's share of a Mixture-of-Experts layer: its tokens' assignments sorted by expert,
exchanged over the expert axis (fixed-size all_to_all buffers, or ragged all-to-all moving only the
real rows), the local experts' grouped matmuls, and the rows sent back and combined. models/moe.py
runs it inside shard_map. Shape letters as in models/moe.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from models.config import ModelConfig
from models.moe_comm import exchange as exchange_rows
from models.moe_comm import gather_weight, reduce_dtype
from models.moe_kernels import (
    batched_like,
    block_size,
    einsum_slots,
    gmm_blocks,
    gmm_ragged,
    gmm_sorted,
    rank_in_group,
    varying_axes,
)


def _vary_like(w, like, vmapped: bool):
    """`w` made to vary over the shard_map axes `like` varies over, in its own dtype: the
    transpose of that cast to varying, the sum of w's gradient over those axes, then runs in w's
    dtype (reduce_dtype on CPU), not in the compute dtype. Under vmap the varying axes are not
    tracked and shard_map sums the gradient of its input itself, in the input's dtype."""
    if vmapped:
        return w
    missing = tuple(set(varying_axes(like)) - set(varying_axes(w)))
    return lax.pcast(w, missing, to="varying") if missing else w


def exchange_for(cfg: ModelConfig, platform: str | None = None) -> str:
    """How dropless dispatch moves rows over the expert axis on `platform` (None: this process's
    backend): "fixed" (worst-case buffers, plain all_to_all), "ragged" (lax.ragged_all_to_all: only
    the real rows) or "emulated" (the ragged algorithm with `ragged_all_to_all_emulated`: XLA:CPU
    cannot compile ragged-all-to-all, so ep_exchange=ragged on CPU is a test path, not a faster
    one)."""
    cpu = (platform or jax.default_backend()) == "cpu"
    if cfg.ep_exchange == "auto":
        return "fixed" if cpu else "ragged"
    return "emulated" if cfg.ep_exchange == "ragged" and cpu else cfg.ep_exchange


def ragged_all_to_all_emulated(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
    axis_index_groups=None,
):
    """`lax.ragged_all_to_all` (same arguments, same result) from a fixed-size all_to_all: each of
    the K slices travels in a buffer as long as `operand`, K x the bytes of the real thing."""
    if axis_index_groups is not None:
        raise NotImplementedError("ragged_all_to_all_emulated: axis_index_groups")
    m = operand.shape[0]
    j_M = jnp.arange(m)
    src_KM = jnp.where(j_M < send_sizes[:, None], input_offsets[:, None] + j_M, m)
    buf_KM = operand.at[src_KM].get(mode="fill", fill_value=0)
    # slice i of the K goes to device i // (K / n); a device receives its slices source by source
    buf_KM = lax.all_to_all(buf_KM, axis_name, 0, 0, tiled=True)
    at_K = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst_KM = jnp.where(j_M < recv_sizes[:, None], at_K[:, None] + j_M, output.shape[0])
    return output.at[dst_KM].set(buf_KM, mode="drop")


def _excl_cumsum(c, axis):
    return jnp.cumsum(c, axis) - c


def _ragged_dispatch(
    x_UD, e_A, tok_A, ffn, *, rows: int, x_count: int, ep: int, ep_axes, exchange: str
):
    """Dropless expert parallelism that moves only the real rows: assignments sorted by global
    expert id, one ragged slice per (destination, local expert), so each receiver's buffer comes
    out sorted by its local expert with no further sort. Every device learns every device's counts
    (an all-gather of E ints) and so can compute all offsets of both exchanges itself.
    `ffn(x_RD, sizes_X)`: the grouped matmul on rows sorted by local expert -> y [A,D], sorted
    back to assignment order. `rows`: the static receive buffer (worst case: never overflows)."""
    a2a = lax.ragged_all_to_all if exchange == "ragged" else ragged_all_to_all_emulated
    a, d = e_A.shape[0], x_UD.shape[1]
    order_A = jnp.argsort(e_A, stable=True)
    counts_E = jnp.zeros((ep * x_count,), jnp.int32).at[e_A].add(1)
    counts_SE = lax.all_gather(counts_E, ep_axes)  # [source, E]
    counts_SDX = counts_SE.reshape(ep, ep, x_count)  # [source, destination, local expert]
    me = lax.axis_index(ep_axes)
    start_DX = _excl_cumsum(counts_SDX.sum(0), 1)  # each receiver's expert groups
    at_SDX = start_DX[None] + _excl_cumsum(counts_SDX, 0)  # where source s's rows land
    from_SE = _excl_cumsum(counts_SE, 1)  # where each source's rows start

    def vary(z):  # buffers differ per device
        return lax.pcast(z, tuple(ep_axes), to="varying")

    def flat(c):
        return c.reshape(-1).astype(jnp.int32)

    recv_SX = counts_SDX[:, me]
    x_RD = a2a(
        x_UD[tok_A[order_A]],
        vary(jnp.zeros((rows, d), x_UD.dtype)),
        flat(from_SE[me]),
        flat(counts_E),
        flat(at_SDX[me]),
        flat(recv_SX),
        axis_name=ep_axes,
    )
    y_RD = ffn(x_RD, recv_SX.sum(0))
    # back along the same slices, reversed
    ys_AD = a2a(
        y_RD,
        vary(jnp.zeros((a, d), y_RD.dtype)),
        flat(at_SDX[:, me]),
        flat(recv_SX),
        flat(lax.dynamic_slice_in_dim(from_SE, me * x_count, x_count, axis=1)),
        flat(counts_E),
        axis_name=ep_axes,
    )
    return jnp.zeros_like(ys_AD).at[order_A].set(ys_AD)


def dispatch_local(
    x_BTD,
    idx_BTJ,
    gate_BTJ,
    wg_XDF,
    wu_XDF,
    wd_XFD,
    *,
    n_experts: int,
    mode: str,
    capacity_factor: float,
    kernel: str,
    exchange: str = "fixed",
    vmapped: bool = False,
    dtype=None,
    ep_axes=(),
    ep: int = 1,
    embed_axes=(),
    tp_axes=(),
    token_axes=(),
):
    """One device's share of the MoE layer: its tokens in, their expert outputs out (-> y [B,T,D],
    dropped assignments). With ep > 1 this runs inside shard_map and the rows travel by all-to-all
    over `ep_axes` (dropless: `exchange`, see `exchange_for`); weights arrive sharded over
    `embed_axes` (FSDP: gathered here) and `tp_axes` (tensor parallel inside each expert: the
    partial outputs are summed at the end)."""
    # One function on purpose (~110 lines): it is the body shard_map runs on each device, and its
    # stages (sort by expert, exchange, expert FFN, return, un-sort) share the sort permutation
    # and the counts; pieces would pass those between them without making any clearer.
    b, t, d = x_BTD.shape
    k = idx_BTJ.shape[-1]
    n = b * t
    # the inputs may arrive in reduce_dtype (models/moe.py): computed in `dtype`
    dtype = dtype or x_BTD.dtype
    x_BTD, gate_BTJ = x_BTD.astype(dtype), gate_BTJ.astype(dtype)
    # the weights too, cast to the compute dtype on the shard and then gathered over FSDP
    wg_XDF, wu_XDF, wd_XFD = (_vary_like(w, x_BTD, vmapped) for w in (wg_XDF, wu_XDF, wd_XFD))
    if embed_axes:
        wg_XDF, wu_XDF = (gather_weight(w, embed_axes, 1, dtype) for w in (wg_XDF, wu_XDF))
        wd_XFD = gather_weight(wd_XFD, embed_axes, 2, dtype)
    wg_XDF, wu_XDF, wd_XFD = (w.astype(dtype) for w in (wg_XDF, wu_XDF, wd_XFD))
    x_count = wg_XDF.shape[0]
    x_UD = x_BTD.reshape(n, d)
    if tp_axes:  # varying once here: the backward sums one [U,D] gradient over tp_axes, not one per
        # matmul over the whole padded buffer; that sum in reduce_dtype
        x_UD = lax.pcast(x_UD.astype(reduce_dtype(x_UD.dtype)), tuple(tp_axes), to="varying")
        x_UD = x_UD.astype(x_BTD.dtype)
    # assignments in priority order: every token's first choice before any second choice (Switch)
    e_A = idx_BTJ.reshape(n, k).T.reshape(-1)
    tok_A = jnp.tile(jnp.arange(n), k)
    gate_A = gate_BTJ.reshape(n, k).T.reshape(-1)
    dest_A = e_A // x_count
    # the CPU kernel's block and einsum slots for this device's expected rows (models/moe_kernels);
    # no slots under vmap, where the choice between them and the blocks would run both
    grouping = (block_size(n * k, x_count), 0 if vmapped else einsum_slots(n * k, x_count))
    if mode == "dropless" and ep > 1 and exchange != "fixed":
        rows = ep * n * min(k, x_count)  # what a device receives if every token picks its experts
        ws = (wg_XDF, wu_XDF, wd_XFD)

        def ffn(x_RD, sizes_X):
            if kernel == "ragged":
                return gmm_sorted(x_RD, sizes_X, *(batched_like(x_RD, *ws) if vmapped else ws))
            # a row past every group's end gets group X: padding
            group_R = jnp.sum(jnp.arange(rows)[:, None] >= jnp.cumsum(sizes_X)[None], axis=1)
            return gmm_blocks(x_RD, group_R, *ws, *grouping)

        y_AD = _ragged_dispatch(
            x_UD,
            e_A,
            tok_A,
            ffn,
            rows=rows,
            x_count=x_count,
            ep=ep,
            ep_axes=ep_axes,
            exchange=exchange,
        )
        return _combine(y_AD.reshape(k, n, d), gate_A, tp_axes).reshape(b, t, d), jnp.float32(0.0)
    if mode == "capacity":
        cap = max(1, math.ceil(capacity_factor * n * k / n_experts))
        rank_A, _ = rank_in_group(e_A, n_experts)
        keep_A = rank_A < cap
        slot_A = jnp.where(keep_A, e_A * cap + rank_A, n_experts * cap)  # rows per device: X * cap
        per_dest = x_count * cap
        dropped = jnp.sum(~keep_A).astype(jnp.float32)
    else:
        # a token sends at most min(J, X) rows to one device: buffers that size never overflow
        per_dest = n * min(k, x_count) if ep > 1 else n * k
        rank_A, _ = rank_in_group(dest_A, ep)
        slot_A = dest_A * per_dest + rank_A
        dropped = jnp.float32(0.0)
    rows = ep * per_dest
    send_RD = jnp.zeros((rows, d), x_UD.dtype).at[slot_A].set(x_UD[tok_A], mode="drop")
    if mode == "capacity":
        if ep > 1:
            send_RD = exchange_rows(send_RD, ep_axes)  # -> [source, X, cap]
        x_XRD = (
            send_RD.reshape(ep, x_count, cap, d).transpose(1, 0, 2, 3).reshape(x_count, ep * cap, d)
        )
        y_XRD = jnp.einsum(
            "xrf,xfd->xrd",
            jax.nn.silu(jnp.einsum("xrd,xdf->xrf", x_XRD, wg_XDF))
            * jnp.einsum("xrd,xdf->xrf", x_XRD, wu_XDF),
            wd_XFD,
        )
        y_RD = y_XRD.reshape(x_count, ep, cap, d).transpose(1, 0, 2, 3).reshape(rows, d)
    else:
        group_R = jnp.full((rows,), x_count, jnp.int32).at[slot_A].set(e_A % x_count, mode="drop")
        if ep > 1:
            send_RD, group_R = exchange_rows(send_RD, ep_axes, group_R)
        if kernel == "ragged":
            ws = (wg_XDF, wu_XDF, wd_XFD)
            y_RD = gmm_ragged(send_RD, group_R, *(batched_like(send_RD, *ws) if vmapped else ws))
        else:
            y_RD = gmm_blocks(send_RD, group_R, wg_XDF, wu_XDF, wd_XFD, *grouping)
    if ep > 1:
        y_RD = exchange_rows(y_RD, ep_axes)
    y_JUD = y_RD.at[slot_A].get(mode="fill", fill_value=0).reshape(k, n, d)  # dropped rows: 0
    if token_axes:
        dropped = lax.psum(dropped, token_axes)
    return _combine(y_JUD, gate_A, tp_axes).reshape(b, t, d), dropped


def _combine(y_JUD, gate_A, tp_axes):
    """Each token's expert outputs weighted by its gates -> [U,D], summed over tensor-parallel
    shards."""
    k, n, _ = y_JUD.shape
    if not tp_axes:
        return jnp.einsum("jud,ju->ud", y_JUD, gate_A.reshape(k, n).astype(y_JUD.dtype))
    # the gates vary over tp_axes here, so that their gradient's sum over them runs in reduce_dtype
    gate_A = lax.pcast(gate_A.astype(reduce_dtype(gate_A.dtype)), tuple(tp_axes), to="varying")
    y_UD = jnp.einsum("jud,ju->ud", y_JUD, gate_A.reshape(k, n).astype(y_JUD.dtype))
    return lax.psum(y_UD.astype(reduce_dtype(y_UD.dtype)), tp_axes).astype(y_UD.dtype)
