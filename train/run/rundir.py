"""The run directory: which directories a run may write into, the lock it holds on them, and the
records a run starts it with (config.json, resumes.jsonl, metrics.jsonl trimmed on a resume).

A run writes config.json, metrics.jsonl, checkpoints and more into `--run-dir`. Two runs writing
into one directory at once clobber each other (both resume from the same checkpoint, both save
the same steps), and a directory that Brigade did not create may hold the user's own files of
the same names. So a run

- refuses a non-empty directory that is not a Brigade run directory (no `brigade-run.json`
  marker, and no config.json of Brigade's sections, as run directories written before the
  marker existed have), before writing anything into it; a scheduler's log files (*.log, *.out,
  *.err) do not count, as the job's shell creates them before the run starts;
- holds an exclusive `flock` on `<dir>/.brigade-lock` for its whole life. The kernel releases
  it when the process dies, however it dies, so a SIGKILLed run never blocks its own restart. In
  a multi-process job process 0 holds it for the job. The lock file names the holder (host, pid,
  since when) for the one line a second run exits with. (flock works on local disks and NFS;
  object-store mounts may not honour it.) A run directory on an object store (gs://, s3://) has
  no such lock: the run says so in one line at its start, and keeping two runs apart is the
  user's (checkpoint/storage.py).

An explicit --run-dir is used as it is, and resumes its own checkpoints; without one, each run
gets a fresh named directory under runs/ (train/run/named_runs.py).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket

from checkpoint import storage
from errors import UserError
from train.run.goodput import (
    AFTER_CLEAN_END,
    AFTER_FAILURE,
    Goodput,
    read_json_lines,
    read_records,
)

MARKER = "brigade-run.json"
LOCK = ".brigade-lock"
# Config sections of Brigade's config.json: a legacy run directory (no marker) is recognised by
# them.
_SECTIONS = {"model", "train", "parallelism", "data", "logging", "checkpoint"}
ELASTIC = "elastic"  # an elastic job's membership files (train/run/rendezvous.py)


def is_run_dir(path: str) -> bool:
    """A directory Brigade wrote: its marker, or a config.json holding Brigade's config sections."""
    if storage.isfile(storage.join(path, MARKER)):
        return True
    try:
        cfg = json.loads(storage.read_text(storage.join(path, "config.json")))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and _SECTIONS <= set(cfg)


def check_writable_run_dir(path: str, flag: str = "--run-dir") -> None:
    """UserError unless `path` is new, empty, or a Brigade run directory. Nothing is written."""
    if storage.is_local(path) and os.path.islink(path) and not os.path.isdir(path):
        raise UserError(
            f"{flag} {path}: a broken symbolic link; point it at a directory or choose another path"
        )
    if not storage.exists(path):
        return
    if not storage.isdir(path):
        raise UserError(
            f"{flag} {path}: exists and is not a directory; choose a new or empty directory"
        )
    # a lock alone is a run that died as it started
    # the supervisors of an elastic job meet in ELASTIC before the first attempt claims the run
    entries = sorted(
        e for e in storage.listdir(path) if e not in (LOCK, ELASTIC) and not _is_job_log(path, e)
    )
    if not entries or is_run_dir(path):
        return
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    raise UserError(
        f"{flag} {path}: not a Brigade run directory (it holds {len(entries)} entr"
        f"{'y' if len(entries) == 1 else 'ies'}: {shown}; no {MARKER}), and a run would overwrite"
        f" files in it; choose a new or empty directory"
    )


def claim(run_dir: str, checkpoint_dir: str = "", undo=None):
    """Lock the run directory (and a --checkpoint.dir outside it, which two runs could share
    just as well) on process 0, and tell every process whether that worked: a context manager;
    UserError on every process when another run holds one of them. `undo()`: called on process
    0 when a UserError (a refusal) leaves the block, before the locks are released: it takes
    back what the refused run created (train/run/startup.py Skeleton)."""
    import jax
    import numpy as np

    stack = contextlib.ExitStack()
    error = None
    if jax.process_index() == 0:
        try:
            stack.enter_context(RunDirLock(run_dir))
            inside = storage.absolute(checkpoint_dir or run_dir).startswith(
                storage.join(storage.absolute(run_dir), "")
            )
            # its own layout (step directories): locked, not marked
            if checkpoint_dir and not inside:
                stack.enter_context(RunDirLock(checkpoint_dir, "--checkpoint.dir", own=False))
        except UserError as e:
            stack.close()
            error = e
    # every process leaves together: a refused lock must not strand the others
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            raise UserError(
                f"--run-dir {run_dir}: process 0 could not claim it (its error says why)"
            )
    if error is not None:
        raise error
    if undo is not None and jax.process_index() == 0:

        def undo_refusal(kind, exc, tb) -> bool:  # runs first on leaving: before the unlock
            if kind is not None and issubclass(kind, UserError):
                undo()
            return False  # the error goes on

        stack.push(undo_refusal)
    return stack


def _is_job_log(path: str, name: str) -> bool:
    """A scheduler's log file (SLURM's --output, a shell's `> run/train.log`) exists before the run
    starts; Brigade writes no file of these suffixes, so it cannot be overwritten."""
    return name.endswith((".log", ".out", ".err")) and storage.isfile(storage.join(path, name))


class RunDirLock:
    """`with RunDirLock(dir):` claims `dir` for this run (creating it and its marker) or raises
    UserError naming the run that holds it. Process 0's job; other processes do not call it."""

    def __init__(self, path: str, flag: str = "--run-dir", own: bool = True):
        """own: a run directory (checked and marked); False: only locked."""
        self.path, self.flag, self.own, self._fd = storage.absolute(path), flag, own, None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if self.own:
            check_writable_run_dir(self.path, self.flag)
        if not storage.is_local(self.path):
            self._claim_unlocked()
            return
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(
                f"{self.flag} {self.path}: cannot create it ({oserror_text(e)})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(
                    f"{self.flag} {self.path}: cannot lock {LOCK} ({oserror_text(e)})"
                ) from None
            raise UserError(
                f"{self.flag} {self.path} is in use by another run ({holder}); wait for it to"
                f" end, stop it, or use another --run-dir"
            ) from None
        self._fd = fd
        try:
            holder = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            marker = os.path.join(self.path, MARKER)
            if self.own and not os.path.exists(marker):
                with open(marker, "w") as f:
                    json.dump({"created_by": "brigade", "created_at": holder["since"]}, f)
                    f.write("\n")
        except OSError as e:
            self.release()
            raise UserError(
                f"{self.flag} {self.path}: cannot write into it ({oserror_text(e)})"
            ) from None

    def _claim_unlocked(self) -> None:
        """An object store has no flock (and an object written as a lock would outlive a killed
        run, blocking its restart): the directory is marked, not locked, and the run says so."""
        print(
            f"note: {self.flag} {self.path} is on an object store: it is not locked against a"
            " second run; start one run at a time on it",
            flush=True,
        )
        try:
            storage.makedirs(self.path)
            if self.own and not storage.exists(storage.join(self.path, MARKER)):
                since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
                storage.write_text(
                    storage.join(self.path, MARKER),
                    json.dumps({"created_by": "brigade", "created_at": since}) + "\n",
                )
        except OSError as e:
            raise UserError(
                f"{self.flag} {self.path}: cannot write into it ({oserror_text(e)})"
            ) from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def prepare_run_dir(
    run_dir: str, config_text: str, resumed_step: int | None, goodput: Goodput
) -> None:
    """A run's start in its directory: config.json (`config_text`); after a resume, one line more in
    resumes.jsonl, the goodput of the attempts before carried over from metrics.jsonl, and the
    records that the resumed checkpoint does not cover dropped; a fresh run starts a fresh log."""
    storage.makedirs(run_dir)
    storage.write_text(storage.join(run_dir, "config.json"), config_text)
    resumes = storage.join(run_dir, "resumes.jsonl")  # one line per attempt that resumed
    if resumed_step is not None:
        goodput.resume(
            read_records(run_dir),
            resumed_step,
            ended=read_json_lines(storage.join(run_dir, "summary.json"), whole=True),
            earlier=read_json_lines(resumes),
        )
        after = AFTER_FAILURE if goodput.after_failure else AFTER_CLEAN_END
        line = {"step": resumed_step, "time": goodput.started_at, "after": after}
        storage.append_text(resumes, json.dumps(line) + "\n")
        drop_records_after(run_dir, resumed_step)  # logged after that save by the run that died
    else:
        for path in (storage.join(run_dir, "metrics.jsonl"), resumes):
            storage.remove(path)


def drop_records_after(run_dir: str, step: int) -> None:
    """Keep only metrics.jsonl records up to `step`: a resumed run appends from there, so steps
    that a failed run logged after its last checkpoint (and that are now redone) appear once."""
    path = storage.join(run_dir, "metrics.jsonl")
    if not storage.exists(path):
        return
    n_lines = sum(1 for ln in storage.read_text(path).splitlines() if ln.strip())
    keep = [rec for rec in read_records(run_dir) if rec["step"] <= step]
    if len(keep) != n_lines:  # records past `step`, or lines that are not records
        storage.write_text(path, "".join(json.dumps(rec) + "\n" for rec in keep))


@contextlib.contextmanager
def run_dir_writes(run_dir: str):
    """Writing Brigade's own files into the run directory: an OSError (a full disk, a read-only
    or vanished directory) becomes one line naming the file and the reason."""
    try:
        yield
    except OSError as e:
        raise UserError(
            f"--run-dir {run_dir}: cannot write {e.filename or 'into it'} ({e.strerror or e});"
            f" free space or fix the directory, then run the same command again"
        ) from None


def _read_holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {h['host']}, pid {h['pid']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def oserror_text(e: OSError) -> str:
    return (e.strerror or type(e).__name__) + (f": {e.filename}" if e.filename else "")
