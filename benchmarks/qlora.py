"""QLoRA (--lora.base_dtype int8|nf4) against a bfloat16 LoRA base: the base's bytes per device
measured from the compiled step, the step time on CPU, and (`quality`) the final eval loss of a
small fine-tune.

    python benchmarks/qlora.py memory [--presets default,1b] [--mesh fsdp=8] [--block-size 64]
    python benchmarks/qlora.py speed [--reps 3] [--steps 3]
    python benchmarks/qlora.py quality [--base-steps 240] [--tune-steps 120] [--out DIR]

memory: the step of a rank-16 LoRA run (all seven projections adapted; QLoRA also with
--lora.quantize_embeddings) compiled for 8 fake CPU devices against abstract arrays (nothing
allocated), bfloat16 compute (so the unquantised rest of a quantised base, embedding, head and
norms, is bfloat16 as on a GPU), batch 8 x 128. The base's bytes per device are the compiled
program's argument bytes less the state's and the batch's (the same adapters, optimizer state and
batch in each mode); `plan`'s formula beside them.

speed: the default preset on one CPU device (float32 compute where the CPU has no bf16 matmul),
batch 8 x 256, rank 16; the median of every timed step, the modes interleaved rep by rep (each rep
`--steps` steps after one untimed) so a load change on the shared machine hits all alike.

quality: the default preset pretrained from scratch on this interpreter's standard library (the
project's default data) for `--base-steps`, then fine-tuned for `--steps` on a different domain,
the prose of Python's own documentation (pydoc_data.topics, shipped with every CPython: public,
offline), written to a text file: full fine-tuning, LoRA r=16 on a bfloat16 base, and QLoRA with
int8 and NF4 bases; the eval loss on held-out documentation every 25 steps, the curves to a PNG.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import common  # noqa: F401  (8 fake devices, repo on sys.path)
import jax
import numpy as np

from mesh.build import make_mesh
from mesh.rules import axis_rules
from plan.estimate import evaluate
from plan.hardware import cpu_profile
from plan.run_spec import local_bytes
from train.core import lora
from train.core.config import build
from train.core.setup import abstract_batch, abstract_state, compile_step, create_state, setup
from train.run.loop import Trainer

FORMATS = ("bfloat16", "int8", "nf4")
# memory: also with --lora.quantize_embeddings (the embedding and head quantised too)
MEMORY_MODES = (*FORMATS, "int8+embeddings", "nf4+embeddings")
LORA = {
    "lora.rank": 16,
    "lora.alpha": 32.0,
    "lora.allow_random_base": True,
    "data.source": "synthetic",
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.progress": False,
    "logging.tensorboard": False,
}


def memory(presets: list[str], mesh_spec: str, block: int = 64) -> list[dict]:
    rows = []
    mesh = make_mesh(mesh_spec)
    for preset in presets:
        for label in MEMORY_MODES:
            fmt, emb = label.split("+")[0], label.endswith("+embeddings")
            over = {**LORA, "model.preset": preset, "model.dtype": "bfloat16"}
            over |= {"lora.base_dtype": fmt, "train.batch_size": 8, "train.seq_len": 128}
            over |= {"lora.quantize_embeddings": emb, "lora.block_size": block}
            over |= {"parallelism.mesh": mesh_spec, "train.skip_memory_check": True}
            cfg = build(over)
            s = setup(cfg, mesh)
            t0 = time.perf_counter()
            compiled = compile_step(s)
            args = compiled.memory_analysis().argument_size_in_bytes
            other = sum(
                local_bytes(x) for x in jax.tree.leaves((abstract_state(s), abstract_batch(s)))
            )
            held = lora.abstract_base(cfg, s.base_shardings)
            sizes = {k: int(v) for k, v in mesh.shape.items()}
            est = evaluate(
                cfg.model, sizes, cpu_profile(mesh.size, "bfloat16"), 8, 128,
                train_cfg=cfg.train, lora_cfg=cfg.lora, platform="gpu",
            )  # fmt: skip
            rows.append(
                {
                    "preset": preset,
                    "base_dtype": label,
                    "compiled_base_bytes": args - other,
                    "held_base_bytes": sum(local_bytes(x) for x in jax.tree.leaves(held)),
                    "plan_base_bytes": est["memory"]["base"],
                    "plan_merge_bytes": est["memory"]["merge"],
                    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                    "compile_s": time.perf_counter() - t0,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def memory_table(rows: list[dict], mesh_spec: str) -> str:
    lines = [
        f"base bytes per device on {mesh_spec} (MiB), rank 16, bfloat16 compute, batch 8 x 128",
        "| preset | base | compiled base | ratio to bfloat16 | plan formula | plan dequant/merge"
        " temporary | compiled temp |",
        "|---|---|---|---|---|---|---|",
    ]
    ref = {r["preset"]: r["compiled_base_bytes"] for r in rows if r["base_dtype"] == "bfloat16"}
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['base_dtype']} | {r['compiled_base_bytes'] / 2**20:.2f}"
            f" | {r['compiled_base_bytes'] / ref[r['preset']]:.4f}"
            f" | {r['plan_base_bytes'] / 2**20:.2f} | {r['plan_merge_bytes'] / 2**20:.2f}"
            f" | {r['temp_bytes'] / 2**20:.2f} |"
        )
    return "\n".join(lines)


class Mode:
    """One LoRA run of the default preset on one device: compiled step, state, batch, base."""

    def __init__(self, fmt: str, run_dir: str):
        self.fmt, self.times = fmt, []
        over = {**LORA, "model.preset": "default", "lora.base_dtype": fmt}
        over |= {"train.batch_size": 8, "train.seq_len": 256, "logging.run_dir": run_dir}
        self.tr = Trainer(build(over), devices=jax.devices()[:1])
        s = self.tr.setup
        self.state = create_state(s)
        tok = np.random.default_rng(0).integers(0, 256, (8, 257)).astype(np.int32)
        batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:], "weights": np.ones((8, 256))}
        self.batch = jax.device_put(batch, s.batch_sharding)
        self.base = lora.load_base(s.cfg, s.mesh, s.rules, s.base_shardings, {})[0]
        self.fn = compile_step(s, self.state, self.batch)

    def run(self, steps: int) -> None:
        with jax.set_mesh(self.tr.setup.mesh), axis_rules(self.tr.setup.rules):
            for i in range(steps + 1):
                t0 = time.perf_counter()
                self.state, m = self.fn(self.state, self.batch, self.base)
                jax.block_until_ready(m["loss"])
                if i:
                    self.times.append(time.perf_counter() - t0)


def speed(reps: int, steps: int) -> str:
    with tempfile.TemporaryDirectory() as d:
        modes = [Mode(fmt, f"{d}/{fmt}") for fmt in FORMATS]
        for _ in range(reps):
            for mode in modes:
                mode.run(steps)
    ref = statistics.median(modes[0].times)
    lines = [
        f"default preset, one CPU device, batch 8 x 256, rank 16; median of {reps} x {steps}"
        " interleaved steps",
        "| base | s/step | vs bfloat16 LoRA |",
        "|---|---|---|",
    ]
    for m in modes:
        t = statistics.median(m.times)
        lines.append(f"| {m.fmt} | {t:.4f} | {t / ref:.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("memory", "speed", "quality"))
    ap.add_argument("--presets", default="default,1b")
    ap.add_argument("--mesh", default="fsdp=8")
    ap.add_argument("--block-size", type=int, default=64, help="memory: --lora.block_size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--base-steps", type=int, default=240)
    ap.add_argument("--tune-steps", type=int, default=120)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.what == "memory":
        rows = memory(a.presets.split(","), a.mesh, a.block_size)
        print(memory_table(rows, a.mesh))
    elif a.what == "speed":
        print(speed(a.reps, a.steps))
    else:
        from qlora_quality import quality  # the fine-tuning comparison, its own file

        print(quality(a.base_steps, a.tune_steps, a.out or os.path.join(os.getcwd(), "qlora")))


if __name__ == "__main__":
    main()
