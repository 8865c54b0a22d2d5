"""The projections' einsum with the weight gradient contracted in the weight's own dim order.

`projection(spec, x, w)` is `jnp.einsum(spec, x, w)` for an activation `x` (its token dims b, t)
and a weight `w`, with the same input gradient as autodiff's and one difference in the weight
gradient. Autodiff contracts (cotangent, x) into [the output's free dims, x's free dims] ([F, D]
for "btd,df->btf") and transposes that into the weight's order. A CPU matmul (XLA:CPU's XNNPACK
call) takes its left operand with the contracted dim last, so XLA first copies the [tokens, F]
cotangent transposed, fused with whatever elementwise work produced it (the SwiGLU's backward, for
the gate and up projections), a strided pass that cost more than the copy's bytes suggest.
Contracting (x, cotangent) into the weight's order directly transposes x instead: [tokens, D], 4x
smaller than [tokens, F] at d_ff = 4 d_model, and shared by every projection that reads the same x
(gate and up; q, k and v).

Same dots and dtypes as autodiff's (x, w and the output share one dtype), the same residuals
under every remat policy (the forward's dot is the one a `dots` policy saves). Measured side by
side on 8 fake CPU devices (BENCHMARKS.md, "The projections' weight gradients"): float32 steps
6-8% shorter (4 and 8 layers over `fsdp=8`, 4 over `fsdp=4,model=2`), bfloat16 steps level to 5%
shorter.
The LM head's weight gradient is contracted the same way (`models.layers.head_logits`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def projection(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w); spec names x's dims, then w's, then the output's (no ellipsis)."""
    return jnp.einsum(spec, x, w)


def _projection_fwd(spec: str, x: jax.Array, w: jax.Array):
    return jnp.einsum(spec, x, w), (x, w)


def _projection_bwd(spec: str, residuals, g: jax.Array):
    x, w = residuals
    inputs, out = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    g = g.astype(x.dtype)
    dx = jnp.einsum(f"{out},{w_dims}->{x_dims}", g, w)
    dw = jnp.einsum(f"{x_dims},{out}->{w_dims}", x, g)
    return dx.astype(x.dtype), dw.astype(w.dtype)


projection.defvjp(_projection_fwd, _projection_bwd)
