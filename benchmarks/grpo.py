"""GRPO on a laptop CPU in about a minute: a tiny model learns single-digit additions by SFT on
noisy data (every other answer off by one), then GRPO with the exact_match reward on the 100
prompts "a+b=" raises its mean reward. The commands are the ones a user types
(docs/post-training.md); this script runs them in a work directory and reports:

  - for each --post.updates_per_rollout N of --updates (1; e.g. 1,2 to compare), the mean
    reward per window of --window steps (each step's over B x G sampled completions), the
    held-out reward (greedy completions of the --eval-fraction held-out prompts, every
    --eval-every steps), the rollout figures and the clip fraction of the reused rollouts,
  - the greedy answers right out of 100, before GRPO and after,
  - with --png PATH, the reward curves as a PNG (matplotlib, if installed).

    python benchmarks/grpo.py [--dir /tmp/brigade-grpo] [--steps 200] [--lr 1e-3]
        [--updates 1,2] [--png FILE] [--max-new N] [--mesh M --devices N] [--keep-sft]

The rollout's speed (BENCHMARKS.md): --max-new N samples N tokens a completion (the SFT model ends
its answers after 1-2 digits, so most of a long budget is the EOS stop's to skip), --mesh with
--devices N runs the GRPO step on N fake CPU devices (the sampler's rows split over the batch's),
--keep-sft reuses --dir's SFT run.
"""

from __future__ import annotations

import argparse
import glob
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


def grpo_run(work: str, args, n: int) -> dict:
    """GRPO from runs/sft at N updates per rollout -> its logged figures."""
    common = ("-m", "train", "--model", "tiny", "--seq-len", "16")
    grpo = ("--objective", "grpo", "--init-from", "runs/sft", "--data", "data/prompts")
    sampling = ("--batch-size", "8", "--post.group_size", "8", "--post.max_new_tokens",
                str(args.max_new), *(("--mesh", args.mesh) if args.mesh else ()))  # fmt: skip
    held_out = ("--data.eval_fraction", args.eval_fraction, "--eval-every", str(args.eval_every))
    name = f"runs/grpo_n{n}"
    updates = ("--post.updates_per_rollout", str(n), "--steps", str(args.steps), "--lr", args.lr)
    run(work, *common, *grpo, *sampling, *held_out, *updates, "--log-every", "1", "--run-dir", name,
        devices=args.devices)  # fmt: skip
    records = [json.loads(x) for x in open(f"{work}/{name}/metrics.jsonl")]
    steps = [r for r in records if "grpo/reward_mean" in r]
    evals = [r for r in records if "eval/reward_mean" in r]
    summary = json.load(open(f"{work}/{name}/summary.json"))
    rewards = [r["grpo/reward_mean"] for r in steps]
    w = args.window
    curve = [sum(rewards[i : i + w]) / len(rewards[i : i + w]) for i in range(0, len(rewards), w)]
    print(f"N={n}: mean reward per {w} steps:", " ".join(f"{x:.3f}" for x in curve))
    print(f"N={n}: held-out greedy reward at steps", " ".join(
        f"{r['step']}:{r['eval/reward_mean']:.3f}" for r in evals))  # fmt: skip
    late = [r for r in steps[len(steps) // 2 :] if r["grpo/rollout_tokens"]]  # past the compile
    tps = sorted(r["grpo/rollout_tokens_per_sec"] for r in late)[len(late) // 2]
    clip = [r["grpo/clip_fraction"] for r in steps if not r["grpo/rollout_tokens"]]
    clip_mean = sum(clip) / max(len(clip), 1)
    print(f"N={n}: rollout {tps:,.0f} tokens/s (median), {len(late)} rollouts in the second"
          f" half; clip fraction on reused rollouts {clip_mean:.3f} (mean)")  # fmt: skip
    steps_run = sorted(r["grpo/decode_steps"] for r in late)[len(late) // 2]
    print(f"N={n}: decode steps {steps_run:.0f} of {args.max_new} (median)")
    print(f"N={n}: greedy right {greedy_right(f'{work}/{name}')} / 100; run"
          f" {summary.get('wall_s', float('nan')):.1f} s")  # fmt: skip
    return {"rewards": rewards, "curve": curve, "evals": evals}


def plot(path: str, runs: dict, w: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for n, r in runs.items():
        (line,) = left.plot([w * i + w / 2 for i in range(len(r["curve"]))], r["curve"], "o-")
        line.set_label(f"updates_per_rollout {n}")
        left.plot(range(1, len(r["rewards"]) + 1), r["rewards"], lw=0.4, alpha=0.3,
                  color=line.get_color())  # fmt: skip
        right.plot([e["step"] for e in r["evals"]], [e["eval/reward_mean"] for e in r["evals"]],
                   "o-", color=line.get_color(), label=f"updates_per_rollout {n}")  # fmt: skip
    left.set(xlabel="optimizer step", ylabel="sampled exact_match reward", ylim=(0, 1))
    right.set(xlabel="optimizer step", ylabel="held-out greedy reward", ylim=(0, 1))
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print("wrote", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/brigade-grpo")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", default="1e-3")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--updates", default="1", help="--post.updates_per_rollout values, e.g. 1,2")
    p.add_argument("--eval-fraction", default="0.2", help="held-out share of the prompts")
    p.add_argument("--eval-every", type=int, default=20)
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
    for old in glob.glob(f"{work}/runs/grpo_n*") if keep else [f"{work}/runs"]:
        shutil.rmtree(old, ignore_errors=True)
    common = ("-m", "train", "--model", "tiny", "--seq-len", "16")
    if not keep:
        run(work, *common, "--data", "data/sft", "--steps", "200", "--run-dir", "runs/sft")
    print(f"greedy right: SFT {greedy_right(f'{work}/runs/sft')} / 100")
    runs = {int(n): grpo_run(work, args, int(n)) for n in args.updates.split(",")}
    if args.png:
        plot(args.png, runs, args.window)


if __name__ == "__main__":
    main()
