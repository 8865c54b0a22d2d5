"""benchmarks/qlora.py quality: full fine-tuning, LoRA on a bfloat16 base and QLoRA on int8 and NF4
bases (each with the embedding and LM head at the compute dtype and quantised) of the same
pretrained default model, on the same new domain; eval loss curves and a PNG.
Each run is `python -m train` on one CPU device (see benchmarks/qlora.py for the setup)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = ["--lora.rank", "16", "--lora.alpha", "32"]
MODES = {
    "full fine-tune": [],
    "LoRA bfloat16": [*LORA, "--lora.base_dtype", "bfloat16"],
    "QLoRA int8": [*LORA, "--lora.base_dtype", "int8", "--lora.quantize_embeddings", "false"],
    "QLoRA nf4": [*LORA, "--lora.base_dtype", "nf4", "--lora.quantize_embeddings", "false"],
    # the embedding and LM head quantised too
    "QLoRA int8 + embeddings": [
        *LORA,
        *("--lora.base_dtype", "int8", "--lora.quantize_embeddings", "true"),
    ],
    "QLoRA nf4 + embeddings": [
        *LORA,
        *("--lora.base_dtype", "nf4", "--lora.quantize_embeddings", "true"),
    ],
}
LORA_LR = "3e-3"  # the default peak rate; the LoRA modes share it
EVAL = ["--eval-every", "20", "--train.eval_batches", "8", "--train.sample_tokens", "0"]


def _train(flags: list[str], run_dir: str) -> list[dict]:
    """One `python -m train` run on one device -> its metrics.jsonl records."""
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": ROOT}
    cmd = [
        sys.executable,
        "-m",
        "train",
        *flags,
        "--run-dir",
        run_dir,
        "--logging.progress",
        "none",
    ]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _docs(out: str) -> str:
    """Python's documentation prose (pydoc_data.topics: one file per topic) in `out`/docs."""
    from pydoc_data.topics import topics

    d = os.path.join(out, "docs")
    os.makedirs(d, exist_ok=True)
    for name, text in topics.items():
        with open(os.path.join(d, f"{name}.txt"), "w") as f:
            f.write(text)
    return d


def quality(base_steps: int, tune_steps: int, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    docs = _docs(out)
    base_dir = os.path.join(out, "base")
    _train(["--model", "default", "--steps", str(base_steps), "--eval-every", "0"], base_dir)
    base_ckpt = os.path.join(base_dir, "checkpoints", str(base_steps))
    curves = {}
    for name, flags in MODES.items():
        lr = ["--lr", LORA_LR] if flags else []
        run = os.path.join(out, name.replace(" ", "_"))
        common = ["--model", "default", "--data", docs, "--steps", str(tune_steps), *EVAL, *lr]
        records = _train([*common, "--init-from", base_ckpt, *flags], run)
        curves[name] = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        print(name, curves[name][-1], flush=True)
    _plot(curves, os.path.join(out, "qlora_quality.png"))
    with open(os.path.join(out, "curves.json"), "w") as f:
        json.dump(curves, f)
    ref = curves["LoRA bfloat16"][-1][1]
    full = curves["full fine-tune"][-1][1]
    lines = [
        f"default preset pretrained {base_steps} steps on the stdlib, fine-tuned {tune_steps} steps"
        " on pydoc_data.topics (held-out topics evaluated); final eval loss",
        "| mode | eval loss | vs LoRA bfloat16 | vs full fine-tune |",
        "|---|---|---|---|",
    ]
    for name, c in curves.items():
        loss = c[-1][1]
        lines.append(f"| {name} | {loss:.4f} | {loss / ref - 1:+.2%} | {loss / full - 1:+.2%} |")
    return "\n".join(lines)


def _plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        ax.plot([s for s, _ in c], [v for _, v in c], marker="o", ms=3, label=name)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("held-out eval loss (nats/byte)")
    ax.set_title("default preset on Python's documentation prose")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
