"""Throughput, MFU, step statistics, the logger that feeds the metric sinks (train/run/sinks.py) and
the run's summary."""

from __future__ import annotations

import math
import signal
import time

import jax
import numpy as np

from checkpoint import storage
from mesh.spec import mesh_text
from models.flops import param_count
from train.core.run_sections import progress_mode
from train.core.sections import profile_window
from train.run import sinks
from train.run.device_memory import size_text
from train.run.goodput import Goodput, breakdown_text
from train.run.resilience import exit_code


class MetricsLogger:
    """Sends each logged record to the run's sinks (train/run/sinks.py: metrics.jsonl, TensorBoard,
    the trackers its config.json turns on) and to the console (a bar, plain lines, or nothing);
    process 0 only. `progress`: --logging.progress (auto | bar | lines | none)."""

    def __init__(
        self,
        run_dir: str,
        total_steps: int,
        first_step: int = 0,
        *,
        tensorboard: bool = True,
        progress: str = "auto",
    ):
        self.main = jax.process_index() == 0
        self._sinks, self._console = [], None
        if not self.main:
            return
        storage.makedirs(run_dir)
        self._console = sinks.console(progress_mode(progress), total_steps, first_step)
        self._sinks = [
            sinks.JsonlSink(run_dir, json_safe),
            *([sinks.TensorBoardSink(run_dir)] if tensorboard else []),
            *sinks.trackers(run_dir),
            self._console,
        ]

    def log(self, record: dict) -> None:
        for sink in self._sinks:
            sink.log(record)

    def advance(self, steps: int) -> None:
        if self._console is not None:
            self._console.advance(steps)

    def print(self, msg: str) -> None:
        if self._console is not None:
            self._console.print(msg)

    def close(self) -> None:
        # the console first: a tracker's closing lines go below the bar
        for sink in reversed(self._sinks):
            sink.close()
        self._sinks = []


def json_safe(record: dict) -> dict:
    """`record` with non-finite floats as null and their keys listed under "nonfinite": JSON has no
    NaN or Infinity, and a reader of metrics.jsonl must not choke on a diverged step."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


class StepProfiler:
    """--profile.steps A:B: a jax.profiler trace of steps A..B-1 in <run_dir>/profile (open it
    with TensorBoard's profile plugin or ui.perfetto.dev). Each step is a StepTraceAnnotation."""

    def __init__(self, spec: str, steps: int, run_dir: str):
        self.spec, self.window = spec, profile_window(spec, steps)
        self.dir, self.active = storage.join(run_dir, "profile"), False

    def step(self, step: int):
        """Context for running step `step` (1-based): starts the trace at A, annotates inside."""
        import contextlib

        if self.window is None or not self.window[0] <= step < self.window[1]:
            return contextlib.nullcontext()
        if not self.active:
            jax.profiler.start_trace(self.dir)
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, outputs) -> str:
        """Stop once step B-1 has run (waiting for its outputs) -> then the line saying where the
        trace is, else ''."""
        if self.active and step >= self.window[1] - 1:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.active = False
            return (
                f"profile: steps {self.spec} traced into {self.dir} (tensorboard --logdir"
                f" {self.dir}, or open the .trace.json.gz in ui.perfetto.dev)"
            )
        return ""

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class StepStats:
    """Step time, throughput and MFU between logged steps, and each step's split into compute
    (`device_s`: the host blocked on the devices), data wait (`wait_s`) and host overhead (the
    rest). Time the loop spends on saves, evals and recovery (`pause`) is not step time."""

    _KNOWN = (
        "loss",
        "grad_norm",
        "lr",
        "skipped_steps",
        "bad_in_a_row",
        "spike_skipped_steps",
        "spike_in_a_row",
    )

    def __init__(
        self, tokens_per_step: int, flops_per_token: float, peak: float, n_devices: int, step: int
    ):
        self.tokens, self.flops = tokens_per_step, flops_per_token * tokens_per_step
        self.peak, self.n_devices = peak, n_devices
        self.last_step, self.t_last, self.paused_s, self.wait_s = (
            step,
            time.perf_counter(),
            0.0,
            0.0,
        )
        self.device_s = 0.0

    def pause(self, since: float) -> float:
        """Count the time since `since` as not-stepping; -> its length."""
        dt = time.perf_counter() - since
        self.paused_s += dt
        return dt

    def _raise_peak(self, achieved: float, step: int) -> None:
        """The last resort behind the peak's upper bound: a step that ran faster than the peak
        proves the peak wrong (a host that hides its turbo clock), so the peak becomes what was
        achieved, said in one line, rather than an MFU above 100% or a silent clamp."""
        if not self.peak or achieved <= self.peak:
            return
        if jax.process_index() == 0:
            from tqdm import tqdm  # writes above a progress bar, plainly without one

            tqdm.write(
                f"warning: step {step} ran at {achieved / 1e9:.0f} GFLOP/s, above the peak of"
                f" {self.peak / 1e9:.0f} GFLOP/s the MFU is against; MFU is against"
                f" {achieved / 1e9:.0f} GFLOP/s from here (pass --peak-tflops for the true figure)"
            )
        self.peak = achieved

    def record(self, step: int, m: dict, gp: Goodput) -> tuple[dict, int, int]:
        """The metrics.jsonl record for `step` from the fetched step metrics `m`, and the updates
        skipped in a row up to it: for non-finite gradients, and as loss spikes."""
        now = time.perf_counter()
        n = step - self.last_step
        busy = max(now - self.t_last - self.paused_s, 1e-9)
        gp.add("productive", busy - self.wait_s)
        gp.add("data_wait", self.wait_s)
        dt = busy / n
        self._raise_peak(self.flops / dt, step)
        rec = {
            "step": step,
            "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]),
            "step_time_s": dt,
            "tokens_per_sec": self.tokens / dt,
            "tokens_per_sec_per_device": self.tokens / dt / self.n_devices,
            "mfu": self.flops / dt / self.peak if self.peak else 0.0,
            "data_wait_s": self.wait_s / n,
            "compute_s": self.device_s / n,
            "host_s": max(busy - self.wait_s - self.device_s, 0.0) / n,
            "skipped_steps": int(m["skipped_steps"]),
            "steps_since_log": n,
        }
        if "spike_skipped_steps" in m:
            rec["spike_skipped_steps"] = int(m["spike_skipped_steps"])
        # whatever else the step reports (e.g. MoE load balance): scalars, logged as they are
        rec.update({k: float(v) for k, v in m.items() if k not in self._KNOWN and np.ndim(v) == 0})
        rec.update(gp.totals())
        self.last_step, self.t_last, self.paused_s, self.wait_s = (
            step,
            time.perf_counter(),
            0.0,
            0.0,
        )
        self.device_s = 0.0
        return rec, int(m["bad_in_a_row"]), int(m.get("spike_in_a_row", 0))


def summary(
    history: list[dict],
    eval_history: list[dict],
    gp: Goodput,
    *,
    model_cfg,
    mesh,
    compile_s: float,
    sample: str,
    resumed_from: int | None,
    checkpoint: str | None,
    stopped_by: int | None,
    predicted_peak_bytes: int | None = None,
) -> dict:
    """summary.json, from the logged records and the run's facts: medians of the steady steps
    (the first, which includes warm-up, is left out when there are others), where the time went,
    and memory: the largest figures logged beside the compiled step's predicted per-device peak."""
    steady = history[1:] or history
    # none when the training data holds none out
    held_out = [r for r in eval_history if "eval_loss" in r]

    def largest(key):
        values = [r[key] for r in history if isinstance(r.get(key), int)]
        return max(values) if values else None

    return {
        "steps": history[-1]["step"] if history else (resumed_from or 0),
        "final_loss": history[-1]["loss"] if history else None,
        "first_loss": history[0]["loss"] if history else None,
        "eval_loss": held_out[-1]["eval_loss"] if held_out else None,
        # the last eval's figures on each --data.eval_source set, named as in metrics.jsonl
        **(
            {k: v for k, v in eval_history[-1].items() if k.startswith("eval/")}
            if eval_history
            else {}
        ),
        "tokens_per_sec": float(np.median([r["tokens_per_sec"] for r in steady]))
        if steady
        else 0.0,
        "mfu": float(np.median([r["mfu"] for r in steady])) if steady else 0.0,
        "compile_s": compile_s,
        "wall_s": time.time() - gp.started_at,
        "params": param_count(model_cfg),
        "mesh": mesh_text(mesh.shape),
        "sample": sample,
        "resumed_from": resumed_from,
        "checkpoint": checkpoint,
        "stopped_by": signal.Signals(stopped_by).name if stopped_by else None,
        "exit_code": exit_code(stopped_by),
        "predicted_peak_bytes": predicted_peak_bytes,
        "mem_peak_bytes": largest("mem_peak_bytes"),
        "host_rss_bytes": largest("host_rss_bytes"),
        **gp.totals(),
        # an elastic job's shrinks and grows before this attempt (elastic.py's record_fields)
        **({k: v for k, v in history[-1].items() if k.startswith("elastic_")} if history else {}),
    }


def eval_text(s: dict) -> str:
    """', eval loss 2.345 (chat 1.876, web 2.912)' from a summary: the held-out split's loss, then
    each eval set's; '' without evals."""
    sets = sinks.eval_set_losses(s)
    # a preference run's held-out loss is its objective's (eval/loss), with its accuracy
    loss = s.get("eval_loss") if s.get("eval_loss") is not None else s.get("eval/loss")
    held_out = f" {loss:.3f}" if loss is not None else ""
    sets += [f"acc {s['eval/accuracy']:.2f}"] if "eval/accuracy" in s else []
    # a grpo run's: the rewards of greedy completions of held-out prompts
    reward = f", eval reward {s['eval/reward_mean']:.3f}" if "eval/reward_mean" in s else ""
    if not held_out and not sets:
        return reward
    return ", eval loss" + held_out + (f" ({', '.join(sets)})" if sets else "") + reward


def summary_text(s: dict) -> str:
    """The lines the run ends with, from `summary`'s dict."""
    if s["stopped_by"]:
        head = (
            f"stopped by {s['stopped_by']} after step {s['steps']}"
            + (f", checkpoint {s['checkpoint']} committed" if s["checkpoint"] else "")
            + f"; exit status {s['exit_code']}"
        )
        if s["first_loss"] is None:
            return head
        return head + f"\nloss {s['first_loss']:.3f} -> {s['final_loss']:.3f} in {s['wall_s']:.1f}s"
    lines = [
        f"done: {s['steps']} steps in {s['wall_s']:.1f}s (compile {s['compile_s']:.1f}s),"
        f" loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}"
        + eval_text(s)
        + f", {s['tokens_per_sec']:.0f} tokens/s, MFU {100 * s['mfu']:.1f}%",
        breakdown_text(s),
        f"memory per device: peak {size_text(s.get('mem_peak_bytes'))} measured,"
        f" {size_text(s.get('predicted_peak_bytes'))} predicted by the compiled step;"
        f" host RSS {size_text(s.get('host_rss_bytes'))}",
    ]
    if s["sample"]:
        lines += ["--- sample ---", s["sample"], "--------------"]
    return "\n".join(lines)
