"""Autoregressive generation with a KV cache: greedy, temperature and top-k sampling, and the
decode loop that every sampler runs (`decode`: one single-position pass a token, stopping once
every row has emitted its end-of-sequence token when told one)."""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from errors import check_number, expect
from models import model
from models.config import ModelConfig


def pick_token(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """The next token of each row. The draws are per row: with jax's partitionable threefry (the
    default) row b's noise is a function of the key and b alone, so it is the same whether the rows
    are split over devices or not, and whatever the other rows are."""
    if temperature <= 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def decode(
    cfg: ModelConfig,
    params,
    logits_BV: jax.Array,
    cache,
    key: jax.Array,
    *,
    start: int,
    steps: int,
    temperature: float,
    top_k: int,
    forced_BT: jax.Array | None = None,
    lengths_B: jax.Array | None = None,
    eos: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The tokens at positions start .. start + steps - 1 [B, steps] and the decode steps run.

    `logits_BV`: the logits of position start - 1, `cache`: filled up to it. Each step picks a
    token (pick_token, with the next subkey of `key`), or takes forced_BT[:, pos] while pos <
    lengths_B (a row's prompt that outlasts the shared prefill), and runs one single-position pass.
    With `eos`, a row is done once it has picked `eos`; its later tokens are `eos`, and the loop
    (a lax.while_loop) stops as soon as every row is done: the tokens up to each row's first picked
    `eos` are the full-length loop's, the rest `eos`."""
    b = logits_BV.shape[0]
    fill = 0 if eos is None else eos

    def body(carry):
        i, logits_BV, cache, key, done_B, out_BS = carry
        key, sub = jax.random.split(key)
        pos = start + i
        tok_B = pick_token(logits_BV, sub, temperature, top_k)
        picked_B = jnp.ones((b,), bool)
        if forced_BT is not None:
            picked_B = pos >= lengths_B
            tok_B = jnp.where(picked_B, tok_B, forced_BT[:, pos])
        if eos is not None:
            tok_B = jnp.where(done_B, eos, tok_B)
            done_B = done_B | (picked_B & (tok_B == eos))
        out_BS = jax.lax.dynamic_update_slice(out_BS, tok_B[:, None], (0, i))
        logits_B1V, cache = model.apply(
            cfg, params, tok_B[:, None], jnp.full((b, 1), pos, jnp.int32), cache
        )
        return i + 1, logits_B1V[:, -1], cache, key, done_B, out_BS

    def running(carry):
        return (carry[0] < steps) & ~jnp.all(carry[4])

    init = (
        jnp.int32(0),
        logits_BV,
        cache,
        key,
        jnp.zeros((b,), bool),
        jnp.full((b, steps), fill, jnp.int32),
    )
    n, _, _, _, _, out_BS = jax.lax.while_loop(running, body, init)
    return out_BS, n


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
    toks_BN, _ = decode(
        cfg,
        params,
        logits_BTV[:, -1],
        cache,
        key,
        start=t0,
        steps=max_new,
        temperature=temperature,
        top_k=top_k,
    )
    return toks_BN
