"""Dense (models/dense_attention.py) against blockwise attention: forward + backward time and
compiled temporary memory per sequence length, interleaved, on one device. What
`--model.attention auto`'s switch-over length (models.config.BLOCKWISE_FROM) rests on.

    python benchmarks/attention.py [--lengths 512,1024,2048,4096] [--reps 5]
        [--heads 4 --kv-heads 2 --head-dim 64]

Causal self-attention of batch 1, float32, the default model's heads (4 query, 2 KV, 64 wide).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from models import dense_attention  # noqa: E402
from models.context import local_attention  # noqa: E402


def compiled(kind: str, t: int, n: int, k: int, h: int):
    """The jitted gradient of sum(out * cotangent) w.r.t. q, k, v, and its arguments."""

    def loss(q, kk, v, pos, cot):
        if kind == "dense":  # the index path of models/attention.py: a causal mask by index
            seen_1TS = jnp.arange(t)[None, None, :] <= jnp.arange(t)[None, :, None]
            out = dense_attention.attend(q, kk, v, seen_1TS)
        else:
            out = local_attention(q, kk, v, pos, pos, None, None, window=0, kind="blockwise")
        return jnp.sum(out * cot)

    keys = jax.random.split(jax.random.key(0), 4)
    args = (
        jax.random.normal(keys[0], (1, t, n, h)),
        jax.random.normal(keys[1], (1, t, k, h)),
        jax.random.normal(keys[2], (1, t, k, h)),
        jnp.arange(t)[None],
        jax.random.normal(keys[3], (1, t, n, h)),
    )
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return fn, args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    print(
        f"{'T':>6} {'dense ms':>9} {'blockwise ms':>13} {'ratio':>6}"
        f" {'dense MiB':>10} {'blockwise MiB':>14}"
    )
    for t in (int(x) for x in a.lengths.split(",")):
        fns = {
            kind: compiled(kind, t, a.heads, a.kv_heads, a.head_dim)
            for kind in ("dense", "blockwise")
        }
        times = {kind: [] for kind in fns}
        for fn, args in fns.values():
            jax.block_until_ready(fn(*args))  # warm
        for _ in range(a.reps):  # interleaved: a load change hits both alike
            for kind, (fn, args) in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[kind].append(time.perf_counter() - t0)
        ms = {kind: 1e3 * statistics.median(ts) for kind, ts in times.items()}
        mib = {
            kind: fn.memory_analysis().temp_size_in_bytes / 2**20 for kind, (fn, _) in fns.items()
        }
        print(
            f"{t:>6} {ms['dense']:>9.1f} {ms['blockwise']:>13.1f}"
            f" {ms['blockwise'] / ms['dense']:>6.2f}"
            f" {mib['dense']:>10.1f} {mib['blockwise']:>14.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
