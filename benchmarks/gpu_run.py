"""One config of the GPU sweep (benchmarks/gpu.py) as its own `python -m train` subprocess:
started in a process group of its own, its metrics streamed as they are logged, killed at its
timeout, and its outcome (ok, oom, timeout, no-metrics, error) and median figures recorded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|\bOOM\b")
FIELDS = (
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "mfu",
    "step_time_s",
    "data_wait_s",
    "moe/dropped_fraction",
)


def say(*a) -> None:
    print(*a, flush=True)  # flushed so a hard kill still leaves the progress in the log


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if "tokens_per_sec" in row:  # skip eval or other records
            rows.append(row)
    return rows


def summarise(rows: list[dict]) -> dict:
    steady = rows[1:] or rows  # the first logged interval includes compilation
    out = {"logged_steps": [r.get("step") for r in rows], "includes_compile": len(rows) < 2}
    for k in FIELDS:
        vals = [r[k] for r in steady if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(vals) if vals else None
    return out


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _watch(
    proc: subprocess.Popen, metrics_path: Path, res: dict, t0: float, timeout: float
) -> None:
    """Stream the run's metrics as they are logged until it exits or its timeout passes."""
    seen = 0
    while proc.poll() is None:
        time.sleep(2)
        rows = read_metrics(metrics_path)
        for r in rows[seen:]:  # stream progress as it is logged
            say(
                f"  step {r.get('step')}: loss {r.get('loss'):.4f}"
                f" tok/s {r.get('tokens_per_sec'):,.0f}"
                f" mfu {r.get('mfu'):.1%} step {r.get('step_time_s'):.3f}s"
            )
        seen = len(rows)
        if time.time() - t0 > timeout:
            res["status"] = "timeout"
            break


def _status(proc: subprocess.Popen | None, rows: list[dict], text: str) -> str:
    """How a run that was not stopped ended: ok, oom, no-metrics (exit 0, nothing logged), error."""
    if proc is not None and proc.returncode == 0 and rows:
        return "ok"
    if OOM.search(text):
        return "oom"
    if proc is not None and proc.returncode == 0:
        return "no-metrics"
    return "error"


def _record(res: dict, proc, t0: float, run_dir: Path, logs: Path | None, tag: str) -> None:
    """Fill `res` from the finished run's log, metrics and summary, keep its log under `logs`,
    and remove its run directory."""
    batch = res["batch_size"]
    log_path, metrics_path = run_dir / "train.log", run_dir / "metrics.jsonl"
    res["rc"], res["wall_s"] = proc and proc.returncode, round(time.time() - t0, 1)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    rows = read_metrics(metrics_path)
    if res["status"] == "running":
        res["status"] = _status(proc, rows, text)
    res.update(summarise(rows))
    res["metrics"] = rows
    summary = run_dir / "summary.json"  # the CLI's end-of-run figures (compile time, goodput)
    if summary.exists():
        res["summary"] = {k: v for k, v in json.loads(summary.read_text()).items() if k != "sample"}
    if res["status"] != "ok":
        res["log_tail"] = text[-3000:]
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{tag}-b{batch}.log").write_text(text)
    # A 1b checkpoint with optimizer state is ~16 GB; never let runs accumulate on disk.
    shutil.rmtree(run_dir, ignore_errors=True)


def run_cmd(
    cmd: list[str], cwd: Path, run_dir: Path, res: dict, timeout: float, logs: Path | None, tag: str
) -> None:
    """Run one config's command and fill `res` (already in the results list, so an interrupt
    keeps it)."""
    t0, proc = time.time(), None
    try:
        with open(run_dir / "train.log", "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            _watch(proc, run_dir / "metrics.jsonl", res, t0, timeout)
    except KeyboardInterrupt:
        res["status"] = "interrupted"
        raise
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        _record(res, proc, t0, run_dir, logs, tag)
    say(
        f"--> {res['status']} rc={res['rc']} wall={res['wall_s']}s tok/s={res['tokens_per_sec']}"
        f" tok/s/dev={res['tokens_per_sec_per_device']} mfu={res['mfu']} step={res['step_time_s']}s"
    )


def table(runs: list[dict]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        "| preset | batch | seq | tokens/s | tokens/s/device | MFU | step (s) | predicted step (s)"
        " | predicted MFU"
        " | dropped | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['preset']} | {r['batch_size']} | {r['seq_len']}"
            f" | {f(r.get('tokens_per_sec'), ',.0f')}"
            f" | {f(r.get('tokens_per_sec_per_device'), ',.0f')} | {f(r.get('mfu'), '.1%')}"
            f" | {f(r.get('step_time_s'), '.3f')} | {f(r.get('predicted_step_time_s'), '.3f')}"
            f" | {f(r.get('predicted_mfu'), '.1%')} | {f(r.get('moe/dropped_fraction'), '.2%')}"
            f" | {r['status']} |"
        )
    return "\n".join(lines)
