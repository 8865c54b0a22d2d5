"""Context parallelism on one host: the ring against the all-gather strategy
(`--parallelism.context_strategy ring|all_gather`) on the same model, mesh and tokens, per
sequence length. For each length both train steps are compiled in one process and run
alternately (ring, all_gather, all_gather, ring, ...); then one traced step each says how much of
the step the collectives take and how much of their time other work ran beside them.

    python benchmarks/long_context.py [--lengths 4096,8192,16384,32768] [--steps 3]
        [--mesh context=8] [--set section.field=value ...]

Default model: d_model 256, 2 layers, 4 heads (2 KV), d_ff 1024, vocab 4096 (small, so attention
carries the step), batch 1, bfloat16 where the host multiplies it natively (`--model.dtype auto`),
attention by --model.attention's rule (blockwise from 2,048 tokens), synthetic data, 8 fake CPU
devices.

Columns: the median step time and process CPU time per step; `collectives`: the share of the
device threads' busy time in collective ops (the ring's collective-permutes, the all-gathers of
K/V and of the FSDP weights, reductions); `beside`: the part of the collectives' wall time during
which some device thread was computing. XLA:CPU runs a collective as a blocking step of its device's
program, so on a CPU host `beside` is other devices' compute filling the cores while one device
waits, not one device's transfer hidden under its own attention as on GPUs.
"""

import argparse
import collections
import glob
import statistics
import tempfile
import time

import common  # sets XLA_FLAGS first
import jax

from mesh.rules import axis_rules
from train.core.config import build
from train.core.setup import jit_step

MODEL = {
    "model.preset": "tiny",
    "model.d_model": 256,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.d_ff": 1024,
    "model.vocab_size": 4096,
    "train.batch_size": 1,
    "data.source": "synthetic",
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.progress": False,
    "logging.tensorboard": False,
}
COLLECTIVE = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def program(overrides: dict):
    """(compiled step, state, batch) of one config."""
    cfg = build(overrides)
    s, state, batch = common.state_and_batch(cfg)
    with jax.set_mesh(s.mesh), axis_rules(s.rules):
        step = jit_step(s).lower(state, batch).compile()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    return {"step": step, "state": state, "batch": batch, "wall": [], "cpu": []}


def run(p: dict) -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    p["state"], m = p["step"](p["state"], p["batch"])
    jax.block_until_ready(m)
    p["wall"].append(time.perf_counter() - t0)
    p["cpu"].append(time.process_time() - c0)


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(xs: list[tuple[int, int]], ys: list[tuple[int, int]]) -> int:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = total = 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def traced(p: dict) -> dict:
    """One traced step: the collectives' share of busy time and the part of their wall time with
    compute running beside them."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run(p)
        path = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
        busy = collections.Counter()
        comm, compute = [], []
        for plane in jax.profiler.ProfileData.from_file(path).planes:
            for line in plane.lines:
                if "XLAEigen" not in line.name:
                    continue
                for ev in line.events:
                    if ev.name.startswith(("ThunkExecutor", "Wait", "Rendezvous")):
                        continue
                    span = (ev.start_ns, ev.start_ns + ev.duration_ns)
                    is_comm = ev.name.startswith(COLLECTIVE)
                    busy["comm" if is_comm else "compute"] += ev.duration_ns
                    (comm if is_comm else compute).append(span)
    comm_u, compute_u = union(comm), union(compute)
    comm_wall = sum(b - a for a, b in comm_u) or 1
    return {
        "collectives": busy["comm"] / max(sum(busy.values()), 1),
        "beside": overlap(comm_u, compute_u) / comm_wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mesh", default="context=8")
    ap.add_argument("--set", nargs="*", default=[], help="section.field=value overrides")
    a = ap.parse_args()
    print(
        "| tokens | strategy | s/step | CPU s/step | collectives (share of busy) | beside |"
        " ring / all_gather |"
    )
    print("|---|---|---|---|---|---|---|")
    for t in (int(x) for x in a.lengths.split(",")):
        base = {
            **MODEL,
            "parallelism.mesh": a.mesh,
            "model.max_seq_len": t,
            "train.seq_len": t,
            **dict(kv.split("=", 1) for kv in a.set),
        }
        progs = {
            s: program({**base, "parallelism.context_strategy": s}) for s in ("ring", "all_gather")
        }
        order = list(progs.values())
        for i in range(a.steps):
            for p in order if i % 2 == 0 else order[::-1]:
                run(p)
        med = {s: statistics.median(p["wall"]) for s, p in progs.items()}
        for s, p in progs.items():
            tr = traced(p)
            print(
                f"| {t:,} | {s} | {med[s]:.3f} | {statistics.median(p['cpu']):.3f} |"
                f" {tr['collectives']:.1%} | {tr['beside']:.0%} |"
                f" {med['ring'] / med['all_gather']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
