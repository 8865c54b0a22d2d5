"""`python -m train` as 2 processes x 4 CPU devices on 127.0.0.1 (one 8-device mesh, gloo
collectives) gives the same loss curve as 1 process with 8 fake devices, and the same parameters
(every leaf of the final checkpoints).

The 2-process run also passes `--mesh-dcn data=2`: the data axis spans the two processes
("hosts"), so the hybrid ICI x DCN mesh path is exercised too.

Every child writes stdout/stderr to files (never pipes, which can fill up and block a child),
every wait has a deadline, and as soon as one process exits non-zero the others are killed
(otherwise the survivor would sit in a collective until the heartbeat timeout). On a timeout the
children are sent SIGABRT first, so faulthandler prints where each one hung. The children's logs
go into the assertion message.

The other tests kill a process (mid-training, inside a checkpoint save, after the run finished)
or fail one with a configuration error, and check that every survivor ends with one line and
the status a supervisor needs: 5 (a lost peer: restart) or 2 (a configuration error: do not).
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
from cpu_env import xla_flags
from equivalence import ADAM_ATOL, assert_trees_close

from checkpoint.manager import open_checkpoint

REPO = Path(__file__).resolve().parent.parent

FLAGS = [
    "--model",
    "tiny",
    "--model.dtype",
    "float32",
    "--mesh",
    "data=2,fsdp=2,model=2",
    "--steps",
    "4",
    "--log-every",
    "1",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "8",
    "--logging.progress",
    "false",
    "--logging.tensorboard",
    "false",
]

# Environment variables that make mesh.build.init_distributed auto-join a cluster.
CLUSTER_VARS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")

TIMEOUT_S = 150  # normally ~60 s on 2 busy cores; only a hang should reach this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(n_devices: int) -> dict[str, str]:
    """The parent's environment with exactly `n_devices` fake CPU devices (conftest sets 8 in
    XLA_FLAGS for the pytest process; the child must not inherit that), the compile options
    of tests/cpu_env.py (every process of a drill is compiled alike, and process 1 compiles
    everything itself: JAX writes the compilation cache from process 0 only) and no cluster
    variables."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
    env["XLA_FLAGS"] = xla_flags(
        " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--ignored=")),
        n_devices,
    )
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
            p = subprocess.Popen(
                [sys.executable, "-m", "train", *args],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
            )
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
                pytest.fail(
                    f"timed out after {timeout_s:.0f}s waiting for {running}\n{self.logs()}",
                    pytrace=False,
                )
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
                text = "\n".join(
                    line for line in text.splitlines() if not line.startswith("[Gloo]")
                )
                parts.append(
                    f"--- {name} {label} (rc={p.returncode}, last {tail} chars) ---\n{text[-tail:]}"
                )
        return "\n".join(parts)


def losses(run_dir: Path, logs: str = "") -> dict[str, list[float]]:
    path = run_dir / "metrics.jsonl"
    assert path.exists(), f"{path} was not written\n{logs}"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "loss" in r]
    return {k: [r[k] for r in recs] for k in ("step", "loss", "grad_norm", "lr")}


def final_params(run_dir: Path, step: int) -> dict:
    """The parameters of the run's final checkpoint (a 2-process run's: written by both processes
    into process 0's run directory), on the host."""
    ck, saved = open_checkpoint(str(run_dir))
    try:
        assert saved == step, (run_dir, saved)
        return ck.restore_params_to_host(saved)
    finally:
        ck.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one_process(tmp_path):
    # All three children run at once (the single-process reference is mostly a one-threaded
    # compile, so it overlaps well with the 2-process job even on 2 cores).
    # Reference: one process, 8 fake devices.
    # Under test: two processes x 4 devices, one 8-device mesh whose data axis spans the two
    # processes (--mesh-dcn data=2). Each process gets its own --run-dir, so we can see that
    # only process 0 writes files.
    # Adam's eps 1e-3 (tests/equivalence.py): a gradient coordinate whose sign is rounding noise
    # then moves its parameter by ~lr x noise / eps, not a full lr step either way
    flags = FLAGS + ["--train.eps", "1e-3"]
    port = free_port()
    kids = Children(tmp_path)
    kids.start("single", flags + ["--run-dir", str(tmp_path / "single")], child_env(8))
    for i in range(2):
        kids.start(
            f"proc{i}",
            flags
            + [
                "--mesh-dcn",
                "data=2",
                "--run-dir",
                str(tmp_path / f"multi{i}"),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            child_env(4),
        )
    kids.wait_all(TIMEOUT_S)
    logs = kids.logs()

    ref = losses(tmp_path / "single", logs)
    assert ref["step"] == [1, 2, 3, 4], f"{ref}\n{logs}"
    got = losses(tmp_path / "multi0", logs)
    assert got["step"] == ref["step"], f"{got} vs {ref}\n{logs}"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5, err_msg=logs)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-4, err_msg=logs)
    assert (tmp_path / "multi0" / "summary.json").exists(), logs
    # every parameter after the last step, within float32 reduction order and Adam's amplification
    # of it (tests/equivalence.py's tolerances)
    assert_trees_close(
        final_params(tmp_path / "multi0", 4),
        final_params(tmp_path / "single", 4),
        "2 processes vs 1: params after step 4",
        atol=ADAM_ATOL * sum(ref["lr"]),
    )

    assert not (tmp_path / "multi1").exists(), (
        f"process 1 wrote files: {sorted(p.name for p in (tmp_path / 'multi1').rglob('*'))}"
    )
    out0, out1 = (tmp_path / "proc0.stdout").read_text(), (tmp_path / "proc1.stdout").read_text()
    assert "(8 devices)" in out0 and "done:" in out0, logs
    assert "done:" not in out1, f"process 1 printed the summary\n{logs}"


def _committed(ck_dir: Path) -> list[int]:
    return (
        sorted(int(d.name) for d in ck_dir.iterdir() if d.name.isdigit()) if ck_dir.is_dir() else []
    )


def _errors(path: Path) -> list[str]:
    return [ln for ln in path.read_text(errors="replace").splitlines() if ln.startswith("error:")]


def _exit_time(p: subprocess.Popen, since: float, limit_s: float) -> float:
    """Seconds from `since` until `p` exits (it is killed after `limit_s`)."""
    while p.poll() is None and time.monotonic() - since < limit_s:
        time.sleep(0.1)
    return time.monotonic() - since


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lost_peer_is_named_and_a_restart_of_both_resumes(tmp_path):
    """SIGKILL process 1 mid-training: process 0 exits 5 within 60 s with one line naming
    process 1 (not a hang, not a bare traceback, not JAX's C++ abort); starting both again
    resumes from the last committed checkpoint and finishes."""
    run_dir, steps = tmp_path / "run", 30
    flags = [f for f in FLAGS] + [
        "--steps",
        str(steps),
        "--checkpoint.every",
        "4",
        "--seq-len",
        "64",
        "--batch-size",
        "16",
        "--run-dir",
        str(run_dir),
        "--train.sample_tokens",
        "0",
    ]

    def start_both(kids: Children, tag: str, port: int, peer_timeout: int = 10) -> None:
        for i in range(2):
            kids.start(
                f"{tag}{i}",
                flags
                + [
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                    "--parallelism.peer_timeout",
                    str(peer_timeout),
                ],
                child_env(4),
            )

    kids = Children(tmp_path)
    start_both(kids, "first", free_port())
    (_, p0, _, err0), (_, p1, _, _) = kids.procs
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and p0.poll() is None and p1.poll() is None:
            saved = _committed(run_dir / "checkpoints")
            logged = (
                [
                    json.loads(ln)["step"]
                    for ln in (run_dir / "metrics.jsonl").read_text().splitlines()
                    if ln.endswith("}") and '"loss"' in ln
                ]
                if (run_dir / "metrics.jsonl").exists()
                else []
            )
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
    errors = _errors(err0)
    assert p0.returncode == 5 and took < 60, f"rc={p0.returncode} after {took:.0f}s\n{kids.logs()}"
    assert len(errors) == 1 and "lost peer process(es) 1" in errors[0], kids.logs()

    again = Children(tmp_path)
    # the restart is not about lost peers: a timeout that a loaded machine's compile skew between
    # the two processes cannot reach (their first collective is the restore's)
    start_both(again, "again", free_port(), peer_timeout=60)
    again.wait_all(TIMEOUT_S)
    out = (tmp_path / "again0.stdout").read_text()
    resumed = int(out.split("resumed from ")[1].split("(step ")[1].split(",")[0])
    assert resumed >= saved[-1] and "done:" in out, again.logs()
    assert _committed(run_dir / "checkpoints")[-1] == steps


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_peer_lost_in_a_checkpoint_save_or_after_the_run_ends_the_survivor_with_status_5(
    tmp_path,
):
    """Process 1 is SIGKILLed as the save of step 4 begins (both processes inside Orbax's
    cross-process save and commit): process 0 exits 5 within --parallelism.peer_timeout and a
    margin, with one line naming process 1, not JAX's C++ abort (exit 134) after its own
    heartbeat timeout. Then both resume and finish, and process 1 dies before the shutdown
    barrier (fault injection): process 0, done training, ends the same way."""
    run_dir, peer_timeout, margin = tmp_path / "run", 10, 8
    ck_dir = run_dir / "checkpoints"
    flags = FLAGS + [
        "--mesh",
        "data=8",
        "--steps",
        "8",
        "--checkpoint.every",
        "4",
        "--run-dir",
        str(run_dir),
        "--parallelism.peer_timeout",
        str(peer_timeout),
        "--train.sample_tokens",
        "0",
    ]

    def start_both(kids: Children, tag: str, env: dict[str, str]) -> None:
        port = free_port()
        for i in range(2):
            kids.start(
                f"{tag}{i}",
                flags
                + [
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                ],
                env,
            )

    kids = Children(tmp_path)
    start_both(kids, "save", child_env(4))
    (_, p0, _, err0), (_, p1, _, _) = kids.procs
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and p0.poll() is None and p1.poll() is None:
            if ck_dir.is_dir() and any(d.name.split(".")[0] == "4" for d in ck_dir.iterdir()):
                break  # the save of step 4 has begun
            time.sleep(0.02)
        assert p0.poll() is None and p1.poll() is None, kids.logs()
        p1.kill()
        took = _exit_time(p0, time.monotonic(), 3 * peer_timeout + 30)
    finally:
        kids.kill()
    errors = _errors(err0)
    assert p0.returncode == 5 and took < peer_timeout + margin, (
        f"rc={p0.returncode} after {took:.0f}s\n{kids.logs()}"
    )
    assert len(errors) == 1 and "lost peer process(es) 1" in errors[0], kids.logs()

    again = Children(tmp_path)
    start_both(again, "end", {**child_env(4), "BRIGADE_INJECT_KILL_AT_SHUTDOWN_PROCESSES": "1"})
    (_, p0, out0, err0), (_, p1, _, _) = again.procs
    try:
        p1.wait(timeout=TIMEOUT_S)
        took = _exit_time(p0, time.monotonic(), 3 * peer_timeout + 30)
    finally:
        again.kill()
    errors = _errors(err0)
    assert p1.returncode == -signal.SIGKILL and "done:" in out0.read_text(), again.logs()
    assert p0.returncode == 5 and took < peer_timeout + margin, (
        f"rc={p0.returncode} after {took:.0f}s\n{again.logs()}"
    )
    assert (
        len(errors) == 1
        and "lost peer process(es) 1" in errors[0]
        and "shutdown barrier" in errors[0]
    ), again.logs()
    assert _committed(ck_dir)[-1] == 8


# Process 0 alone ends with a configuration error (as the CLI ends it) while process 1 waits for
# it in a coordination-service barrier (as in Orbax's saves): no model, nothing to compile.
ONE_SIDED_ERROR = """if True:
    import sys
    from mesh.build import init_distributed
    pid, port = int(sys.argv[1]), sys.argv[2]
    init_distributed(f"127.0.0.1:{port}", 2, pid, peer_timeout_s=60)
    from jax._src import distributed
    from train.cli.main import final_error as _final_error
    from train.run.watchdog import PeerHeartbeat
    with PeerHeartbeat(timeout_s=60):
        if pid == 0:
            _final_error("error: --data.path /nowhere: no such file (seen by process 0 only)", 2)
        distributed.global_state.client.wait_at_barrier("never-passed", 600_000)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_configuration_error_in_one_process_ends_every_process_with_status_2():
    """Both processes exit 2, so no supervisor restarts either: process 1 neither waits until it
    declares process 0 lost (5, a restart) nor aborts from C++ (134) when process 0, which
    hosts the coordination service, leaves."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ONE_SIDED_ERROR, str(i), str(port)],
            cwd=REPO,
            env=child_env(4),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        errs = [p.communicate(timeout=TIMEOUT_S)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], errs
    (own,), (peer,) = ([ln for ln in e.splitlines() if ln.startswith("error:")] for e in errs)
    assert own == "error: --data.path /nowhere: no such file (seen by process 0 only)", errs
    assert peer.startswith("error: process 1: stopping because process 0 ended with status 2:"), (
        errs
    )
    assert "--data.path /nowhere" in peer, errs
