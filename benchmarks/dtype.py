"""Which compute dtype is fastest for the CPU default run? float32 vs bfloat16, interleaved.

    python benchmarks/dtype.py [--steps 16] [--reps 3]

Runs on the devices the environment gives (1 CPU device unless XLA_FLAGS says otherwise), like
the default `python -m train`, and prints what `--model.dtype auto` picks on this host
(models/cpu_dtype.py), to check the rule against the measurement.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import cpu_dtype  # noqa: E402
from train.core.config import build  # noqa: E402
from train.run.loop import Trainer  # noqa: E402


def step_time(dtype: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(
            build(
                {
                    "model.dtype": dtype,
                    "train.steps": steps,
                    "train.eval_every": 0,
                    "train.sample_tokens": 0,
                    "logging.log_every": 4,
                    "logging.progress": False,
                    "logging.tensorboard": False,
                    "logging.run_dir": d,
                }
            )
        )
        tr.fit()
    return statistics.median(r["step_time_s"] for r in tr.history[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    times = {"float32": [], "bfloat16": []}
    for _ in range(a.reps):
        for dt in times:
            times[dt].append(step_time(dt, a.steps))
    for dt, ts in times.items():
        print(f"{dt:<9} {min(ts):.3f} s/step (runs: {', '.join(f'{t:.3f}' for t in ts)})")
    print(f"bfloat16 / float32 step time: {min(times['bfloat16']) / min(times['float32']):.2f}")
    dtype, why = cpu_dtype.auto()
    print(f"--model.dtype auto on this host: {dtype} ({why})")


if __name__ == "__main__":
    main()
