"""Where a run's metric records go: metrics.jsonl, TensorBoard, Weights & Biases, and the console
(a tqdm bar, or one plain line per logged step for cluster logs).

Every sink is `log(record)` and `close()` (the `Sink` protocol); MetricsLogger
(train/run/metrics.py) holds a list of them and knows nothing of any one. A tracker reads what it
needs from the run directory, which the run has written before its first record: config.json (the
run's whole config: its own option too), plan.json when the user saved one there. So a tracker such
as MLflow is one class here and one line in `trackers`, not a change to the loop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import sys
import tempfile
from collections.abc import Callable
from typing import Protocol

from checkpoint import storage
from errors import UserError
from train.core.run_sections import check_tensorboard, check_tracker, check_wandb_mode

WANDB_ID = "wandb_id"  # in the run directory: the W&B run a resumed or restarted run continues


class Sink(Protocol):
    def log(self, record: dict) -> None: ...

    def close(self) -> None: ...


def read_json(path: str) -> dict:
    """The JSON object in `path`; {} when there is none (a tracker runs without what it lacks)."""
    try:
        data = json.loads(storage.read_text(path))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def trackers(run_dir: str) -> list[Sink]:
    """The trackers the run's config.json turns on."""
    config = read_json(storage.join(run_dir, "config.json"))
    project = config.get("logging", {}).get("wandb", "")
    return [WandbSink(run_dir, project, config)] if project else []


def numbers(record: dict) -> dict:
    """The record's numeric values other than the step (what a tracker plots)."""
    return {
        k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


# ------------------------------------------------------------------ files


class JsonlSink:
    """metrics.jsonl: one JSON object per record, flushed at once (a reader tails it; on an object
    store: uploaded every half minute, see checkpoint/storage.py). JSON has no NaN: `encode`
    (train.run.metrics.json_safe, which summary.json shares) makes a record writable."""

    def __init__(self, run_dir: str, encode: Callable[[dict], dict]):
        self.f, self.encode = storage.AppendLog(storage.join(run_dir, "metrics.jsonl")), encode

    def log(self, record: dict) -> None:
        try:
            self.f.write(json.dumps(self.encode(record), allow_nan=False) + "\n")
        except OSError as e:
            raise UserError(
                f"--run-dir: cannot write {self.f.name} ({e.strerror}); free space or"
                f" choose another --run-dir, then run the same command again to resume"
            ) from None

    def close(self) -> None:
        self.f.close()


def _summary_writer(log_dir: str):
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch only to
    accept torch tensors (this logger passes floats), and that import costs ~3 s of every run's
    start-up wherever torch is installed. A torch the process already imported is left as it is."""
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's fallback
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter(log_dir, flush_secs=10)


class TensorBoardSink:
    """<run_dir>/tb: every numeric value of a record as a scalar at its step."""

    def __init__(self, run_dir: str):
        check_tensorboard(run_dir)
        # tensorboardX writes gs:// and s3:// itself
        self.writer = _summary_writer(storage.join(run_dir, "tb"))

    def log(self, record: dict) -> None:
        for k, v in numbers(record).items():
            self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.writer.close()


# ------------------------------------------------------------------ trackers


class WandbSink:
    """--logging.wandb PROJECT: the records, the config (and plan.json's report if the run directory
    holds one), and the report's plots at the end. The run id is kept in <run_dir>/wandb_id, so
    a resumed or supervised restart continues the same W&B run (resume="allow"); W&B ignores the
    records of steps it already has, which a resume from an earlier checkpoint logs again.
    WANDB_MODE=offline and WANDB_DIR work as W&B documents them (default dir: the run directory)."""

    def __init__(self, run_dir: str, project: str, config: dict):
        check_tracker("--logging.wandb", "wandb", "wandb")
        check_wandb_mode()
        import wandb

        self.run_dir, self.wandb = run_dir, wandb
        id_path = storage.join(run_dir, WANDB_ID)
        run_id = storage.read_text(id_path).strip() if storage.isfile(id_path) else ""
        if not run_id:
            run_id = secrets.token_hex(6)  # W&B run ids: letters and digits
            storage.write_text(id_path, run_id + "\n")
        plan = read_json(storage.join(run_dir, "plan.json"))
        # W&B's own files need a local disk
        local_dir = run_dir if storage.is_local(run_dir) else None
        try:
            self.run = wandb.init(
                project=project,
                id=run_id,
                resume="allow",
                dir=os.environ.get("WANDB_DIR") or local_dir,
                name=storage.basename(storage.absolute(run_dir)),
                allow_val_change=True,
                config={**config, **({"plan": plan} if plan else {})},
            )
        except wandb.errors.Error as e:  # not logged in, no network, a project name W&B refuses
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"--logging.wandb {project}: W&B did not start ({first}); run `wandb login`, or set"
                f" WANDB_MODE=offline and `wandb sync` later"
            ) from None

    def log(self, record: dict) -> None:
        self.run.log(numbers(record), step=record["step"])

    def close(self) -> None:
        """The report's plots (train/run/report.py, when matplotlib is installed), then the run
        ends."""
        from train.run.goodput import read_records
        from train.run.report import plot

        records = sorted(read_records(self.run_dir), key=lambda r: r["step"])
        if records and importlib.util.find_spec("matplotlib") is not None:
            with tempfile.TemporaryDirectory() as out:
                made = plot(records, out)
                self.run.log(
                    {
                        f"report/{name.removesuffix('.png')}": self.wandb.Image(
                            os.path.join(out, name), caption=title
                        )
                        for title, name in made
                    }
                )
        self.run.finish()


# ------------------------------------------------------------------ the console


class ProgressBar:
    """A tqdm bar on stderr with the last loss, tokens/s and MFU."""

    def __init__(self, total_steps: int, first_step: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if "loss" in record:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                tok_s=f"{record['tokens_per_sec']:.0f}",
                mfu=f"{100 * record['mfu']:.1f}%",
                refresh=False,
            )

    def advance(self, steps: int) -> None:
        self.bar.update(steps)

    def print(self, msg: str) -> None:
        self.bar.write(msg)

    def close(self) -> None:
        self.bar.close()


class ProgressLines:
    """One plain line per logged step on stdout, for logs that are files (SLURM, Kubernetes):
    `step 120 | loss 2.254 | 3,114 tok/s | mfu 31.3% | data 0.2%`."""

    def log(self, record: dict) -> None:
        print(step_line(record), flush=True)

    def advance(self, steps: int) -> None:
        pass  # the lines are the progress

    def print(self, msg: str) -> None:
        print(msg, flush=True)

    def close(self) -> None:
        pass


OBJECTIVE_EVALS = (
    ("eval/loss", "eval loss"),
    ("eval/accuracy", "acc"),
    ("eval/margin", "margin"),
    ("eval/reward_mean", "eval reward"),
    ("eval/pass_rate", "pass"),
)


def eval_set_losses(record: dict) -> list[str]:
    """['chat 1.876', ...]: each --data.eval_source set's loss in a record (`eval/NAME/loss`; an
    objective's own `eval/loss` is not a set's)."""
    return [
        f"{k.split('/')[1]} {v:.3f}"
        for k, v in record.items()
        if k.startswith("eval/")
        and k.count("/") == 2
        and k.endswith("/loss")
        and isinstance(v, float)
    ]


def step_line(record: dict) -> str:
    """A record as one line: a step's loss, throughput, MFU and data wait (then its peak device
    memory and the slowest process's step time over the median, when it has them), or an eval."""
    sets = eval_set_losses(record)
    if "eval_loss" in record or sets or any(k in record for k, _ in OBJECTIVE_EVALS):
        parts = [f"step {record['step']}"]
        if "eval_loss" in record:
            parts += [f"eval loss {record['eval_loss']:.3f}", f"ppl {record['eval_ppl']:.2f}"]
        # a post-training objective's held-out figures (train/run/loop.py)
        parts += [f"{label} {record[k]:.3f}" for k, label in OBJECTIVE_EVALS if k in record]
        return " | ".join(parts + [f"eval {s}" for s in sets])
    parts = [
        f"step {record['step']}",
        f"loss {record['loss']:.3f}",
    ]
    if "post/margin" in record:  # a preference objective's (train/core/pair_loss.py)
        parts += [f"margin {record['post/margin']:.3f}", f"acc {record['post/accuracy']:.2f}"]
    if "grpo/reward_mean" in record:  # grpo's (train/run/rollouts.py)
        parts += [
            f"reward {record['grpo/reward_mean']:.3f}",
            f"rollout {100 * record['grpo/rollout_share']:.0f}%",
        ]
    parts += [
        f"{record['tokens_per_sec']:,.0f} tok/s",
        f"mfu {100 * record['mfu']:.1f}%",
        f"data {100 * record['data_wait_s'] / max(record['step_time_s'], 1e-12):.1f}%",
    ]
    if isinstance(record.get("mem_peak_bytes"), (int, float)):
        parts.append(f"mem {record['mem_peak_bytes'] / 2**30:.2f} GiB")
    # a single process has nobody to compare with: its ratio is exactly 1 and says nothing
    if (
        isinstance(record.get("step_time_max_over_median"), (int, float))
        and record["step_time_max_over_median"] != 1.0
    ):
        parts.append(f"slowest {record['step_time_max_over_median']:.2f}x median")
    return " | ".join(parts)


class Quiet(ProgressLines):
    """--logging.progress none: no step lines; the start, warning and summary lines still print."""

    def log(self, record: dict) -> None:
        pass


def console(mode: str, total_steps: int, first_step: int):
    """The console sink of `progress_mode`'s answer."""
    return {
        "bar": lambda: ProgressBar(total_steps, first_step),
        "lines": ProgressLines,
        "none": Quiet,
    }[mode]()
