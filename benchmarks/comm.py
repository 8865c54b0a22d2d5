"""Communication benchmark on 8 fake CPU devices: a collective table (mesh.bench) and the bytes
each gradient-sync setting puts on the wire, read from the compiled HLO, for a real model's
gradients.

    python benchmarks/comm.py                      # default model, mesh data=4,model=2
    python benchmarks/comm.py --model 125m --mesh data=8 --sizes 256K,4M --iters 5

Part 1 is `python -m mesh.bench` over a few sizes. Part 2 compiles train.core.comm.sync_grads for
the model's parameter tree ([R, ...] per-replica gradients sharded over the data axis, the model
axis sharding the weights by the logical-axis rules), parses the optimized HLO with plan.hlo and
sums the wire bytes of the collectives over the data axis; it also times each sync (median of
--iters): on one CPU the fake devices share memory, so the time shows the compression's compute
cost, not a network saving.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (8 fake devices before JAX starts; repo on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from mesh import bench  # noqa: E402
from mesh.build import make_mesh  # noqa: E402
from mesh.rules import axis_rules, logical_to_spec, make_rules  # noqa: E402
from mesh.spec import mesh_text  # noqa: E402
from models import model as model_lib  # noqa: E402
from models.presets import preset  # noqa: E402
from plan.hlo import parse_collectives, summarize  # noqa: E402
from train.core import comm  # noqa: E402

SETTINGS = (
    ("none (float32, XLA)", "none"),
    ("int8", "int8"),
    ("int4", "int4"),
    ("topk 1%", "topk"),
)


def sync_grads_input(cfg, mesh, rules):
    """Random per-replica gradients of the model, one copy per data-parallel replica: (the
    replicated batch axes, their size, the parameters' specs and shapes, the gradients)."""
    dp = tuple(a for a in rules["batch"] if mesh.shape[a] > 1 and a not in ("fsdp",))
    n_dp = int(np.prod([mesh.shape[a] for a in dp]))
    specs = jax.tree.map(
        lambda names: logical_to_spec(names, rules),
        model_lib.param_axes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    shapes = model_lib.abstract_params(cfg)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(
        lambda s, sp: jax.device_put(
            rng.standard_normal((n_dp, *s.shape)).astype(np.float32) / n_dp,
            NamedSharding(mesh, comm.replica_spec(sp, dp)),
        ),
        shapes,
        specs,
    )
    return dp, n_dp, specs, shapes, grads


def sync_row(label: str, c, grads, dp, specs, mesh, iters: int) -> dict:
    """One compression setting: the wire bytes and collectives over the data-parallel axes in the
    compiled HLO, and the median sync time."""
    fn = jax.jit(
        lambda g: comm.sync_grads(
            g, None, compression=c, dp_axes=dp, param_specs=specs, topk_fraction=0.01
        )[0]
    )
    text = fn.lower(grads).compile().as_text()
    s = summarize(parse_collectives(text, mesh))
    wire = sum(
        a["wire_bytes"]
        for v in s.values()
        for ax, a in v["by_axes"].items()
        if set(dp) & set(ax.split(","))
    )
    kinds = {
        k: v["count"]
        for k, v in s.items()
        if any(set(dp) & set(ax.split(",")) for ax in v["by_axes"])
    }
    jax.block_until_ready(fn(grads))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(grads))
        times.append(time.perf_counter() - t0)
    return {
        "setting": label,
        "wire_bytes": wire,
        "kinds": kinds,
        "time_ms": 1e3 * statistics.median(times),
    }


def sync_table(model: str, mesh_spec: str, iters: int) -> list[dict]:
    mesh = make_mesh(mesh_spec)
    rules = make_rules()
    cfg = preset(model)
    dp, n_dp, specs, shapes, grads = sync_grads_input(cfg, mesh, rules)
    n_params = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    with jax.set_mesh(mesh), axis_rules(rules):
        rows = [sync_row(label, c, grads, dp, specs, mesh, iters) for label, c in SETTINGS]
    base = rows[0]["wire_bytes"]
    print(
        f"\n## Gradient sync over {','.join(dp)} (n={n_dp}), model `{model}`"
        f" ({n_params / 1e6:.2f}M params), mesh {mesh_text(mesh.shape)}: per-device wire bytes per"
        " step from the compiled HLO\n"
    )
    print(
        "| setting | collectives over dp | wire bytes / device | float32 / this"
        " | sync time (CPU, ms) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        kinds = ", ".join(f"{n} {k}" for k, n in r["kinds"].items() if n)
        print(
            f"| {r['setting']} | {kinds} | {r['wire_bytes'] / 1e6:.3f} MB"
            f" | {base / r['wire_bytes']:.2f}x | {r['time_ms']:.1f} |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--mesh", default="data=4,model=2")
    p.add_argument("--sizes", default="64K,1M,8M")
    p.add_argument("--ops", default=",".join(bench.OPS))
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    mesh = make_mesh(args.mesh)
    print(
        f"## Collectives (`python -m mesh.bench --mesh {args.mesh} --sizes {args.sizes}"
        f" --iters {args.iters}`)\n"
    )
    print("| op | axes | n | size | time (us) | algbw GB/s | busbw GB/s |")
    print("|---|---|---|---|---|---|---|")
    bench.run(
        mesh,
        args.ops.split(","),
        bench.axis_groups(dict(mesh.shape), None),
        bench.parse_sizes(args.sizes),
        ["float32"],
        args.iters,
        2,
        on_row=lambda r: print(
            f"| {r['op']} | {r['axes']} | {r['n']} | {bench._human(r['size_bytes'])} |"
            f" {r['time_us']:.0f} | {r['algbw_GBps']:.3f} | {r['busbw_GBps']:.3f} |",
            flush=True,
        ),
    )
    sync_table(args.model, args.mesh, args.iters)


if __name__ == "__main__":
    jnp.zeros(1)  # start the backend before timing anything
    main()
