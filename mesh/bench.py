"""Collective benchmark, like nccl-tests, over the axes of a Brigade mesh.

    python -m mesh.bench --mesh data=4,model=2
        [--ops all_reduce,all_gather,reduce_scatter,all_to_all,ppermute]
        [--sizes 1K:64M[:4]] [--dtypes float32,bfloat16,int8] [--axes data,model,all]
        [--iters 20] [--json]

For every op, group of mesh axes (each axis of size > 1, and `all` = every device), message size
and dtype: the median time of --iters runs after --warmup (each run timed to
`block_until_ready`), the algorithm bandwidth algbw = size / time and the bus bandwidth busbw =
algbw x factor with nccl-tests' factors (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
all_to_all (n-1)/n; ppermute 1). `size` is nccl-tests' too: the bytes of the larger per-device
buffer (all_gather: the gathered output; reduce_scatter: the input). busbw is the figure to
compare with a link's peak: it is what each device's busiest link carried per second in a ring.

Runs on whatever devices exist: fake CPU devices (--cpu-devices N, or XLA_FLAGS), GPUs/TPUs, and
several processes (--coordinator H:P --num-processes N --process-id I, or auto-detected
SLURM/Open MPI); every process builds only its own shards and only process 0 prints.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time

from errors import ArgParser, UserError, number, one_line_errors
from mesh.spec import AXES

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute")
DTYPES = ("float32", "bfloat16", "float16", "int8", "int32")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for a group of n devices."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "ppermute": 1.0}.get(op, (n - 1) / n)


def bandwidths(op: str, n: int, size_bytes: int, seconds: float) -> tuple[float, float]:
    """-> (algbw, busbw) in bytes/s."""
    alg = size_bytes / seconds
    return alg, alg * bus_factor(op, n)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text.upper())
    if not m or int(m.group(1)) <= 0:
        raise UserError(f"--sizes: '{text}' is not a size; examples: 4096, 1K, 64M, 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_sizes(text: str) -> list[int]:
    """'1K:64M' (x4 steps), '1K:64M:2' (x2 steps) or a list '4K,1M,16M'."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise UserError(f"--sizes: '{text}' must be MIN:MAX or MIN:MAX:FACTOR, e.g. 1K:64M:4")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        try:
            factor = int(parts[2]) if len(parts) == 3 else 4
        except ValueError:
            factor = 0
        if factor < 2:
            raise UserError(f"--sizes: factor in '{text}' must be an integer >= 2, e.g. 1K:64M:2")
        if hi < lo:
            raise UserError(f"--sizes: MAX {parts[1]} is below MIN {parts[0]}")
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= factor
        return out
    return [parse_size(s) for s in text.split(",") if s.strip()]


def _choices(flag: str, text: str, valid: tuple[str, ...]) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    for s in items:
        if s not in valid:
            raise UserError(f"{flag}: unknown '{s}'; valid: {', '.join(valid)}")
    if not items:
        raise UserError(f"{flag}: empty; valid: {', '.join(valid)}")
    return items


def axis_groups(mesh_shape: dict[str, int], text: str | None) -> list[tuple[str, tuple[str, ...]]]:
    """--axes -> [(label, mesh axes)]; default: every axis of size > 1, then `all` if that is more
    than one axis. `all` = every axis of size > 1 (every device)."""
    used = tuple(a for a in AXES if mesh_shape.get(a, 1) > 1)
    if not used:
        raise UserError(
            "--mesh: a single device has no links to benchmark; use more devices"
            " (e.g. --cpu-devices 8 on CPU)"
        )
    if text is None:
        return [(a, (a,)) for a in used] + ([("all", used)] if len(used) > 1 else [])
    out = []
    for name in _choices("--axes", text, AXES + ("all",)):
        if name != "all" and name not in used:
            raise UserError(
                f"--axes: mesh axis '{name}' has size 1 in this mesh;"
                f" valid: {', '.join(used + ('all',))}"
            )
        out.append((name, used if name == "all" else (name,)))
    return out


# ---------------------------------------------------------------------------------------------


def _program(op: str, mesh, axes: tuple[str, ...], n: int):
    """A jitted shard_map running `op` over `axes` on each device's own block (dim 0 sharded over
    every mesh axis, so each device holds distinct data)."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def body(x):
        if op == "all_reduce":
            return lax.psum(x, axes)
        if op == "all_gather":
            return lax.all_gather(x, axes, axis=0, tiled=True)
        if op == "reduce_scatter":
            return lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
        if op == "all_to_all":
            return lax.all_to_all(x, axes, 0, 0, tiled=True)
        return lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])  # ring: each sends once

    spec = P(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _input(mesh, count: int, dtype):
    """[devices * count] with `count` elements per device; each process creates only its shards."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    local = np.ones(count, dtype)
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.make_array_from_callback((mesh.devices.size * count,), sharding, lambda _: local)


def run(mesh, ops, groups, sizes, dtypes, iters: int, warmup: int, on_row=None) -> list[dict]:
    """Time every (op, axes, dtype, size); -> rows as in --json. `on_row(row)` sees each as it
    lands."""
    import jax.numpy as jnp

    rows = []
    for op in ops:
        for label, axes in groups:
            n = math.prod(mesh.shape[a] for a in axes)
            fn = _program(op, mesh, axes, n)
            for dtype_name in dtypes:
                dtype = jnp.dtype(dtype_name)
                for size in sizes:
                    count = max(n, size // dtype.itemsize // n * n)  # whole chunks of n
                    in_count = count // n if op == "all_gather" else count
                    x = _input(mesh, in_count, dtype)
                    for _ in range(warmup):
                        fn(x).block_until_ready()
                    times = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        fn(x).block_until_ready()
                        times.append(time.perf_counter() - t0)
                    t = statistics.median(times)
                    nbytes = count * dtype.itemsize
                    alg, bus = bandwidths(op, n, nbytes, t)
                    row = {
                        "op": op,
                        "axes": label,
                        "mesh_axes": list(axes),
                        "n": n,
                        "dtype": dtype_name,
                        "size_bytes": nbytes,
                        "count": count,
                        "time_us": t * 1e6,
                        "time_min_us": min(times) * 1e6,
                        "algbw_GBps": alg / 1e9,
                        "busbw_GBps": bus / 1e9,
                    }
                    rows.append(row)
                    del x
                    if on_row:
                        on_row(row)
    return rows


def peak_busbw(rows: list[dict]) -> dict[str, dict[str, float]]:
    """op -> {axes: busbw at the largest size measured (GB/s)}; the numbers to compare per axis."""
    out: dict[str, dict[str, float]] = {}
    biggest = {}
    for r in rows:
        key = (r["op"], r["axes"])
        if key not in biggest or r["size_bytes"] >= biggest[key]["size_bytes"]:
            biggest[key] = r
    for (op, axes), r in biggest.items():
        out.setdefault(op, {})[axes] = max(out.get(op, {}).get(axes, 0.0), r["busbw_GBps"])
    return out


def _human(nbytes: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= k and nbytes % k == 0:
            return f"{nbytes // k}{unit}"
    return f"{nbytes}B" if nbytes < 1 << 10 else f"{nbytes / (1 << 20):.2f}M"


HEADER = (
    f"{'op':<15}{'axes':<16}{'n':>4}  {'dtype':<9}{'size':>8}{'count':>12}"
    f"{'time_us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['op']:<15}{r['axes']:<16}{r['n']:>4}  {r['dtype']:<9}"
        f"{_human(r['size_bytes']):>8}{r['count']:>12}"
        f"{r['time_us']:>12.1f}{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}"
    )


def make_parser() -> argparse.ArgumentParser:
    p = ArgParser(
        prog="python -m mesh.bench", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument(
        "--mesh", default="", help="mesh spec, e.g. data=4,model=2 (default: all devices on data)"
    )
    p.add_argument(
        "--mesh-dcn", default="", help="the part of each axis that spans hosts, e.g. data=2"
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument(
        "--sizes", default="1K:16M", help="MIN:MAX[:FACTOR] (default factor 4) or a list 4K,1M"
    )
    p.add_argument("--dtypes", default="float32", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument(
        "--axes",
        default=None,
        help="comma list of mesh axes and/or 'all' (default: every axis of size > 1, and all)",
    )
    p.add_argument(
        "--iters",
        type=number(int, ">=1"),
        default=20,
        help="timed runs per point (median reported)",
    )
    p.add_argument(
        "--warmup",
        type=number(int, ">=0"),
        default=3,
        help="untimed runs first (compile, allocation)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--cpu-devices",
        type=number(int, ">=0"),
        default=0,
        help="fake CPU devices to create (CPU only; 0 = as configured)",
    )
    p.add_argument(
        "--coordinator",
        default="",
        help="HOST:PORT of process 0 (multi-process); empty = auto-detect",
    )
    p.add_argument("--num-processes", type=number(int, ">=1"), default=1)
    p.add_argument("--process-id", type=number(int, ">=0"), default=0)
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    return _main(make_parser().parse_args(sys.argv[1:] if argv is None else argv))


def _mesh(args):
    """The mesh the collectives run on, after joining the other processes where there are any."""
    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from mesh.build import init_distributed, make_mesh

    if args.coordinator or args.num_processes > 1:
        init_distributed(args.coordinator or None, args.num_processes, args.process_id)
    else:
        init_distributed()
    return make_mesh(args.mesh, args.mesh_dcn)


def _print_peak(peak: dict[str, dict[str, float]], groups) -> None:
    """The peak bus bandwidth as a table: one row per op, one column per axes group."""
    print(
        "# busbw GB/s at the largest size, per axes"
        " (a slow link shows as one axes column far below the rest)"
    )
    labels = [label for label, _ in groups]
    print(f"{'op':<15}" + "".join(f"{lab:>16}" for lab in labels))
    for op, by_axes in peak.items():
        print(f"{op:<15}" + "".join(f"{by_axes.get(lab, float('nan')):>16.3f}" for lab in labels))


def _main(args) -> int:
    ops = _choices("--ops", args.ops, OPS)
    dtypes = _choices("--dtypes", args.dtypes, DTYPES)
    sizes = parse_sizes(args.sizes)
    mesh = _mesh(args)
    import jax

    from mesh.spec import mesh_text

    groups = axis_groups(dict(mesh.shape), args.axes)
    main_proc = jax.process_index() == 0
    info = {
        "mesh": mesh_text(mesh.shape),
        "devices": mesh.devices.size,
        "processes": jax.process_count(),
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "iters": args.iters,
        "warmup": args.warmup,
    }
    text = main_proc and not args.json
    if text:
        print(
            f"# mesh {info['mesh']}: {info['devices']} {info['device_kind']} devices,"
            f" {info['processes']} process(es); median of {args.iters} runs after"
            f" {args.warmup} warm-up; size = larger per-device buffer"
        )
        print(HEADER, flush=True)
    on_row = (lambda r: print(format_row(r), flush=True)) if text else None
    rows = run(mesh, ops, groups, sizes, dtypes, args.iters, args.warmup, on_row=on_row)
    peak = peak_busbw(rows)
    if main_proc and args.json:
        print(json.dumps({**info, "results": rows, "peak_busbw_GBps": peak}))
    elif main_proc:
        _print_peak(peak, groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
