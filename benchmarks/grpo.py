"""GRPO on a laptop CPU in about a minute: a tiny model learns single-digit additions by SFT on
noisy data (every other answer off by one), then GRPO with the exact_match reward on the 100
prompts "a+b=" raises its mean reward. The commands are the ones a user types
(docs/post-training.md); this script runs them in a work directory and reports:

  - the mean reward per window of --window steps (each step's over B x G sampled completions),
  - the rollout figures (tokens/s, the rollout's share of the step),
  - the greedy answers right out of 100, before GRPO and after,
  - with --png PATH, the reward curve as a PNG (matplotlib, if installed).

    python benchmarks/grpo.py [--dir /tmp/brigade-grpo] [--steps 200] [--lr 1e-3] [--png FILE]

The rollout's speed (BENCHMARKS.md): --max-new N samples N tokens a completion (the SFT model ends
its answers after 1-2 digits, so most of a long budget is the EOS stop's to skip), --mesh with
--devices N runs the GRPO step on N fake CPU devices (the sampler's rows split over the batch's),
--keep-sft reuses --dir's SFT run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_data(work: str) -> None:
    rng = random.Random(0)
    with open(f"{work}/sft.jsonl", "w") as sft, open(f"{work}/prompts.jsonl", "w") as prompts:
        for i in range(2000):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            right, wrong = str(a + b), str(a + b + rng.choice([-1, 1]))
            record = {"prompt": f"{a}+{b}=", "completion": right if i % 2 else wrong}
            sft.write(json.dumps(record) + "\n")
        for a in range(10):
            for b in range(10):
                prompts.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def run(work: str, *args: str, devices: int = 0) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    print("$ python", " ".join(args), flush=True)
    out = subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stdout + out.stderr)
    lines = out.stdout.strip().splitlines() or [""]
    print(next((x for x in lines if x.startswith("done:")), lines[-1]), flush=True)


def greedy_right(run_dir: str) -> int:
    """The greedy answers (to the EOS) that equal a + b, of the 100 prompts."""
    import numpy as np

    from checkpoint import hf

    pairs = [(a, b) for a in range(10) for b in range(10)]
    prompts = np.array([list(f"{a}+{b}=".encode()) for a, b in pairs], np.int32)
    out = np.asarray(hf.load_checkpoint(run_dir).generate(prompts, 3)).tolist()
    cut = [row[: next((i for i, t in enumerate(row) if t > 255), 3)] for row in out]
    return sum(bytes(c).decode(errors="replace") == str(a + b) for c, (a, b) in zip(cut, pairs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/brigade-grpo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--png", default="")
    p.add_argument("--max-new", type=int, default=3, help="--post.max_new_tokens")
    p.add_argument("--mesh", default="", help="the GRPO run's --mesh (with --devices)")
    p.add_argument("--devices", type=int, default=0, help="fake CPU devices of the GRPO run")
    p.add_argument("--keep-sft", action="store_true", help="reuse --dir's runs/sft")
    args = p.parse_args()
    work = args.dir
    os.makedirs(work, exist_ok=True)
    write_data(work)
    prep = ("-m", "train.data", "prepare", "--no-progress", "--overwrite")
    run(work, *prep, "sft.jsonl", "--format", "prompt_completion", "--out", "data/sft")
    run(work, *prep, "prompts.jsonl", "--format", "prompts", "--out", "data/prompts")
    keep = args.keep_sft and os.path.isdir(f"{work}/runs/sft")
    # fresh runs, not resumed ones
    shutil.rmtree(f"{work}/runs/grpo" if keep else f"{work}/runs", ignore_errors=True)
    common = ("-m", "train", "--model", "tiny", "--seq-len", "16")
    if not keep:
        run(work, *common, "--data", "data/sft", "--steps", "200", "--run-dir", "runs/sft")
    grpo = ("--objective", "grpo", "--init-from", "runs/sft", "--data", "data/prompts")
    sampling = ("--batch-size", "8", "--post.group_size", "8", "--post.max_new_tokens",
                str(args.max_new), *(("--mesh", args.mesh) if args.mesh else ()))  # fmt: skip
    run(work, *common, *grpo, *sampling, "--steps", str(args.steps), "--lr", args.lr,
        "--log-every", "1", "--run-dir", "runs/grpo", devices=args.devices)  # fmt: skip
    records = [json.loads(x) for x in open(f"{work}/runs/grpo/metrics.jsonl")]
    steps = [r for r in records if "grpo/reward_mean" in r]
    rewards = [r["grpo/reward_mean"] for r in steps]
    w = args.window
    curve = [sum(rewards[i : i + w]) / len(rewards[i : i + w]) for i in range(0, len(rewards), w)]
    print(f"mean reward per {w} steps:", " ".join(f"{x:.3f}" for x in curve))
    late = steps[len(steps) // 2 :]  # past the first steps' compile
    tps = sorted(r["grpo/rollout_tokens_per_sec"] for r in late)[len(late) // 2]
    share = sorted(r["grpo/rollout_share"] for r in late)[len(late) // 2]
    secs = sorted(r["grpo/rollout_s"] for r in late)[len(late) // 2]
    print(f"rollout: {tps:,.0f} tokens/s, {1e3 * secs:.1f} ms, {100 * share:.0f}% of the step"
          " (medians)")  # fmt: skip
    if "grpo/decode_steps" in late[0]:
        steps_run = sorted(r["grpo/decode_steps"] for r in late)[len(late) // 2]
        print(f"decode steps: {steps_run:.0f} of {args.max_new} (median)")
    print(f"greedy right: SFT {greedy_right(f'{work}/runs/sft')} / 100,"
          f" GRPO {greedy_right(f'{work}/runs/grpo')} / 100")  # fmt: skip
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(rewards) + 1), rewards, lw=0.6, alpha=0.5, label="per step")
        ax.plot([w * i + w / 2 for i in range(len(curve))], curve, "o-", label=f"mean of {w}")
        ax.set(xlabel="GRPO step", ylabel="mean exact_match reward", ylim=(0, 1))
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
        print("wrote", args.png)


if __name__ == "__main__":
    main()
