"""Where a DPO run's reference log-probabilities should come from: computed in the step (what
--objective dpo does: train/core/pair_loss.py) or precomputed once. Three programs on the same
model, mesh and batch of pairs:

  dpo      the step with the reference's forward inside it
  no-ref   the same step without it (simpo: the policy's forward and backward, a loss of the
           same shape), i.e. the step a precomputed table would leave
  ref fwd  the reference's forward alone (sequence log-probabilities of both sequences): what
           precomputing costs per batch, once per pass over the data

    python benchmarks/preference.py [--mesh fsdp=2] [--preset default] [--pairs 8] [--seq 128]
        [--reps 3] [--steps 3]

Step time: the median of every timed step, the programs interleaved rep by rep (each rep
`--steps` steps after one untimed); memory: the compiled step's arguments (the state, the
reference copy, the batch). Over E passes of N batches, in the step costs E N t(dpo), precomputed
N t(ref fwd) + E N t(no-ref).
"""

import argparse
import math
import statistics
import tempfile
import time

import common  # noqa: F401  (8 fake devices, repo on sys.path)
import jax
import numpy as np

from checkpoint.layout import params_only_meta
from checkpoint.manager import Checkpointer
from mesh.rules import axis_rules
from models import model
from train.core import pair_loss
from train.core.config import build
from train.core.setup import compile_step, create_state
from train.run.loop import Trainer


def pairs(vocab: int, b: int, t: int) -> dict:
    rng, out = np.random.default_rng(0), {}
    for prefix in ("", pair_loss.REJECTED):
        tok = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
        weights = np.zeros((b, t), np.float32)
        weights[:, t // 4 :] = 1  # a prompt of a quarter of the sequence
        out.update({prefix + "inputs": tok[:, :-1], prefix + "targets": tok[:, 1:]})
        out[prefix + "weights"] = weights
    return out


class Program:
    def __init__(self, name: str, shape: dict, objective: str, base: str, params, run_dir: str):
        self.name, self.times = name, []
        over = {**shape, "post.objective": objective, "checkpoint.init_from": base}
        n = math.prod(int(x.partition("=")[2]) for x in shape["parallelism.mesh"].split(","))
        self.tr = Trainer(build({**over, "logging.run_dir": run_dir}), devices=jax.devices()[:n])
        s, cfg = self.tr.setup, self.tr.cfg
        self.batch = jax.device_put(
            pairs(cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seq_len), s.batch_sharding
        )
        self.state = create_state(s)
        self.frozen = () if s.ref_shardings is None else (jax.device_put(params, s.ref_shardings),)
        if name == "ref fwd":  # the reference's forward alone, as a precomputing pass runs it
            ref = (
                self.frozen[0] if self.frozen else jax.device_put(params, s.state_shardings.params)
            )
            fn = jax.jit(lambda p, b: pair_loss.sequence_logps(cfg.model, p, pair_loss.both(b))[0])
            with jax.set_mesh(s.mesh), axis_rules(s.rules):
                self.fn = fn.lower(ref, self.batch).compile()
            self.args, self.arguments = (ref,), None
        else:
            self.fn = compile_step(s, self.state, self.batch)
            self.args, self.arguments = None, self.fn.memory_analysis().argument_size_in_bytes

    def run(self, steps: int) -> None:
        s = self.tr.setup
        with jax.set_mesh(s.mesh), axis_rules(s.rules):
            for i in range(steps + 1):
                t0 = time.perf_counter()
                if self.args is not None:
                    jax.block_until_ready(self.fn(*self.args, self.batch))
                else:
                    self.state, m = self.fn(self.state, self.batch, *self.frozen)
                    jax.block_until_ready(m["loss"])
                if i:
                    self.times.append(time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="fsdp=2")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    shape = {
        "model.preset": a.preset,
        "model.dtype": "float32",
        "parallelism.mesh": a.mesh,
        "train.batch_size": a.pairs,
        "train.seq_len": a.seq,
        "logging.progress": False,
        "logging.tensorboard": False,
    }
    with tempfile.TemporaryDirectory() as d:
        cfg = build({"model.preset": a.preset, "model.dtype": "float32"})
        params = jax.device_get(jax.jit(lambda k: model.init(cfg.model, k))(jax.random.key(0)))
        ck = Checkpointer(f"{d}/base", keep=0, async_save=False)
        ck.save(0, {"params": params}, params_only_meta(0, {"model": cfg.to_dict()["model"]}))
        ck.close()
        programs = [
            Program(name, shape, objective, f"{d}/base", params, f"{d}/{i}")
            for i, (name, objective) in enumerate(
                [("dpo", "dpo"), ("no-ref", "simpo"), ("ref fwd", "dpo")]
            )
        ]
        for _ in range(a.reps):
            for p in programs:
                p.run(a.steps)
    t = {p.name: statistics.median(p.times) for p in programs}
    print(
        f"benchmarks/preference.py: {a.preset}, mesh {a.mesh}, {a.pairs} pairs x 2 x {a.seq}"
        f" tokens, float32; median of {a.reps} x {a.steps} interleaved steps"
    )
    print("| program | s/step | compiled step's arguments (MiB/device) |\n|---|---|---|")
    for p in programs:
        mib = "" if p.arguments is None else f"{p.arguments / 2**20:.2f}"
        print(f"| {p.name} | {t[p.name]:.3f} | {mib} |")
    print(
        f"dpo / no-ref: {t['dpo'] / t['no-ref']:.2f}; (dpo - no-ref) / ref fwd:"
        f" {(t['dpo'] - t['no-ref']) / t['ref fwd']:.2f}"
    )


if __name__ == "__main__":
    main()
