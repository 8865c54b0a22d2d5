"""How the sampler stops at EOS, timed on one device: models/sample.py's decode (a lax.while_loop
whose condition reads the rows' done flags, no host round trip) against chunks of C decode steps
(a jitted lax.scan each, the cache donated) with a host check of the done flags between chunks;
and, at full length, the while loop against the lax.scan it replaced.

The stop step k is set by the loop's length (a loop stopped by its flags at step k runs the same k
steps), so every row's tokens and the chunks' k rounded up to a multiple of C are what is timed.
Best of --reps after a warm-up run.

    python benchmarks/decode_stop.py [--rows 64] [--new 64] [--stops 8,24] [--chunks 4,8,16]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import model  # noqa: E402
from models.sample import decode, pick_token  # noqa: E402
from train.core.config import build  # noqa: E402

PREFILL = 8
NEVER = -1  # an EOS no row picks: the loop runs the steps it is given


def best_ms(f, reps: int) -> float:
    jax.block_until_ready(f())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def loops(cfg, r: int, n: int):
    """(the scan loop, the while loop, the chunked loop) over `r` rows and `n` new tokens, each
    (params, prompt, key, ...) -> tokens; the while loop and the chunks also take the stop step."""

    def prefill(params, prompt):
        cache = model.init_cache(cfg, r, PREFILL + n)
        positions = jnp.broadcast_to(jnp.arange(PREFILL), (r, PREFILL))
        logits, cache = model.apply(cfg, params, prompt, positions, cache)
        return logits[:, -1], cache

    @functools.partial(jax.jit, static_argnames=("steps",))
    def by_while(params, prompt, key, steps):
        logits, cache = prefill(params, prompt)
        kw = dict(start=PREFILL, steps=steps, temperature=1.0, top_k=0, eos=NEVER)
        return decode(cfg, params, logits, cache, key, **kw)[0]

    def scan_steps(params, logits, cache, key, done, i0, chunk):
        def step(carry, i):
            logits, cache, key, done = carry
            key, sub = jax.random.split(key)
            tok = jnp.where(done, NEVER, pick_token(logits, sub, 1.0, 0))
            positions = jnp.full((r, 1), PREFILL + i0 + i, jnp.int32)
            out, cache = model.apply(cfg, params, tok[:, None], positions, cache)
            return (out[:, -1], cache, key, done | (tok == NEVER)), tok

        carry, toks = jax.lax.scan(step, (logits, cache, key, done), jnp.arange(chunk))
        return (*carry, toks.T)

    @jax.jit
    def by_scan(params, prompt, key):
        logits, cache = prefill(params, prompt)
        return scan_steps(params, logits, cache, key, jnp.zeros((r,), bool), 0, n)[-1]

    start = jax.jit(prefill)
    chunk_jit = jax.jit(scan_steps, static_argnames=("chunk",), donate_argnums=(2,))

    def by_chunks(params, prompt, key, stop: int, chunk: int):
        logits, cache = start(params, prompt)
        done, toks = jnp.zeros((r,), bool), []
        for i in range(0, stop, chunk):
            logits, cache, key, done, out = chunk_jit(params, logits, cache, key, done, i, chunk)
            toks.append(out)
            if bool(done.all()):  # the host check: never true here, as it is not before step k
                break
        return jnp.concatenate(toks, 1)

    return by_scan, by_while, by_chunks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--stops", default="8,24")
    p.add_argument("--chunks", default="4,8,16")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    cfg = build({"model.preset": "tiny", "model.d_model": a.d_model, "model.dtype": "float32"})
    cfg = cfg.model
    args = (
        model.init(cfg, jax.random.key(0)),
        jax.random.randint(jax.random.key(1), (a.rows, PREFILL), 0, 255),
        jax.random.key(2),
    )
    by_scan, by_while, by_chunks = loops(cfg, a.rows, a.new)

    def ms(f, *more) -> float:
        return best_ms(functools.partial(f, *args, *more), a.reps)

    print(f"{a.rows} rows, prefill {PREFILL}, {a.new} new tokens, tiny at d_model {a.d_model}")
    print(f"full length: lax.scan {ms(by_scan):.1f} ms, while_loop {ms(by_while, a.new):.1f} ms")
    for stop in map(int, a.stops.split(",")):
        line = f"stopped at step {stop}: while_loop {ms(by_while, stop):.1f} ms"
        for c in map(int, a.chunks.split(",")):
            line += f", chunks of {c} {ms(by_chunks, stop, c):.1f} ms"
        print(line)


if __name__ == "__main__":
    main()
