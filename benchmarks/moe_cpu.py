"""The MoE's CPU kernel and collectives, bfloat16 (8 fake devices for the collectives):

    python benchmarks/moe_cpu.py grouped [--reps 15]      # the grouped FFN over shapes and loads
    python benchmarks/moe_cpu.py collectives [--reps 10]  # all-to-all / all-gather by dtype

`grouped` times models/moe_kernels.gmm_blocks forward + backward on one device over layer shapes
(2-32 local experts, 256-4,096 real rows in a buffer twice as long, the rest padding) and three
loads (uniform; Zipf, expert i taking a share 1/(i+1); a quarter of the experts taking every row):
the padded blocks alone, with einsum slots at 1.0 / 1.25 / 1.5 x a balanced load, and the blocks
with a 64-row floor instead of 128. `collectives` times ten all-to-alls of [4,096, 256] rows over
an axis of 2 and ten all-gathers of [8, 256, 512] weights over an axis of 4 in float32, bfloat16
and uint16 (bfloat16's bits), inside shard_map.
"""

import argparse
import math

import common  # 8 fake devices, repo on sys.path; the timer
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.moe_kernels import block_size, einsum_slots, gmm_blocks

SHAPES = [  # local experts, real rows, d_model, expert width
    (4, 256, 256, 512),
    (8, 256, 256, 512),
    (8, 1024, 512, 1024),
    (16, 2048, 256, 512),
    (2, 1024, 512, 1024),
    (4, 1024, 512, 1024),
    (32, 4096, 256, 256),
]
LOADS = ("uniform", "zipf", "quarter")


def _expert_ids(load: str, x_count: int, real: int, rows: int, key):
    share = {
        "uniform": jnp.ones(x_count),
        "zipf": 1.0 / (1 + jnp.arange(x_count)),
        "quarter": jnp.where(jnp.arange(x_count) < max(1, x_count // 4), 1.0, 1e-9),
    }[load]
    ids = jax.random.categorical(key, jnp.log(share / share.sum()), shape=(rows,))
    return jnp.where(jnp.arange(rows) < real, ids, x_count)  # the rest: padding


def grouped(reps: int) -> None:
    print("gmm_blocks fwd+bwd, bf16, 1 device, ms (median of", reps, "); max/avg: fullest expert")
    print(
        "| experts | rows | D | F | load | max/avg | blocks | x1.0 | x1.25 | x1.5 | x1.25, 64-row |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x_count, real, d, f in SHAPES:
        for load in LOADS:
            ks = jax.random.split(jax.random.key(real + x_count), 5)
            rows = 2 * real
            x = jax.random.normal(ks[0], (rows, d), jnp.bfloat16)
            ws = [
                (0.05 * jax.random.normal(k, s)).astype(jnp.bfloat16)
                for k, s in zip(ks[1:4], ((x_count, d, f), (x_count, d, f), (x_count, f, d)))
            ]
            g = _expert_ids(load, x_count, real, rows, ks[4])
            block, avg = block_size(real, x_count), real / x_count
            variants = [("blocks", block, 0)]
            variants += [(m, block, 8 * math.ceil(m * avg / 8)) for m in (1.0, 1.25, 1.5)]
            variants += [("64", 64, einsum_slots(real, x_count))]
            cells = []
            for _, b, cap in variants:

                def loss(x, wg, wu, wd, b=b, cap=cap, g=g):
                    y = gmm_blocks(x, g, wg, wu, wd, b, cap)
                    return jnp.sum(y.astype(jnp.float32) ** 2)

                fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
                cells.append(f"{1e3 * common.median_time(fn, x, *ws, reps=reps):.2f}")
            most = int(jnp.max(jnp.bincount(g, length=x_count + 1)[:x_count]))
            print(
                f"| {x_count} | {real} | {d} | {f} | {load} | {most / avg:.2f} | "
                + " | ".join(cells)
                + " |",
                flush=True,
            )


def collectives(reps: int) -> None:
    mesh = jax.make_mesh((4, 2), ("fsdp", "expert"))
    rows_spec, w_spec = P(("fsdp", "expert")), P("expert", "fsdp")
    print("ten collectives in a row inside shard_map, 8 fake devices, ms (median of", reps, ")")
    print("| collective | float32 | bfloat16 | uint16 |")
    print("|---|---|---|---|")
    for op in ("all-to-all [4096, 256] over 2", "all-gather [8, 256, 512] over 4"):
        cells = []
        for dtype in (jnp.float32, jnp.bfloat16, jnp.uint16):
            x = jax.device_put(jnp.ones((8 * 512, 256), dtype), NamedSharding(mesh, rows_spec))
            w = jax.device_put(jnp.ones((8, 256, 512), dtype), NamedSharding(mesh, w_spec))

            def body(x, w, op=op):
                for _ in range(10):
                    if op.startswith("all-to-all"):
                        x = lax.all_to_all(x, "expert", 0, 0, tiled=True)
                    else:  # gathered, then this device's shard again for the next round
                        w = lax.all_gather(w, "fsdp", axis=1, tiled=True)[:, :64]
                return x, w

            specs = (rows_spec, w_spec)
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
            with jax.set_mesh(mesh):
                cells.append(f"{1e3 * common.median_time(fn, x, w, reps=reps):.2f}")
        print(f"| {op} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("grouped", "collectives"))
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    grouped(a.reps) if a.what == "grouped" else collectives(a.reps)


if __name__ == "__main__":
    main()
