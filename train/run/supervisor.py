"""`--max-restarts N`: run training as a child process and restart it after a crash.

The supervisor never imports JAX (it must not take devices from its child). A child that exits
0 (done), 2 (a configuration or environment error: restarting cannot help), 3 (diverged with
nothing to reload) or 130/143 (stopped by SIGINT/SIGTERM with a committed checkpoint) ends the
supervision with that status. Any other exit (killed by a signal, a Python error, the watchdog's
4, a lost peer's 5) is a crash: the same command runs again and resumes from the last committed
checkpoint, after a short back-off, up to N times. Each restart appends one line to
<run_dir>/restarts.jsonl (exit status, last logged step, checkpoint step, steps lost, downtime).
A run without --run-dir gets its fresh directory here, once (train/run/rundir.py): every child is
given it as --run-dir, so a restart resumes that run rather than starting another.

In a multi-process job every process runs its own supervisor; when one child dies its peers exit
with status 5, every supervisor restarts its child, and they meet again at the coordinator. A
child that ends with 2 or 3 tells its peers, which end with the same status: no supervisor of
the job restarts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

from checkpoint import storage
from train.run.goodput import read_records

FINAL = {
    0: "finished",
    2: "configuration or environment error",
    3: "diverged",
    130: "stopped by SIGINT",
    143: "stopped by SIGTERM",
}
REASONS = {4: "watchdog: no progress", 5: "lost a peer process", 1: "Python error"}
CHILD_ENV = "BRIGADE_SUPERVISED"  # set in the child: it must not supervise itself


class Fresh(NamedTuple):
    """A run directory the supervisor named (no --run-dir was given) and the --resume its first
    child starts with (auto, none, or the path of the run that --resume latest continues)."""

    run_dir: str
    resume: str


def child_argv(argv: list[str], fresh: Fresh | None, saved_step: int | None) -> list[str]:
    """The command line of one child: the user's, and for a fresh run its directory, resumed
    from its own checkpoints once it has one (the first child's --resume PATH or none would
    collide with them). The last flag wins, so these override the user's."""
    if fresh is None:
        return argv
    return [
        *argv,
        "--run-dir",
        fresh.run_dir,
        "--resume",
        "auto" if saved_step is not None else fresh.resume,
    ]


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:  # a real-time or unnamed signal
            return f"killed by signal {-code}"
    return REASONS.get(code, FINAL.get(code, f"exit status {code}"))


def last_logged_step(run_dir: str) -> int | None:
    return max((r["step"] for r in read_records(run_dir)), default=None)


def checkpoint_step(ckpt_dir: str) -> int | None:
    """The newest committed step (Orbax renames a step dir into place only once it is complete)."""
    try:
        steps = [int(d) for d in storage.listdir(ckpt_dir) if d.isdigit()]
    except OSError:
        return None
    return max(steps, default=None)


def record_restart(run_dir: str, restart: dict) -> None:
    """One line in <run_dir>/restarts.jsonl, once the child has made run_dir a Brigade run
    directory: a file written into a directory the child never claimed (it died before, or it
    is the user's) would make the restarted child refuse that directory as not its own."""
    from train.run.rundir import is_run_dir

    if storage.isdir(run_dir) and is_run_dir(run_dir):
        storage.append_text(storage.join(run_dir, "restarts.jsonl"), json.dumps(restart) + "\n")


def _note_restart(
    run_dir: str, ckpt_dir: str, code: int, count: tuple, times: tuple, backoff_s: float
) -> int:
    """The restart `count` (this one, --max-restarts) after the child that ran over `times`
    (started, ended) exited with `code`: a line on stderr and a record in restarts.jsonl -> the
    logged steps it will redo (past the last checkpoint)."""
    (restarts, max_restarts), (started, ended) = count, times
    logged, saved = last_logged_step(run_dir), checkpoint_step(ckpt_dir)
    lost = max(0, (logged or 0) - (saved or 0))
    print(
        f"supervisor: training {describe(code)} after {ended - started:.0f}s; restart"
        f" {restarts}/{max_restarts} from"
        f" {'step ' + str(saved) if saved is not None else 'scratch'} ({lost} logged"
        " step(s) to redo)",
        file=sys.stderr,
        flush=True,
    )
    record = {
        "restart": restarts,
        "exit_code": code,
        "reason": describe(code),
        "exited_at": ended,
        "last_logged_step": logged,
        "checkpoint_step": saved,
        "lost_steps": lost,
        "backoff_s": backoff_s,
    }
    record_restart(run_dir, record)
    return lost


def supervise(
    argv: list[str],
    max_restarts: int,
    run_dir: str,
    ckpt_dir: str,
    backoff_s: float = 2.0,
    program: list[str] | None = None,
    fresh: Fresh | None = None,
) -> int:
    """Run `python -m train argv` (or `program` argv) until it ends for good; -> its final exit
    status. `fresh`: the directory named for a run without --run-dir (see child_argv)."""
    program = program or [sys.executable, "-m", "train"]
    env = dict(os.environ, **{CHILD_ENV: "1"})
    stop = {"signal": None}
    child: subprocess.Popen | None = None

    def forward(signum, frame):  # preemption reaches the child, which saves and exits 143/130
        stop["signal"] = signum
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    restarts, lost_total = 0, 0
    try:
        while True:
            started = time.time()
            saved = checkpoint_step(ckpt_dir) if restarts else None
            child = subprocess.Popen([*program, *child_argv(argv, fresh, saved)], env=env)
            print(
                f"supervisor: training started (pid {child.pid}, restart"
                f" {restarts}/{max_restarts})",
                flush=True,
            )
            code = child.wait()
            ended = time.time()
            if code in FINAL or stop["signal"] is not None or restarts >= max_restarts:
                if code not in FINAL and stop["signal"] is None:
                    print(
                        f"supervisor: training {describe(code)}; giving up after {restarts}"
                        f" restart(s) (--max-restarts {max_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                break
            restarts += 1
            lost_total += _note_restart(
                run_dir, ckpt_dir, code, (restarts, max_restarts), (started, ended), backoff_s
            )
            time.sleep(backoff_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if restarts:
        print(
            f"supervisor: {restarts} restart(s), {lost_total} logged step(s) recomputed; exit"
            f" status {code}",
            flush=True,
        )
    return code
