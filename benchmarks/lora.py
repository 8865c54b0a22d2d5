"""LoRA against full fine-tuning on the same model and mesh (8 fake CPU devices): step time and
per-device memory.

    python benchmarks/lora.py [--mesh fsdp=4,model=2] [--layers 2] [--vocab 8192] [--rank 16]
        [--reps 3] [--steps 3]

The model is the 125m preset's layer shape (d_model 768, 12 heads, d_ff 2048) cut to `--layers`
layers and a `--vocab` vocabulary, so that both steps run on 2 CPU cores in about a minute; float32,
batch 8 x 128 tokens. LoRA adapts q,k,v,o,gate,up,down at `--rank` (alpha 2 x rank) on a random
frozen base (the base's values do not change the step's work). Step time: the median of every timed
step, the two modes interleaved rep by rep (each rep `--steps` steps after one untimed), so a load
change on the shared machine hits both alike; the process's CPU seconds per step (all XLA threads),
which other processes' load inflates less than wall time; and the compiled FLOPs per device. Memory
per device: `plan`'s accounting of the state (trainable params, their gradients and optimizer state,
the LoRA run's frozen base) and what the compiler measured for the compiled step (memory_analysis:
arguments, i.e. the state, base and batch the step takes, and temporaries; the outputs alias the
donated state).
"""

import argparse
import json
import statistics
import tempfile
import time

import common  # noqa: F401  (8 fake devices, repo on sys.path)
import jax
import numpy as np

from mesh.rules import axis_rules
from plan.report import analyze
from train.core import lora
from train.core.config import build
from train.core.setup import compile_step, create_state
from train.run.loop import Trainer

# the layers unrolled (scan_layers false): XLA's cost analysis counts a loop body once, so only then
# are the compiled FLOPs every layer's
SHAPE = {
    "model.preset": "125m",
    "model.dtype": "float32",
    "model.param_dtype": "float32",
    "model.max_seq_len": 128,
    "model.scan_layers": False,
    "train.batch_size": 8,
    "train.seq_len": 128,
    "data.source": "synthetic",
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.progress": False,
    "logging.tensorboard": False,
}
TARGETS = "q,k,v,o,gate,up,down"


class Mode:
    """One run (full or LoRA): its Trainer, compiled step, state, batch and (LoRA) frozen base."""

    def __init__(self, name: str, over: dict, run_dir: str):
        self.name, self.times, self.cpu_times = name, [], []
        self.tr = Trainer(build({**SHAPE, **over, "logging.run_dir": run_dir}))
        cfg = self.tr.cfg
        self.state = create_state(self.tr.setup)
        tok = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 129)).astype(np.int32)
        self.batch = jax.device_put(
            {
                "inputs": tok[:, :-1],
                "targets": tok[:, 1:],
                "weights": np.ones((8, 128), np.float32),
            },
            self.tr.setup.batch_sharding,
        )
        self.base, s = (), self.tr.setup
        if lora.enabled(cfg.lora):  # a random base: --lora.allow_random_base
            self.base = (lora.load_base(cfg, s.mesh, s.rules, s.base_shardings, {})[0],)
        t0 = time.perf_counter()
        self.fn = compile_step(self.tr.setup, self.state, self.batch)
        self.compile_s = time.perf_counter() - t0
        self.measured = self.fn.memory_analysis()
        report = analyze(self.tr.setup)
        self.plan, self.flops = report["memory"], report["flops_per_step_per_device_compiled"]

    def run(self, steps: int) -> None:
        """One untimed step, then `steps` timed ones (each to a host sync of its loss)."""
        with jax.set_mesh(self.tr.setup.mesh), axis_rules(self.tr.setup.rules):
            for i in range(steps + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                self.state, m = self.fn(self.state, self.batch, *self.base)
                jax.block_until_ready(m["loss"])
                if i:
                    self.times.append(time.perf_counter() - t0)
                    self.cpu_times.append(time.process_time() - c0)
        self.loss = float(m["loss"])

    def row(self) -> dict:
        p, mem = self.plan, self.measured
        trainable = sum(x.size for x in jax.tree.leaves(self.state.params))
        return {
            "mode": self.name,
            "trainable_params": int(trainable),
            "step_s": statistics.median(self.times),
            "step_s_all": self.times,
            "cpu_s": statistics.median(self.cpu_times),
            "compiled_flops_per_device": self.flops,
            "compile_s": self.compile_s,
            "final_loss": self.loss,
            "plan": {
                "params": p["params_bytes"],
                "frozen_base": p["base_bytes"],
                "gradients": p["gradient_bytes"],
                "optimizer": p["optimizer_bytes"],
                "total": p["params_bytes"]
                + p["base_bytes"]
                + p["gradient_bytes"]
                + p["optimizer_bytes"],
            },
            "measured": {
                "argument": mem.argument_size_in_bytes,
                "temp": mem.temp_size_in_bytes,
                "output": mem.output_size_in_bytes,
                "alias": mem.alias_size_in_bytes,
            },
        }


def table(rows: list[dict], a) -> str:
    def mib(b: float) -> str:
        return f"{b / 2**20:.2f}"

    lines = [
        f"benchmarks/lora.py: 125m layer shape, {a.layers} layers, vocab {a.vocab},"
        f" batch 8 x 128, float32, mesh {a.mesh}; median of {a.reps} x {a.steps} interleaved"
        " steps; memory in MiB per device",
        "| mode | trainable params | s/step | CPU s/step | compiled GFLOP/device | plan params"
        " | plan frozen base | plan grads | plan optimizer | plan total | measured arguments"
        " | measured temp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, m = r["plan"], r["measured"]
        lines.append(
            f"| {r['mode']} | {r['trainable_params'] / 1e6:.2f}M | {r['step_s']:.3f}"
            f" | {r['cpu_s']:.3f} | {r['compiled_flops_per_device'] / 1e9:.1f}"
            f" | {mib(p['params'])} | {mib(p['frozen_base'])} | {mib(p['gradients'])}"
            f" | {mib(p['optimizer'])} | {mib(p['total'])} | {mib(m['argument'])}"
            f" | {mib(m['temp'])} |"
        )
    full, low = rows
    lines.append(
        f"LoRA / full: step time {low['step_s'] / full['step_s']:.2f},"
        f" CPU time {low['cpu_s'] / full['cpu_s']:.2f}, compiled FLOPs"
        f" {low['compiled_flops_per_device'] / full['compiled_flops_per_device']:.2f}, plan total"
        f" {low['plan']['total'] / full['plan']['total']:.2f}, optimizer"
        f" {low['plan']['optimizer'] / full['plan']['optimizer']:.3f}, measured arguments"
        f" {low['measured']['argument'] / full['measured']['argument']:.2f}, temp"
        f" {low['measured']['temp'] / full['measured']['temp']:.2f}"
    )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="fsdp=4,model=2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    shape = {"parallelism.mesh": a.mesh, "model.n_layers": a.layers, "model.vocab_size": a.vocab}
    with tempfile.TemporaryDirectory() as d:
        modes = [
            Mode("full", shape, f"{d}/full"),
            Mode(
                f"LoRA r={a.rank}",
                {
                    **shape,
                    "lora.rank": a.rank,
                    "lora.alpha": 2.0 * a.rank,
                    "lora.targets": TARGETS,
                    "lora.allow_random_base": True,
                },
                f"{d}/lora",
            ),
        ]
        for _ in range(a.reps):
            for mode in modes:
                mode.run(a.steps)
    rows = [m.row() for m in modes]
    print(json.dumps(rows, indent=1) if a.json else table(rows, a))


if __name__ == "__main__":
    main()
