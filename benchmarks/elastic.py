"""Elastic training's drill, timed: a 2-process x 4-CPU-device job (`--train.elastic true`) loses
process 1 (its supervisor and its child, SIGKILL) at a given step, continues on the 4 devices that
remain, then process 1 comes back and the job grows back to 8. Prints where the time between the
loss and the resumed training goes, and the steps trained twice.

    python benchmarks/elastic.py [--kill-at 12] [--steps 40] [--every 4] [--peer-timeout 10]
                                 [--elastic-wait 3]

Figures: detection (the kill to the survivor's exit 5: --parallelism.peer_timeout), rendezvous
(that exit to the shrunk attempt's start: --train.elastic_wait and the re-plan), restart (that
start to its first step logged: imports, compile, restore), and the same for the grow (process
1's supervisor started again, to the first step logged on 8 devices).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(run_dir: str) -> list[dict]:
    try:
        lines = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec:
            out.append(rec)
    return out


def events(run_dir: str) -> list[dict]:
    try:
        text = open(os.path.join(run_dir, "elastic", "events.jsonl")).read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait(what: str, ready, limit_s: float = 900) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.05)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--peer-timeout", type=float, default=10)
    ap.add_argument("--elastic-wait", type=float, default=3)
    return ap.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(a, tmp: str, run_dir: str, port: int):
    """start(slot, name): one process of the 2-process elastic run, logging to tmp/name.log."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,
        # process 0 sleeps after each step so that the grow comes before the run ends
        "BRIGADE_INJECT_STEP_DELAY": "0:0.2",
    }
    # fmt: off
    flags = ["--model", "tiny", "--model.dtype", "float32", "--mesh", "data=2,fsdp=2,model=2",
             "--mesh-dcn", "data=2", "--steps", str(a.steps), "--batch-size", "8",
             "--seq-len", "32",
             "--log-every", "1", "--eval-every", "0", "--train.sample_tokens", "0",
             "--logging.progress", "none", "--logging.tensorboard", "false",
             "--checkpoint.every", str(a.every), "--run-dir", run_dir, "--max-restarts", "3",
             "--train.elastic", "true", "--train.elastic_wait", str(a.elastic_wait),
             "--parallelism.peer_timeout", str(a.peer_timeout),
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    # fmt: on

    def start(slot: int, name: str) -> subprocess.Popen:
        log = open(os.path.join(tmp, f"{name}.log"), "wb")
        return subprocess.Popen(
            [sys.executable, "-m", "train", *flags, "--process-id", str(slot)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    return start


def report(run_dir, statuses, logged_before, killed_at, returned_at, first4, first8) -> None:
    """The shrink's and the grow's costs, from the run's events and logged records."""
    # (a restart of both, when the loaded machine made JAX's own heartbeat give up, comes first)
    shrink = next(e for e in events(run_dir) if e["event"] == "shrink")
    grow = next(e for e in events(run_dir) if e["event"] == "grow")
    resumed_from = shrink["checkpoint_step"]
    print(f"run dir {run_dir}; exit statuses {statuses[0]}, {statuses[1]}")
    print(
        f"shrink 8 -> 4 devices, killed after step {logged_before} was logged:"
        f" detection {shrink['exited_at'] - killed_at:.1f}s, rendezvous and re-plan"
        f" {shrink['cost_s']:.1f}s, restart (start, compile, restore, first step)"
        f" {first4['time'] - shrink['started_at']:.1f}s; loss to resumed training"
        f" {first4['time'] - killed_at:.1f}s; resumed from step {resumed_from}:"
        f" {logged_before - resumed_from} logged step(s) trained again"
    )
    print(
        f"grow 4 -> 8 devices: process 1 started again to the stop at a checkpoint"
        f" {grow['exited_at'] - returned_at:.1f}s, rendezvous {grow['cost_s']:.1f}s, restart"
        f" {first8['time'] - grow['started_at']:.1f}s; return to training on 8"
        f" {first8['time'] - returned_at:.1f}s; resumed from step {grow['checkpoint_step']}:"
        f" {grow['lost_steps']} step(s) trained again"
    )


def main() -> None:
    a = parse_args()
    tmp = tempfile.mkdtemp(prefix="elastic-bench-")
    run_dir = os.path.join(tmp, "run")
    start = launcher(a, tmp, run_dir, free_port())
    slot0, slot1 = start(0, "slot0"), start(1, "slot1")
    wait(f"step {a.kill_at}", lambda: any(r["step"] >= a.kill_at for r in records(run_dir)))
    logged_before = max(r["step"] for r in records(run_dir))
    os.killpg(slot1.pid, signal.SIGKILL)
    killed_at = time.time()
    slot1.wait()
    wait(
        "the shrunk attempt's first step", lambda: any(r["devices"] == 4 for r in records(run_dir))
    )
    first4 = next(r for r in records(run_dir) if r["devices"] == 4)
    returned_at = time.time()
    back = start(1, "slot1-back")
    wait(
        "the grown attempt's first step",
        lambda: any(r["devices"] == 8 and r["time"] > returned_at for r in records(run_dir)),
    )
    first8 = next(r for r in records(run_dir) if r["devices"] == 8 and r["time"] > returned_at)
    for p in (slot0, back):
        p.wait(timeout=900)
    statuses = (slot0.returncode, back.returncode)
    report(run_dir, statuses, logged_before, killed_at, returned_at, first4, first8)


if __name__ == "__main__":
    main()
