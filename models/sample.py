"""Autoregressive generation with a KV cache: greedy, temperature and top-k sampling."""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from errors import check_number, expect
from models import model
from models.config import ModelConfig


def pick_token(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    if temperature <= 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def generate(
    cfg: ModelConfig,
    params,
    prompt_BT: jax.Array,
    key: jax.Array,
    *,
    max_new: int,
    temperature: float = 0.8,
    top_k: int = 40,
) -> jax.Array:
    """prompt [B,T0] int32 -> generated tokens [B, max_new] (the prompt is not repeated).

    One prefill pass fills the cache with the prompt; each new token then costs one
    single-position pass over the cache. The arguments are checked before jit sees them."""
    expect("generate", "cfg", cfg, ModelConfig, "a ModelConfig (a Config's .model)")
    for name, value in (("max_new", max_new), ("top_k", top_k)):
        expect("generate", name, value, numbers.Integral, "an integer")
    expect("generate", "temperature", temperature, numbers.Real, "a number")
    check_number("generate: max_new", max_new, int, ">=1")
    check_number("generate: top_k", top_k, int, ">=0")
    check_number("generate: temperature", temperature, float, ">=0")
    return _generate(
        cfg, params, prompt_BT, key, max_new=max_new, temperature=temperature, top_k=top_k
    )


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "temperature", "top_k"))
def _generate(cfg, params, prompt_BT, key, *, max_new, temperature, top_k) -> jax.Array:
    b, t0 = prompt_BT.shape
    cache = model.init_cache(cfg, b, t0 + max_new)
    logits_BTV, cache = model.apply(
        cfg, params, prompt_BT, jnp.broadcast_to(jnp.arange(t0), (b, t0)), cache
    )

    def step(carry, i):
        logits_BV, cache, key = carry
        key, sub = jax.random.split(key)
        tok_B = pick_token(logits_BV, sub, temperature, top_k)
        pos_B1 = jnp.full((b, 1), t0 + i, jnp.int32)
        logits_B1V, cache = model.apply(cfg, params, tok_B[:, None], pos_B1, cache)
        return (logits_B1V[:, -1], cache, key), tok_B

    _, toks_NB = jax.lax.scan(step, (logits_BTV[:, -1], cache, key), jnp.arange(max_new))
    return toks_NB.T
