"""The collectives inside the MoE's shard_map, and the dtypes they run in.

XLA:CPU has no 16-bit float collectives: it converts a bfloat16 all-to-all or all-gather to
float32 on both sides, which costs as much as sending float32 or more. Ten [4,096, 256]
all-to-alls over 2 of 8 fake devices: float32 4.0 ms, bfloat16 5.2 ms, its bits as uint16 2.4 ms;
ten [8, 256, 512] all-gathers over 4: 12.7, 12.0 and 7.0 ms (`python benchmarks/moe_cpu.py
collectives`). So on CPU 16-bit floats travel as their bits, which no conversion touches; a
reduction cannot, and runs in float32 (`reduce_dtype`). GPU and TPU send bfloat16 as it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def reduce_dtype(dtype):
    """The dtype of the reducing collectives inside the MoE shard_map (psums, and the weights'
    gradients reduce-scattered or summed by the transposes of gathers and casts to varying).
    XLA:CPU aborts ("Invalid binary instruction opcode copy", jax 0.12 with Shardy) when its
    float normalisation rewrites a bfloat16 all-reduce or reduce-scatter of a manual region into
    float32: Shardy leaves a copy at the root of the reducer, which the rewrite cannot rebuild. So
    on CPU they run in float32, which is what that rewrite makes of them anyway; elsewhere in the
    compute dtype."""
    return jnp.float32 if jax.default_backend() == "cpu" else dtype


def as_bits(dtype) -> bool:
    """Whether arrays of `dtype` travel as uint16 bits: 16-bit floats on CPU."""
    dtype = jnp.dtype(dtype)
    return (
        jax.default_backend() == "cpu"
        and jnp.issubdtype(dtype, jnp.floating)
        and dtype.itemsize == 2
    )


def _bits_of(x):
    return lax.bitcast_convert_type(x, jnp.uint16)


def _floats_of(u, dtype):
    return lax.bitcast_convert_type(u, dtype)


def _a2a(x, axes):
    return lax.all_to_all(x, axes, 0, 0, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _exchange_bits(x_RD, ids_R, axes):
    # the ids (< 2^16) ride along as one more uint16 column: one all-to-all, not two
    cols = [_bits_of(x_RD)] + ([] if ids_R is None else [ids_R.astype(jnp.uint16)[:, None]])
    got = _a2a(jnp.concatenate(cols, axis=1), axes)
    y_RD = _floats_of(got[:, : x_RD.shape[1]], x_RD.dtype)
    return y_RD if ids_R is None else (y_RD, got[:, -1].astype(ids_R.dtype))


def _exchange_bits_fwd(x_RD, ids_R, axes):
    return _exchange_bits(x_RD, ids_R, axes), None


def _exchange_bits_bwd(axes, _, cts):
    # a tiled all-to-all that splits and concatenates the same dim is its own transpose
    ct_RD = cts if isinstance(cts, jax.Array) else cts[0]
    return _exchange_bits(ct_RD, None, axes), None


_exchange_bits.defvjp(_exchange_bits_fwd, _exchange_bits_bwd)


def exchange(x_RD, axes, ids_R=None):
    """Rows [R, D] split into one slice per device of `axes`, slice i sent to device i, the
    received slices stacked in source order (a tiled all-to-all on dim 0); `ids_R` (ints < 2^16,
    optional) travel alongside -> x' or (x', ids')."""
    axes = tuple(axes)
    if as_bits(x_RD.dtype):
        return _exchange_bits(x_RD, ids_R, axes)
    return _a2a(x_RD, axes) if ids_R is None else (_a2a(x_RD, axes), _a2a(ids_R, axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_bits(w, axes, axis, dtype, w_dtype):
    u = lax.all_gather(_bits_of(w.astype(dtype)), axes, axis=axis, tiled=True)
    return _floats_of(u, dtype)


def _gather_bits_fwd(w, axes, axis, dtype, w_dtype):
    return _gather_bits(w, axes, axis, dtype, w_dtype), None


def _gather_bits_bwd(axes, axis, dtype, w_dtype, _, ct):
    r = lax.psum_scatter(
        ct.astype(reduce_dtype(ct.dtype)), axes, scatter_dimension=axis, tiled=True
    )
    return (r.astype(w_dtype),)


_gather_bits.defvjp(_gather_bits_fwd, _gather_bits_bwd)


def gather_weight(w, axes, axis: int, dtype):
    """A weight's shard -> the weight gathered over `axes` along `axis`, in `dtype` (cast before
    it travels: half the bytes of a float32 master). The backward reduce-scatters its gradient in
    `reduce_dtype` and casts it to w's dtype."""
    if as_bits(dtype):
        return _gather_bits(w, tuple(axes), axis, jnp.dtype(dtype), w.dtype)
    return lax.all_gather(w.astype(dtype), axes, axis=axis, tiled=True)
