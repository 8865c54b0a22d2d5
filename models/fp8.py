"""FP8 matmuls with current scaling per token (`--model.matmul_precision fp8`).

Each operand of a projection is rounded to float8 (e4m3: 3 mantissa bits, range +-448) after
scaling (by a power of two) its largest magnitude into float8's top binade, and the gradient
arriving at the projection's output is rounded to e5m2 (2 mantissa bits, range +-57344: gradients
need range more than precision). The scales are current (this step's values, no amax history in
the train state or the checkpoint) and come from:

  weights                  the whole tensor: one scale per weight, the same in every micro-batch
                           and on every replica, since every one of them multiplies the same
                           weight in a step;
  activations, gradients   each token's own values (its row of the operand, over every dim but
                           batch and sequence): one scale per token.

Why per token and not per tensor: a per-tensor scale of an activation is the largest magnitude of
the tokens in that tensor, and which tokens those are depends on the layout of the step, not on
the model: one micro-batch of --train.micro_batches, one data-parallel replica's rows. The same
step then rounded differently with 1 and 4 micro-batches, and sharded differently from one device.
A scale from the whole step would need either the amax of every micro-batch before the first one
runs (a second forward pass, and for gradients a second backward) or delayed scaling (the amax of
the previous steps, as Transformer Engine's DelayedScaling and MaxText keep it), which holds an
amax history per layer in the train state and starts from a guessed scale. A token's scale comes
from that token alone, so it is the same however the step is cut into micro-batches or sharded
(tests/test_fp8.py checks both), with no state; it is also finer than a per-tensor scale (an
outlier token no longer coarsens every other token's rounding), the direction of the fine-grained
recipes (DeepSeek-V3's 1x128 activation tiles, MXFP8's 1x32 blocks). What no recipe removes: a
sharded matmul sums in another float32 order, and a value that lands within that rounding error of
an FP8 rounding boundary rounds the other way (a step of 6-25%); such a crossing is rare, and the
power-of-two scales keep the scale itself from being one.

The rounding is written as quantise-then-dequantise around an ordinary einsum, which reproduces the
numerics on any backend. Which FP8 GEMMs XLA:GPU forms from per-token scales (its FP8 rewrite was
written for per-tensor ones) has not been measured on a GPU here; elsewhere (CPU, older GPUs) the
einsum runs in the compute dtype on FP8-rounded values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from models.projection import projection

FORWARD = jnp.float8_e4m3fn  # activations and weights
BACKWARD = jnp.float8_e5m2  # output gradients
TOKEN_DIMS = "bt"  # the einsum letters of the batch and sequence dims: one scale per token


def power_of_two_scale(amax: jax.Array, dtype) -> jax.Array:
    """The smallest power of two s with amax / s <= the format's largest finite value (1 where
    amax is 0). Worked out from amax's exponent and mantissa alone (frexp), with no rounding: a
    quotient amax / top is rounded differently in different compiled programs (XLA may multiply by
    the reciprocal), and a scale one ulp apart moves values across FP8 rounding boundaries."""
    top_mantissa, top_exponent = math.frexp(float(jnp.finfo(dtype).max))
    mantissa, exponent = jnp.frexp(amax)
    exponent = exponent - top_exponent + (mantissa > top_mantissa)
    return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1.0), exponent), 1.0)


def round_scaled(x: jax.Array, dtype, keep: tuple[int, ...] = ()) -> jax.Array:
    """x rounded to `dtype` with one scale per slice along the dims `keep` (() = one scale for the
    whole tensor), returned in x's dtype. Each scale is the power of two that brings the slice's
    largest magnitude into the format's top binade (at most one binade of range unused): dividing
    by it and multiplying back are exact, so a value rounds the same in every program that holds
    the same slice (as MXFP8's power-of-two block scales)."""
    top = float(jnp.finfo(dtype).max)
    over = tuple(d for d in range(x.ndim) if d not in keep)
    amax = jnp.max(jnp.abs(x), axis=over, keepdims=True).astype(jnp.float32)
    scale = power_of_two_scale(amax, dtype)
    # the clip is a guard only (amax / scale <= top by construction): e4m3fn has no infinity, so
    # an overflow would become NaN
    x_scaled = jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)
    return (x_scaled.astype(jnp.float32) * scale).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def operand(x: jax.Array, keep: tuple[int, ...]) -> jax.Array:
    """e4m3 rounding of a matmul input (scaled per slice along `keep`); the gradient passes
    straight through (it is rounded once, to e5m2, where it enters the matmul's backward)."""
    return round_scaled(x, FORWARD, keep)


operand.defvjp(lambda x, keep: (round_scaled(x, FORWARD, keep), None), lambda keep, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def output_grad(y: jax.Array, keep: tuple[int, ...]) -> jax.Array:
    """The identity forward; the gradient arriving here is rounded to e5m2 (scaled per slice along
    `keep`) before both backward matmuls (input gradient and weight gradient) use it."""
    return y


output_grad.defvjp(lambda y, keep: (y, None), lambda keep, _, g: (round_scaled(g, BACKWARD, keep),))


def token_dims(subscripts: str) -> tuple[int, ...]:
    """The positions of the batch and sequence letters in one operand's einsum subscripts."""
    return tuple(i for i, letter in enumerate(subscripts) if letter in TOKEN_DIMS)


def einsum(spec: str, x: jax.Array, w: jax.Array, fp8: bool) -> jax.Array:
    """`jnp.einsum(spec, x, w)` (as `models.projection.projection`), with FP8 rounding of both
    operands and of the output gradient when `fp8` (the projections and MLP; attention scores, the
    router and the LM head stay in the compute dtype). `x` is the activation, its batch and
    sequence dims lettered b and t (one scale per token, also for the output gradient); `w` the
    weight (one scale)."""
    if not fp8:
        return projection(spec, x, w)
    inputs, out = spec.split("->")
    x_dims = inputs.split(",")[0]
    y_BT = projection(spec, operand(x, token_dims(x_dims)), operand(w, ()))
    return output_grad(y_BT, token_dims(out))
