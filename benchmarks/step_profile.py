"""Where a train step's time goes: the median step time, then a jax.profiler trace of a few steps
whose per-op times are summed by kind (collectives, the rendezvous and waits around them, the
vocabulary matmuls of the LM head, copies, the rest). Shares are of the device threads' busy time.

    python benchmarks/step_profile.py [--mesh fsdp=8] [--steps 6] [--trace-steps 3]
        [--set section.field=value ...]

The vocabulary matmuls are found in the compiled HLO (XLA:CPU's names): the matmul ops whose
output or an operand has a vocab-sized dim (the logits, and the two gradients of the head).
"""

import argparse
import collections
import glob
import re
import statistics
import tempfile
import time

import common  # sets XLA_FLAGS first
import jax

from mesh.rules import axis_rules
from train.core.config import build
from train.core.setup import jit_step

KINDS = (
    ("collectives", r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"),
    ("rendezvous and waits", r"(Rendezvous|Wait)"),
    ("copies and transposes", r"(copy|transpose)"),
    ("softmax and loss", r"(exponential|log)"),
    ("layer loops", r"while"),
)


def vocab_fusions(hlo: str, vocab: int) -> set[str]:
    """Names of XLA:CPU's matmul ops (`ynn_fusion`: YNNPACK dot fusions, or a plain `dot`) with a
    vocab-sized dim in their output or an operand: the logits and the two gradients of the LM
    head."""
    shapes = dict(re.findall(r"%(\S+) = (\S+\[[\d,]*\])", hlo))

    def has_vocab(shape: str) -> bool:
        return re.search(rf"[\[,]{vocab}[,\]]", shape) is not None

    out = set()
    for name, shape, operands in re.findall(
        r"%((?:ynn_fusion|dot)[.\d]*) = (\S+\[[\d,]*\])[^(]*\(([^)]*)\)", hlo
    ):
        if has_vocab(shape) or any(
            has_vocab(shapes.get(o.strip().lstrip("%"), "")) for o in operands.split(",")
        ):
            out.add(name)
    return out


def shares(trace_dir: str, vocab_ops: set[str]) -> dict[str, float]:
    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    busy = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name:  # the device threads of XLA:CPU
                continue
            for ev in line.events:
                if ev.name.startswith("ThunkExecutor"):
                    continue
                kind = (
                    "vocab matmuls (LM head)"
                    if ev.name in vocab_ops
                    else next(
                        (
                            k
                            for k, pat in KINDS
                            if re.match(pat, ev.name) or re.search(pat, ev.name)
                        ),
                        "other ops",
                    )
                )
                busy[kind] += ev.duration_ns
    total = sum(busy.values()) or 1
    return {k: v / total for k, v in busy.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="fsdp=8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trace-steps", type=int, default=3)
    ap.add_argument(
        "--set", nargs="*", default=[], help="section.field=value overrides of the peer shape"
    )
    args = ap.parse_args()
    cfg = build(
        {**common.PEER, "parallelism.mesh": args.mesh, **dict(kv.split("=", 1) for kv in args.set)}
    )
    s, state, batch = common.state_and_batch(cfg)
    with jax.set_mesh(s.mesh), axis_rules(s.rules):
        step = jit_step(s)
        hlo = step.lower(state, batch).compile().as_text()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(args.trace_steps):
                    state, metrics = step(state, batch)
                    jax.block_until_ready(metrics)
            split = shares(d, vocab_fusions(hlo, cfg.model.vocab_size))
    print(
        f"mesh {args.mesh or '1 device'} ({jax.device_count()} devices), {s.compute_dtype}:"
        f" median step {statistics.median(times):.3f} s over {args.steps}"
    )
    for kind, share in split.items():
        print(f"  {100 * share:5.1f}%  {kind}")


if __name__ == "__main__":
    main()
