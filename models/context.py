"""Attention where the sequence is sharded: the `context` mesh axis, and attention masked by
positions (blockwise or dense) wherever the index order is not the causal order.

Context parallelism: the rule table maps every activation's `seq` dim to `context`, so each of
its n devices holds T/n tokens through the embedding, norms, MLPs and the loss; only attention
needs keys beyond its own tokens. Two strategies bring them:
  all_gather  K and V (and their positions and segment ids) gathered over `context` by a
              sharding constraint, each device attends its queries to all keys (MaxText's default);
              (n-1)/n x the K/V bytes per layer, the whole K/V held for the layer's duration.
  ring        a ring of n-1 collective-permutes of K/V blocks inside shard_map; each step attends
              the local queries to the block in hand and merges it with an online softmax (the
              log-sum-exp of each block), and the next block's transfer overlaps this block's
              compute (Ring Attention, Liu et al. 2023). The forward holds two blocks at a time;
              autodiff keeps each hop's block for the backward (the layer's whole K/V, as
              all_gather; under `full` remat only while that layer's backward runs).

Layout ("zigzag"): causal attention gives late tokens more work than early ones, so the sequence
is cut into 2n chunks and device i holds chunks i and 2n-1-i: an early and a late one. The train
step permutes every [B,T] array of the batch (tokens, targets, weights, positions, segment ids)
into that order once (`to_layout`), so the model and the loss never see another order; the loss is
a sum over tokens, unchanged by the permutation. Masks therefore come from positions: a query at
position p sees keys at positions <= p of its own segment (and within the window).

Letters: B batch, T queries, S keys, N query heads, K KV heads, H head dim, n context devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.rules import current_rules, logical_to_spec
from mesh.shard import constrain, entry_axes
from models import dense_attention
from models.blockwise import NO_KEYS_LSE, blockwise_attention, visible
from models.config import CONTEXT_STRATEGIES
from models.softcap import softcap as cap_scores

_STRATEGY: contextvars.ContextVar[str] = contextvars.ContextVar(
    "context_strategy", default="all_gather"
)


@contextlib.contextmanager
def strategy(name: str):
    """Make `name` (one of CONTEXT_STRATEGIES) the context-parallel strategy while tracing."""
    if name not in CONTEXT_STRATEGIES:
        raise UserError(
            f"--parallelism.context_strategy '{name}': valid: {', '.join(CONTEXT_STRATEGIES)}"
        )
    token = _STRATEGY.set(name)
    try:
        yield
    finally:
        _STRATEGY.reset(token)


def context_axes() -> tuple[str, ...]:
    """The mesh axes of size > 1 that shard the sequence (the `seq` rule) on the mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in current_rules()["seq"] if mesh.shape.get(a, 1) > 1)


def context_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in context_axes())


def by_positions(kind: str) -> str:
    """The attention that runs where masks come from positions (a sharded, permuted sequence, or
    blockwise asked for): dense stays dense; no fused kernel takes such a mask, so the rest is
    blockwise."""
    return "dense" if kind == "dense" else "blockwise"


def describe(kind: str, n: int, strategy: str) -> str:
    """The start line's account of the attention a run does:
    `attention blockwise, context ring x 4`."""
    names = {"jax": "auto (cuDNN where it can, else XLA)"}
    return f"attention {names.get(kind, kind)}" + (f", context {strategy} x {n}" if n > 1 else "")


# ------------------------------------------------------------------ the zigzag layout


def zigzag(t: int, n: int) -> np.ndarray:
    """The order of T token indices such that shard i of n (contiguous blocks of T/n) holds chunks
    i and 2n-1-i of 2n equal chunks. zigzag(8, 2) = [0 1 6 7 2 3 4 5]."""
    if n == 1:
        return np.arange(t)
    if t % (2 * n):
        raise UserError(
            f"--seq-len {t}: context parallelism over {n} devices cuts the sequence into {2 * n}"
            f" chunks; use a multiple of {2 * n}"
        )
    chunks = np.arange(t).reshape(2 * n, t // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def to_layout(batch: dict, n: int, positions_of) -> dict:
    """The batch with every [B,T] array permuted into the zigzag order of n shards, and positions
    made explicit first (`positions_of(segment_ids or None, shape)`: the model's own default), since
    masks are computed from them once the index order is gone. n = 1: the batch unchanged."""
    if n == 1:
        return batch
    tokens_BT = batch["inputs"]
    if batch.get("positions") is None:
        batch = {**batch, "positions": positions_of(batch.get("segment_ids"), tokens_BT.shape)}
    order_T = jnp.asarray(zigzag(tokens_BT.shape[1], n))
    return {
        k: jnp.take(v, order_T, axis=1)
        if getattr(v, "ndim", 0) == 2 and v.shape == tokens_BT.shape
        else v
        for k, v in batch.items()
    }


# ------------------------------------------------------------------ attention by positions


def local_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    q_pos_BT,
    k_pos_BS,
    q_seg_BT,
    k_seg_BS,
    *,
    window: int,
    kind: str,
    return_lse: bool = False,
    softcap: float = 0.0,
):
    """Attention of these queries to these keys, masked by positions: `kind` blockwise (memory
    linear in S) or dense (a [B,1,T,S] mask; models/dense_attention.py, or scores of our own where
    they are soft-capped by `softcap`, models/softcap.py)."""
    if kind == "blockwise":
        return blockwise_attention(
            q_BTNH,
            k_BSKH,
            v_BSKH,
            q_pos_BT,
            k_pos_BS,
            q_seg_BT,
            k_seg_BS,
            window=window or None,
            return_lse=return_lse,
            softcap=softcap,
        )
    seg = (
        (None, None)
        if q_seg_BT is None
        else (q_seg_BT[:, None, :, None], k_seg_BS[:, None, None, :])
    )
    mask_B1TS = visible(q_pos_BT[:, None, :, None], k_pos_BS[:, None, None, :], *seg, window)
    if softcap and not return_lse:
        return _dense_with_lse(q_BTNH, k_BSKH, v_BSKH, mask_B1TS, softcap)[0]
    if not return_lse:
        return dense_attention.attend(q_BTNH, k_BSKH, v_BSKH, mask_B1TS[:, 0])
    return _dense_with_lse(q_BTNH, k_BSKH, v_BSKH, mask_B1TS, softcap)


def _dense_with_lse(q_BTNH, k_BSKH, v_BSKH, mask_B1TS, softcap: float = 0.0):
    """Dense masked attention that also returns the log-sum-exp of each query's visible scores
    ([B,T,N] float32; NO_KEYS_LSE where none is visible, and then an output of 0): a ring step's
    result. The scaled scores are soft-capped by `softcap` (0: none)."""
    b, t, n, h = q_BTNH.shape
    k = k_BSKH.shape[2]
    q_BTKQH = q_BTNH.reshape(b, t, k, n // k, h).astype(jnp.float32) / math.sqrt(h)
    s_BKQTS = cap_scores(
        jnp.einsum("btkqh,bskh->bkqts", q_BTKQH, k_BSKH.astype(jnp.float32)), softcap
    )
    mask_B11TS = mask_B1TS[:, :, None]
    # hidden scores at NO_KEYS_LSE, not -inf: a row with nothing visible stays finite in both passes
    lse_BKQT = jax.nn.logsumexp(jnp.where(mask_B11TS, s_BKQTS, NO_KEYS_LSE), axis=-1)
    lse_BKQT = jnp.where(jnp.any(mask_B11TS, axis=-1), lse_BKQT, NO_KEYS_LSE)
    # no inf x 0 in the vjp
    p_BKQTS = jnp.exp(jnp.where(mask_B11TS, s_BKQTS - lse_BKQT[..., None], -jnp.inf))
    out_BTKQH = jnp.einsum("bkqts,bskh->btkqh", p_BKQTS, v_BSKH.astype(jnp.float32))
    return (
        out_BTKQH.reshape(b, t, n, h).astype(q_BTNH.dtype),
        jnp.transpose(lse_BKQT, (0, 3, 1, 2)).reshape(b, t, n),
    )


def merge(out_a, lse_a, out_b, lse_b):
    """Two attention results over disjoint key sets -> the result over their union (online softmax).
    A side with no visible key (lse NO_KEYS_LSE) gets weight 0; both empty: output 0."""
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
    out = out_a.astype(jnp.float32) * w_a + out_b.astype(jnp.float32) * w_b
    return out, lse


def attend(
    q_BTNH,
    k_BTKH,
    v_BTKH,
    positions_BT,
    segment_ids_BT,
    *,
    window: int,
    kind: str,
    softcap: float = 0.0,
):
    """Causal attention masked by positions, on whatever mesh is in context: with the sequence
    sharded (context > 1), by the strategy in context (`strategy`); else on the local sequence.
    `softcap`: the scores soft-capped (models/softcap.py)."""
    n = context_size()
    if n > 1 and _STRATEGY.get() == "ring":
        return _ring(
            q_BTNH,
            k_BTKH,
            v_BTKH,
            positions_BT,
            segment_ids_BT,
            window=window,
            kind=kind,
            softcap=softcap,
        )
    if n > 1:  # all_gather: the keys' sequence dim replicated, which XLA turns into an all-gather
        kv = ("batch", None, "act_kv_heads", None)
        k_BTKH, v_BTKH = constrain(k_BTKH, kv), constrain(v_BTKH, kv)
    k_pos_BT = constrain(positions_BT, ("batch", None)) if n > 1 else positions_BT
    k_seg_BT = segment_ids_BT
    if segment_ids_BT is not None and n > 1:
        k_seg_BT = constrain(segment_ids_BT, ("batch", None))
    return local_attention(
        q_BTNH,
        k_BTKH,
        v_BTKH,
        positions_BT,
        k_pos_BT,
        segment_ids_BT,
        k_seg_BT,
        window=window,
        kind=kind,
        softcap=softcap,
    )


def _ring(
    q_BTNH, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, *, window: int, kind: str, softcap: float
):
    """The ring strategy: a shard_map manual over every real mesh axis (as the MoE layer's), each
    device holding its own queries; K/V blocks travel one hop per step, n - 1 hops in all."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = context_axes()
    n = context_size()

    def real(spec):
        """`spec` with the mesh axes of size 1 dropped: shard_map is manual over real axes only."""
        return P(*(tuple(a for a in entry_axes(e) if mesh.shape[a] > 1) or None for e in spec))

    q_spec = real(logical_to_spec(("batch", "seq", "act_heads", None)))
    kv_spec = real(logical_to_spec(("batch", "seq", "act_kv_heads", None)))
    bt_spec = real(logical_to_spec(("batch", "seq")))
    heads, kv_heads = entry_axes(q_spec[2]), entry_axes(kv_spec[2])
    if heads != kv_heads:
        raise UserError(
            "--parallelism.context_strategy ring: the query heads are sharded over"
            f" {heads or 'nothing'} but the KV heads over {kv_heads or 'nothing'}"
            f" (model.n_kv_heads={k_BTKH.shape[2]} must be divisible by the tensor-parallel size);"
            " use all_gather"
        )
    perm = [(i, (i + 1) % n) for i in range(n)]
    has_seg = segment_ids_BT is not None
    attend = functools.partial(
        local_attention, window=window, kind=kind, return_lse=True, softcap=softcap
    )

    def body(q, k, v, q_pos, *seg):
        q_seg = seg[0] if has_seg else None

        def attend_to(kv):
            """This device's queries against one K/V block (k, v, positions[, segment ids])."""
            return attend(q, kv[0], kv[1], q_pos, kv[2], q_seg, kv[3] if has_seg else None)

        local = (k, v, q_pos) + tuple(seg)
        out, lse = attend_to(local)  # the local block: every query sees at least itself

        def send(block):
            """One hop of the ring: each array of the block to the next device."""
            return tuple(jax.lax.ppermute(a, axes, perm) for a in block)

        def hop(carry, _):
            # the next block's permute does not depend on this block's attention: XLA overlaps them
            out, lse, block = carry
            return (*merge(out, lse, *attend_to(block)), send(block)), None

        (out, lse, last), _ = jax.lax.scan(
            hop, (out.astype(jnp.float32), lse, send(local)), None, length=n - 2
        )
        out, _ = merge(out, lse, *attend_to(last))
        return out.astype(q.dtype)

    manual = frozenset(a for a, size in mesh.shape.items() if size > 1)
    args = (q_BTNH, k_BTKH, v_BTKH, positions_BT) + ((segment_ids_BT,) if has_seg else ())
    specs = (q_spec, kv_spec, kv_spec, bt_spec) + ((bt_spec,) if has_seg else ())
    return jax.shard_map(
        body, in_specs=specs, out_specs=q_spec, axis_names=manual, check_vma=False
    )(*args)
