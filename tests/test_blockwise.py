"""models/blockwise.py against a dense reference written here (the [B, N, T, S] mask from the
same visibility rule, a masked softmax, einsums): outputs, log-sum-exp and the gradients w.r.t. q,
k and v, for causal, packed, grouped-query, windowed, odd-sized, permuted and foreign-key cases;
queries that see no key; the merge of two key blocks that ring attention does; and memory that
grows linearly with the sequence where the dense reference's grows quadratically.

Compilation is most of this file's time, so the cases share shapes: positions, segment ids and
cotangents are arguments of one jitted program per shape, never constants baked into it."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.blockwise import NO_KEYS_LSE, blockwise_attention
from plan.hlo import parse_collectives

B, N, H = 2, 4, 8
T = 20  # the shared shape: T = S = 20 keys in blocks of 8, so the last block is padded
TOL = dict(rtol=1e-5, atol=1e-5)


def dense_attention(
    q_BTNH, k_BSKH, v_BSKH, q_pos_BT, k_pos_BS, q_seg_BT=None, k_seg_BS=None, *, window=None
):
    """(out_BTNH, lse_BTN) with the whole [B, N, T, S] score matrix; a query that sees no key
    gets out 0 and lse NO_KEYS_LSE, as the blockwise kernel documents."""
    groups = q_BTNH.shape[2] // k_BSKH.shape[2]
    k_BSNH, v_BSNH = jnp.repeat(k_BSKH, groups, axis=2), jnp.repeat(v_BSKH, groups, axis=2)
    s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH) / math.sqrt(q_BTNH.shape[-1])
    q_pos, k_pos = q_pos_BT[:, None, :, None], k_pos_BS[:, None, None, :]
    mask_B1TS = k_pos <= q_pos
    if q_seg_BT is not None:
        mask_B1TS &= q_seg_BT[:, None, :, None] == k_seg_BS[:, None, None, :]
    if window is not None:
        mask_B1TS &= q_pos - k_pos < window
    # a finite fill keeps a row with no visible key free of NaN; its p is then zeroed by `any`
    s_BNTS = jnp.where(mask_B1TS, s_BNTS, -1e30)
    any_B1T = mask_B1TS.any(-1)
    p_BNTS = jax.nn.softmax(s_BNTS, axis=-1) * any_B1T[..., None]
    lse_BNT = jnp.where(any_B1T, jax.nn.logsumexp(s_BNTS, axis=-1), NO_KEYS_LSE)
    out_BTNH = jnp.einsum("bnts,bsnh->btnh", p_BNTS, v_BSNH)
    return out_BTNH, jnp.moveaxis(lse_BNT, 1, 2)


def _blockwise(*args, window, block_k):
    return blockwise_attention(*args, window=window, block_k=block_k, return_lse=True)


def _dense(*args, window, block_k):
    return dense_attention(*args, window=window)


@functools.partial(jax.jit, static_argnames=("attend", "window", "block_k"))
def value_and_grads(q, k, v, pos_seg, out_ct, lse_ct, *, attend, window=None, block_k=8):
    """(out, lse) and the gradients w.r.t. q, k, v of sum(out * out_ct) + sum(lse * lse_ct)."""

    def loss(q, k, v):
        out, lse = attend(q, k, v, *pos_seg, window=window, block_k=block_k)
        return jnp.sum(out * out_ct) + jnp.sum(lse * lse_ct), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, lse, grads


def inputs(t, s, kv_heads=2, seed=0):
    """q, k, v and the cotangents of out and lse, as plain arrays (no per-shape random programs)."""
    rng = np.random.default_rng(seed)
    q, out_ct = (rng.standard_normal((B, t, N, H), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, s, kv_heads, H), np.float32) for _ in range(2))
    return (q, k, v), out_ct, rng.standard_normal((B, t, N), np.float32)


def batch(x_T):
    return np.broadcast_to(np.asarray(x_T, np.int32), (B, len(x_T)))


def check(
    q_pos_T, k_pos_T, seg_q_T=None, seg_k_T=None, *, kv_heads=2, window=None, block_k=8, lse_ct=True
):
    """The blockwise kernel equals the dense reference in out, lse and gradients (of out alone
    when not `lse_ct`); returns the blockwise (out, lse, (dq, dk, dv)) for further checks.
    Absent segment ids are all 0: every case of one shape runs the same two programs."""
    (q, k, v), out_ct, lse_ct_BTN = inputs(len(q_pos_T), len(k_pos_T), kv_heads)
    seg_q_T = np.zeros(len(q_pos_T)) if seg_q_T is None else seg_q_T
    seg_k_T = np.zeros(len(k_pos_T)) if seg_k_T is None else seg_k_T
    pos_seg = tuple(batch(x) for x in (q_pos_T, k_pos_T, seg_q_T, seg_k_T))
    args = (q, k, v, pos_seg, out_ct, lse_ct_BTN if lse_ct else np.zeros_like(lse_ct_BTN))
    got = value_and_grads(*args, attend=_blockwise, window=window, block_k=block_k)
    want = value_and_grads(*args, attend=_dense, window=window)
    assert_same(got, want)
    return got


def assert_same(got, want):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got[:2] + got[2], want[:2] + want[2]):
        np.testing.assert_allclose(g, w, **TOL, err_msg=name)


def zigzag(t: int, shards: int):
    """The positions 0..t-1 laid out for `shards` devices that each hold chunk r and chunk 2R-1-r
    (the causal load-balancing layout), concatenated in device order."""
    chunks = np.split(np.arange(t), 2 * shards)
    return np.concatenate(
        [np.concatenate([chunks[r], chunks[2 * shards - 1 - r]]) for r in range(shards)]
    )


def test_causal_over_several_blocks():
    """Three key blocks, the last one padded; the loss is of out alone."""
    check(range(T), range(T), lse_ct=False)


def test_packed_segments():
    seg_T = [0] * 3 + [1] * 7 + [2] * 4 + [3] * 6  # four documents of odd lengths
    pos_T = np.concatenate([np.arange(3), np.arange(7), np.arange(4), np.arange(6)])
    check(pos_T, pos_T, seg_T, seg_T)


def test_zigzag_permuted_positions():
    check(zigzag(T, 2), zigzag(T, 2))


def test_keys_from_another_range():
    """One ring step: queries at 20..39 and keys at 10..29, partly in their past, partly in their
    future; then device 0's zigzag queries against device 1's keys."""
    check(range(20, 40), range(10, 30))
    layout = zigzag(2 * T, 2)
    check(layout[:T], layout[T:])


def test_queries_that_see_no_key():
    """Keys at 10..29 for queries at 0..19: the first 10 queries see none. out 0, lse NO_KEYS_LSE,
    no NaN anywhere, zero dq for those rows; with every key in the future, every gradient is 0."""
    out, lse, (dq, dk, dv) = check(range(T), range(10, 30))
    assert np.all(np.asarray(out[:, :10]) == 0) and np.all(np.asarray(lse[:, :10]) == NO_KEYS_LSE)
    assert np.all(np.asarray(dq[:, :10]) == 0) and np.any(np.asarray(dq[:, 10:]) != 0)
    assert all(np.isfinite(np.asarray(x)).all() for x in (out, lse, dq, dk, dv))
    out, lse, grads = check(range(T), range(T, 2 * T))
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == NO_KEYS_LSE)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


def test_grouped_query_heads_with_a_window():
    """One kv head for all four query heads (two kv heads: every other case), a window of 5 keys,
    in order and permuted."""
    check(range(T), range(T), kv_heads=1, window=5)
    check(zigzag(T, 2), zigzag(T, 2), kv_heads=1, window=5)


def test_one_block_larger_than_the_keys():
    """12 queries over 20 keys (S != T) in one block of 32."""
    check(range(8, 20), range(T), block_k=32)


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two key sets from each set's (out, lse): what a ring does."""
    lse = jnp.logaddexp(lse_a, lse_b)
    return out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None], lse


def _ring(q, k, v, q_pos, k_pos, q_seg, k_seg, *, window, block_k):
    """Two key blocks (the first and second half of the keys), each attended blockwise, merged."""
    s = k.shape[1] // 2
    halves = (slice(0, s), slice(s, None))
    parts = [
        blockwise_attention(
            q,
            k[:, h],
            v[:, h],
            q_pos,
            k_pos[:, h],
            q_seg,
            k_seg[:, h],
            window=window,
            block_k=block_k,
            return_lse=True,
        )
        for h in halves
    ]
    return merge(*parts[0], *parts[1])


def test_two_key_blocks_merged_equal_attention_over_all():
    """All zigzag queries over the keys as two blocks (device 0's and device 1's) merged by their
    lse: the queries at 0..4 see no key of device 1's block (its lse is NO_KEYS_LSE there), yet
    the merged out, lse and gradients equal the dense reference's over all keys."""
    (q, k, v), out_ct, lse_ct = inputs(T, T)
    zeros = np.zeros(T)
    pos_seg = tuple(batch(x) for x in (zigzag(T, 2), zigzag(T, 2), zeros, zeros))
    got = value_and_grads(q, k, v, pos_seg, out_ct, lse_ct, attend=_ring)
    assert_same(got, value_and_grads(q, k, v, pos_seg, out_ct, lse_ct, attend=_dense))


def test_bfloat16_inputs_accumulate_in_float32():
    """bfloat16 in and out (lse float32), close to the float32 reference; the loss is of out alone
    (return_lse=False)."""
    (q, k, v), out_ct, lse_ct = inputs(T, T)
    pos_seg = (batch(range(T)), batch(range(T)), batch(np.zeros(T)), batch(np.zeros(T)))
    q16, k16, v16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))

    def loss(q, k, v):  # no segment ids: the path every other case of this shape leaves out
        out = blockwise_attention(q, k, v, *pos_seg[:2], block_k=8)
        return jnp.sum(out.astype(jnp.float32) * out_ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q16, k16, v16
    )
    assert out.dtype == jnp.bfloat16 and [g.dtype for g in grads] == [jnp.bfloat16] * 3
    # the reference gets the same bfloat16-rounded inputs, in float32
    want = value_and_grads(
        *(np.asarray(x, np.float32) for x in (q16, k16, v16)),
        pos_seg,
        out_ct,
        np.zeros_like(lse_ct),
        attend=_dense,
    )
    # bfloat16 keeps 8 bits of mantissa: a few parts in a thousand of each value's scale
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (want[0], *want[2])):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0.02, atol=0.05, err_msg=name)


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        (dict(kv_heads=3), "multiple of kv heads"),
        (dict(window=0), "window=0"),
        (dict(block_k=0), "block_k=0"),
        (dict(q_seg_BT=batch(range(4))), "segment ids"),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs, culprit):
    (q, k, v), _, _ = inputs(4, 4, kwargs.pop("kv_heads", 2))
    with pytest.raises(ValueError, match=culprit):
        blockwise_attention(q, k, v, batch(range(4)), batch(range(4)), **kwargs)


def test_queries_sharded_over_the_sequence():
    """Queries (and their positions) split over 4 devices along T by GSPMD, keys whole: the
    gradients match the dense reference, and the only collective is the all-reduce that sums the
    key gradients over the query shards (no all-gather of the queries)."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.sharding.Mesh(
        np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "context"), axis_types=auto
    )
    by_seq, whole = (NamedSharding(mesh, P("data", "context")), NamedSharding(mesh, P("data")))
    (q, k, v), out_ct, lse_ct = inputs(T, T)
    zeros = np.zeros(T)
    pos_seg = tuple(batch(x) for x in (zigzag(T, 2), zigzag(T, 2), zeros, zeros))
    # query-side arrays [B, T, ...] split along T, key-side ones whole
    args = (
        jax.device_put(q, by_seq),
        jax.device_put(k, whole),
        jax.device_put(v, whole),
        jax.device_put(pos_seg, (by_seq, whole, by_seq, whole)),
        jax.device_put(out_ct, by_seq),
        jax.device_put(lse_ct, by_seq),
    )
    compiled = value_and_grads.lower(*args, attend=_blockwise).compile()
    got = compiled(*args)
    assert_same(got, value_and_grads(q, k, v, pos_seg, out_ct, lse_ct, attend=_dense))
    assert got[2][0].sharding.spec[:2] == ("data", "context")
    assert {c.kind for c in parse_collectives(compiled.as_text(), mesh)} == {"all-reduce"}


def _grad_temp_bytes(attend, t: int) -> int:
    """Temporary memory of the compiled gradient of attention over t queries and t keys. The
    positions are an argument, not a constant XLA would fold into a [T, S] mask at compile time."""
    q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, t), jnp.int32)
    grad = jax.jit(
        jax.grad(lambda q, k, v, pos: jnp.sum(attend(q, k, v, pos, pos)[0]), argnums=(0, 1, 2))
    )
    return grad.lower(q, q, q, pos).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_with_the_sequence():
    """Doubling T = S: the blockwise gradient's temporaries at most ~double, the dense ones ~4x.
    Compiled only, never run."""
    sizes = {
        name: [_grad_temp_bytes(f, t) for t in (2048, 4096)]
        for name, f in (
            ("blockwise", functools.partial(blockwise_attention, block_k=512, return_lse=True)),
            ("dense", dense_attention),
        )
    }
    assert sizes["blockwise"][1] / sizes["blockwise"][0] < 2.5, sizes
    assert sizes["dense"][1] / sizes["dense"][0] > 3, sizes
    # and less than one [N, T, S] float32 score matrix at T = S = 4096
    assert sizes["blockwise"][1] < 2 * 4096 * 4096 * 4, sizes
