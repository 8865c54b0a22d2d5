"""mesh/collectives.py: quantiser round-trip bounds, top-k, and the compressed all-reduce on 8 fake
devices against psum, with the bytes it really moves read from the compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh.build import make_mesh
from mesh.collectives import BLOCK, QMAX, compressed_psum, dequantize, quantize, topk, topk_size
from plan.hlo import parse_collectives, summarize


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("data=4,model=2")


# one compiled program per call site instead of one per eager op (compiles dominate on 2 cores)
q_rt = jax.jit(
    lambda x, bits: (lambda q, s: (q, s, dequantize(q, s, bits)))(*quantize(x, bits)),
    static_argnums=1,
)


def _x(n, seed=0):
    """Heavy-tailed like gradients: a few large values per block stress the per-block scale.
    numpy, not jax.random: each eager jax.random call compiles a program (seconds on 2 cores)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_round_trip_bound(bits):
    x = _x(8 * BLOCK)
    q, scale_b, back = q_rt(x, bits)
    assert q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert q.shape == (8, BLOCK * bits // 8)  # int4: two values per byte
    assert scale_b.shape == (8,) and scale_b.dtype == jnp.float32
    x, back, scale_b = np.asarray(x), np.asarray(back), np.asarray(scale_b)
    err = np.abs(back - x).reshape(8, BLOCK)
    assert np.max(err / scale_b[:, None]) <= 0.5 + 1e-5  # round to nearest: half a step
    # the block maximum is exactly representable in magnitude (it defines the scale)
    amax = np.max(np.abs(x.reshape(8, BLOCK)), axis=1)
    np.testing.assert_allclose(np.max(np.abs(back.reshape(8, BLOCK)), axis=1), amax, rtol=1e-6)
    np.testing.assert_array_equal((x - back) + back, x)  # residual + sent == input, bit-exact


def test_int4_uses_the_whole_signed_range():
    x = np.tile(np.arange(-7, 8, dtype=np.float32), 18)[:BLOCK]
    np.testing.assert_array_equal(q_rt(x, 4)[2], x)  # integers in [-7, 7] with max 7: exact
    assert QMAX[4] == 7


def test_zero_block_and_topk():
    assert float(np.abs(q_rt(np.zeros(BLOCK, np.float32), 8)[2]).max()) == 0.0
    x = _x(10_000, seed=1)
    vals, idx = jax.jit(topk, static_argnums=(1, 2))(x, 0.01, 1000)
    assert (
        vals.shape == idx.shape == (100,) == (topk_size(10_000, 0.01, 1000),)
        and idx.dtype == jnp.int32
    )
    x, vals, idx = np.asarray(x), np.asarray(vals), np.asarray(idx)
    np.testing.assert_array_equal(vals, x[idx])
    for b in range(10):  # per block: the 10 largest magnitudes, nothing smaller
        xb = np.abs(x[b * 1000 : (b + 1) * 1000])
        chosen = idx[b * 10 : (b + 1) * 10] - b * 1000
        assert set(chosen) == set(np.argsort(-xb)[:10])


_RUNS = {}


def _run(mesh, method, x_RD):
    """compressed_psum over `data` of each device's row; x_RD is [4, 2*D] sharded data x model.
    -> (total, residual, optimized HLO text); one compile per (method, shape), cached."""

    def f(a):
        total, residual = compressed_psum(a[0], "data", method, fraction=0.05)
        return total, residual[None]

    xs = jax.device_put(x_RD, NamedSharding(mesh, P("data", "model")))
    key = (method, x_RD.shape)
    if key not in _RUNS:
        _RUNS[key] = (
            jax.jit(
                jax.shard_map(
                    f,
                    mesh=mesh,
                    in_specs=P("data", "model"),
                    out_specs=(P("model"), P("data", "model")),
                )
            )
            .lower(xs)
            .compile()
        )
    total, residual = _RUNS[key](xs)
    return total, residual, _RUNS[key].as_text()


@pytest.mark.parametrize("method,bits", [("int8", 8), ("int4", 4)])
def test_quantized_psum_close_to_psum(mesh, method, bits):
    D = 3 * BLOCK + 17  # per model shard; not a multiple of the block
    x = np.stack([_x(2 * D, seed=r) for r in range(4)])
    total, residual = map(np.asarray, _run(mesh, method, x)[:2])
    exact = x.sum(0)
    # per element: 4 first-phase roundings (each <= half a step of that device's block) and one of
    # the re-quantised sum; a step is at most max|x| / qmax of the whole array
    step_in = float(np.abs(x).max()) / QMAX[bits]
    step_sum = float(np.abs(exact).max() + 4 * step_in / 2) / QMAX[bits]
    bound = 4 * step_in / 2 + step_sum / 2
    err = float(np.abs(total - exact).max())
    assert err <= bound * (1 + 1e-5)
    assert err > 0  # it did compress
    # what was not delivered is in the residuals: sum(residual) + total == sum(x) to f32 rounding
    np.testing.assert_allclose(
        total + residual.sum(0), exact, atol=1e-5 * float(np.abs(x).max()) * 4
    )


def test_topk_psum_exact_on_what_it_sends(mesh):
    D = 2000
    x = np.stack([_x(2 * D, seed=10 + r) for r in range(4)])
    total, residual = map(np.asarray, _run(mesh, "topk", x)[:2])
    sent = x - residual  # each device's selection, exactly
    assert int((residual == 0).sum()) == 4 * 2 * topk_size(D, 0.05)  # per device and model shard
    np.testing.assert_allclose(total, sent.sum(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(total + residual.sum(0), x.sum(0), rtol=1e-6, atol=1e-6)


def test_compressed_bytes_in_hlo(mesh):
    """The buffers on the wire really shrink: int8 >= 3.5x, int4 >= 7x fewer bytes than psum; top-k
    gathers (n-1) k (4 + 4) bytes against 2 (n-1)/n 4 D: 1 / (n fraction) = 5x at 5% on 4
    replicas."""
    D = 16 * BLOCK
    x = np.stack([_x(2 * D, seed=r) for r in range(4)])
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    psum = jax.jit(
        jax.shard_map(
            lambda a: lax.psum(a[0], "data"),
            mesh=mesh,
            in_specs=P("data", "model"),
            out_specs=P("model"),
        )
    )
    # compiled, never run
    f32 = summarize(parse_collectives(psum.lower(xs).compile().as_text(), mesh))
    f32_wire = sum(v["wire_bytes"] for v in f32.values())
    assert f32_wire == 2 * 3 / 4 * 4 * D
    for method, ratio in (("int8", 3.5), ("int4", 7.0), ("topk", 4.9)):
        s = summarize(parse_collectives(_run(mesh, method, x)[2], mesh))
        wire = sum(v["wire_bytes"] for v in s.values())
        assert s["all-reduce"]["count"] == 0
        assert set(s["all-gather"]["by_axes"]) == {"data"}
        assert f32_wire / wire >= ratio, (method, f32_wire / wire)
    s8 = summarize(parse_collectives(_run(mesh, "int8", x)[2], mesh))
    # all-to-all of D int8 values + D/BLOCK float32 scales, then the same again gathered
    assert s8["all-to-all"]["wire_bytes"] == 3 / 4 * (D + 4 * D // BLOCK)
    assert s8["all-gather"]["wire_bytes"] == 3 / 4 * (D + 4 * D // BLOCK)
    sk = summarize(parse_collectives(_run(mesh, "topk", x)[2], mesh))
    assert sk["all-gather"]["wire_bytes"] == 3 / 4 * 4 * topk_size(D, 0.05) * (4 + 4)
