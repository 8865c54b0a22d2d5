"""Tanh soft-capping (Gemma 2): a value squeezed smoothly into (-cap, cap) by cap * tanh(x / cap),
on attention scores (`model.attn_softcap`, before the mask and the softmax) and on the final
logits (`model.final_softcap`, before the cross-entropy). 0 = no cap: the value unchanged, and no
op in the program.

No fused attention kernel takes a cap, so capped attention runs where the scores are JAX's own:
dense attention from a mask (models/context.py `local_attention`), the blockwise kernel
(models/blockwise.py, whose written-out backward uses `softcap_grad`) and the ring's steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap), as HF computes it (divide, tanh, multiply); x unchanged for cap 0."""
    return cap * jnp.tanh(x / cap) if cap else x


def softcap_grad(capped: jax.Array, cap: float) -> jax.Array | float:
    """d softcap(x) / dx from the capped value: 1 - tanh^2 = 1 - (capped / cap)^2 (1 for cap 0)."""
    return 1.0 - jnp.square(capped / cap) if cap else 1.0
