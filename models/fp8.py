"""FP8 matmuls with per-tensor current scaling (`--model.matmul_precision fp8`).

Each operand of a projection is rounded to float8 (e4m3: 3 mantissa bits, range +-448) after
scaling its largest magnitude onto float8's largest finite value, and the gradient arriving at
the projection's output is rounded to e5m2 (2 mantissa bits, range +-57344: gradients need range
more than precision). This is the "current scaling" recipe of NVIDIA Transformer Engine: the scale
comes from this step's tensor itself, so there is no amax history to keep in the train state or
the checkpoint.

The rounding is written as quantise-then-dequantise around an ordinary einsum. XLA:GPU rewrites
that pattern into an FP8 GEMM with float32 accumulation on GPUs that have FP8 tensor cores
(Hopper, Blackwell); elsewhere (CPU, older GPUs) the same program runs the einsum in the compute
dtype on FP8-rounded values, which reproduces the numerics without the speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORWARD = jnp.float8_e4m3fn  # activations and weights
BACKWARD = jnp.float8_e5m2  # output gradients


def round_scaled(x: jax.Array, dtype) -> jax.Array:
    """x rounded to `dtype` under per-tensor scaling, returned in x's dtype. The scale maps max|x|
    to the format's largest finite value; a zero tensor keeps scale 1."""
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    # the clip keeps x / scale inside the format when the division rounds up: e4m3fn has no
    # infinity, so an overflow would become NaN
    x_scaled = jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)
    return (x_scaled.astype(jnp.float32) * scale).astype(x.dtype)


@jax.custom_vjp
def operand(x: jax.Array) -> jax.Array:
    """e4m3 rounding of a matmul input; the gradient passes straight through (it is rounded once,
    to e5m2, where it enters the matmul's backward)."""
    return round_scaled(x, FORWARD)


operand.defvjp(lambda x: (round_scaled(x, FORWARD), None), lambda _, g: (g,))


@jax.custom_vjp
def output_grad(y: jax.Array) -> jax.Array:
    """The identity forward; the gradient arriving here is rounded to e5m2 before both backward
    matmuls (input gradient and weight gradient) use it."""
    return y


output_grad.defvjp(lambda y: (y, None), lambda _, g: (round_scaled(g, BACKWARD),))


def einsum(spec: str, x: jax.Array, w: jax.Array, fp8: bool) -> jax.Array:
    """`jnp.einsum(spec, x, w)`, with FP8 rounding of both operands and of the output gradient
    when `fp8` (the projections and MLP; attention scores, the router and the LM head stay in the
    compute dtype)."""
    if not fp8:
        return jnp.einsum(spec, x, w)
    return output_grad(jnp.einsum(spec, operand(x), operand(w)))
