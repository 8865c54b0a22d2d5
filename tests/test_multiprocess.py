"""`python -m train` as 2 processes x 4 CPU devices on 127.0.0.1 (one 8-device mesh, gloo
collectives) gives the same loss curve as 1 process with 8 fake devices.

The 2-process run also passes `--mesh-dcn data=2`: the data axis spans the two processes
("hosts"), so the hybrid ICI x DCN mesh path is exercised too.

Every child writes stdout/stderr to files (never pipes, which can fill up and block a child),
every wait has a deadline, and as soon as one process exits non-zero the others are killed
(otherwise the survivor would sit in a collective until the heartbeat timeout). On a timeout the
children are sent SIGABRT first, so faulthandler prints where each one hung. The children's logs
go into the assertion message.

Note: a process that fails early (e.g. a UserError) can itself take tens of seconds to exit,
because interpreter exit waits in jax.distributed's shutdown barrier for the other process.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent

FLAGS = ["--model", "tiny", "--model.dtype", "float32", "--mesh", "data=2,fsdp=2,model=2",
         "--steps", "4", "--log-every", "1", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0",
         "--train.sample_tokens", "8", "--logging.progress", "false", "--logging.tensorboard", "false"]

# Environment variables that make mesh.build.init_distributed auto-join a cluster.
CLUSTER_VARS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")

TIMEOUT_S = 150  # normally ~60 s on 2 busy cores; only a hang should reach this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(n_devices: int) -> dict[str, str]:
    """The parent's environment with exactly `n_devices` fake CPU devices (conftest sets 8 in
    XLA_FLAGS for the pytest process; the child must not inherit that) and no cluster variables."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith(("--xla_force_host_platform_device_count=", "--ignored="))]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # stacks on SIGABRT (see Children.kill)
    return env


class Children:
    """Subprocesses of `python -m train`, logs in files, all killed on failure or timeout."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen, Path, Path]] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        out, err = self.log_dir / f"{name}.stdout", self.log_dir / f"{name}.stderr"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            p = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, env=env,
                                 stdin=subprocess.DEVNULL, stdout=fo, stderr=fe)
        self.procs.append((name, p, out, err))

    def wait_all(self, timeout_s: float) -> None:
        """Wait for every child to exit 0; fail (with logs) on a timeout or a non-zero exit."""
        deadline = time.monotonic() + timeout_s
        while True:
            codes = {name: p.poll() for name, p, _, _ in self.procs}
            failed = {n: c for n, c in codes.items() if c not in (None, 0)}
            if failed:
                self.kill()
                pytest.fail(f"child process(es) failed: {failed}\n{self.logs()}", pytrace=False)
            if all(c == 0 for c in codes.values()):
                return
            if time.monotonic() > deadline:
                self.kill(dump_stacks=True)
                running = [n for n, c in codes.items() if c is None]
                pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {running}\n{self.logs()}", pytrace=False)
            time.sleep(0.2)

    def kill(self, dump_stacks: bool = False) -> None:
        """SIGKILL every child still running; with dump_stacks, first SIGABRT them so Python's
        faulthandler (PYTHONFAULTHANDLER=1 in child_env) writes every thread's stack to stderr:
        that shows where a hung child is stuck (a collective, the coordinator, a compile)."""
        if dump_stacks:
            for _, p, _, _ in self.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGABRT)
            time.sleep(2)
        for _, p, _, _ in self.procs:
            if p.poll() is None:
                p.kill()
        for _, p, _, _ in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def logs(self, tail: int = 6000) -> str:
        parts = []
        for name, p, out, err in self.procs:
            for label, path in (("stdout", out), ("stderr", err)):
                text = path.read_text(errors="replace") if path.exists() else ""
                # gloo prints one connection line per rank and group: noise, not diagnosis
                text = "\n".join(line for line in text.splitlines() if not line.startswith("[Gloo]"))
                parts.append(f"--- {name} {label} (rc={p.returncode}, last {tail} chars) ---\n{text[-tail:]}")
        return "\n".join(parts)


def losses(run_dir: Path, logs: str = "") -> dict[str, list[float]]:
    path = run_dir / "metrics.jsonl"
    assert path.exists(), f"{path} was not written\n{logs}"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "loss" in r]
    return {k: [r[k] for r in recs] for k in ("step", "loss", "grad_norm")}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one_process(tmp_path):
    # All three children run at once (the single-process reference is mostly a one-threaded
    # compile, so it overlaps well with the 2-process job even on 2 cores).
    # Reference: one process, 8 fake devices.
    # Under test: two processes x 4 devices, one 8-device mesh whose data axis spans the two
    # processes (--mesh-dcn data=2). Each process gets its own --run-dir, so we can see that
    # only process 0 writes files.
    port = free_port()
    kids = Children(tmp_path)
    kids.start("single", FLAGS + ["--run-dir", str(tmp_path / "single")], child_env(8))
    for i in range(2):
        kids.start(f"proc{i}", FLAGS + ["--mesh-dcn", "data=2", "--run-dir", str(tmp_path / f"multi{i}"),
                                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                        "--process-id", str(i)], child_env(4))
    kids.wait_all(TIMEOUT_S)
    logs = kids.logs()

    ref = losses(tmp_path / "single", logs)
    assert ref["step"] == [1, 2, 3, 4], f"{ref}\n{logs}"
    got = losses(tmp_path / "multi0", logs)
    assert got["step"] == ref["step"], f"{got} vs {ref}\n{logs}"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5, err_msg=logs)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4, err_msg=logs)
    assert (tmp_path / "multi0" / "summary.json").exists(), logs

    assert not (tmp_path / "multi1").exists(), \
        f"process 1 wrote files: {sorted(p.name for p in (tmp_path / 'multi1').rglob('*'))}"
    out0, out1 = (tmp_path / "proc0.stdout").read_text(), (tmp_path / "proc1.stdout").read_text()
    assert "(8 devices)" in out0 and "done:" in out0, logs
    assert "done:" not in out1, f"process 1 printed the summary\n{logs}"


def _committed(ck_dir: Path) -> list[int]:
    return sorted(int(d.name) for d in ck_dir.iterdir() if d.name.isdigit()) if ck_dir.is_dir() else []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lost_peer_is_named_and_a_restart_of_both_resumes(tmp_path):
    """SIGKILL process 1 mid-training: process 0 exits non-zero within 60 s with a line naming
    process 1 (not a hang, not a bare traceback); starting both again resumes from the last
    committed checkpoint and finishes."""
    run_dir, steps = tmp_path / "run", 30
    flags = [f for f in FLAGS] + ["--steps", str(steps), "--checkpoint.every", "4", "--seq-len", "64",
                                  "--batch-size", "16", "--run-dir", str(run_dir), "--parallelism.peer_timeout", "10",
                                  "--train.sample_tokens", "0"]

    def start_both(kids: Children, tag: str, port: int) -> None:
        for i in range(2):
            kids.start(f"{tag}{i}", flags + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                             "--process-id", str(i)], child_env(4))

    kids = Children(tmp_path)
    start_both(kids, "first", free_port())
    (_, p0, _, err0), (_, p1, _, _) = kids.procs
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and p0.poll() is None and p1.poll() is None:
            saved = _committed(run_dir / "checkpoints")
            logged = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
                      if ln.endswith("}") and '"loss"' in ln] if (run_dir / "metrics.jsonl").exists() else []
            if saved and logged and max(logged) >= saved[-1] + 2:
                break
            time.sleep(0.05)
        assert p0.poll() is None and p1.poll() is None and saved, kids.logs()
        p1.kill()
        killed_at = time.monotonic()
        while p0.poll() is None and time.monotonic() - killed_at < 90:
            time.sleep(0.2)
        took = time.monotonic() - killed_at
    finally:
        kids.kill()
    err = err0.read_text()
    assert p0.returncode not in (None, 0) and took < 60, f"rc={p0.returncode} after {took:.0f}s\n{kids.logs()}"
    assert "lost peer process(es) 1" in err, kids.logs()

    again = Children(tmp_path)
    start_both(again, "again", free_port())
    again.wait_all(TIMEOUT_S)
    out = (tmp_path / "again0.stdout").read_text()
    resumed = int(out.split("resumed from ")[1].split("(step ")[1].split(",")[0])
    assert resumed >= saved[-1] and "done:" in out, again.logs()
    assert _committed(run_dir / "checkpoints")[-1] == steps
