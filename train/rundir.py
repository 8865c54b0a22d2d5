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
  object-store mounts may not honour it.)
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket

from errors import UserError
from train.goodput import Goodput, read_records

MARKER = "brigade-run.json"
LOCK = ".brigade-lock"
# Config sections of Brigade's config.json: a legacy run directory (no marker) is recognised by them.
_SECTIONS = {"model", "train", "parallelism", "data", "logging", "checkpoint"}


def is_run_dir(path: str) -> bool:
    """A directory Brigade wrote: its marker, or a config.json holding Brigade's config sections."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return True
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and _SECTIONS <= set(cfg)


def check_writable_run_dir(path: str, flag: str = "--run-dir") -> None:
    """UserError unless `path` is new, empty, or a Brigade run directory. Nothing is written."""
    if os.path.islink(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path}: a broken symbolic link; point it at a directory or choose another path")
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: exists and is not a directory; choose a new or empty directory")
    # a lock alone is a run that died as it started
    entries = sorted(e for e in os.listdir(path) if e != LOCK and not _is_job_log(path, e))
    if not entries or is_run_dir(path):
        return
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    raise UserError(f"{flag} {path}: not a Brigade run directory (it holds {len(entries)} entr"
                    f"{'y' if len(entries) == 1 else 'ies'}: {shown}; no {MARKER}), and a run would overwrite"
                    f" files in it; choose a new or empty directory")


def claim(run_dir: str, checkpoint_dir: str = ""):
    """Lock the run directory (and a --checkpoint.dir outside it, which two runs could share
    just as well) on process 0, and tell every process whether that worked: a context manager;
    UserError on every process when another run holds one of them."""
    import jax
    import numpy as np

    stack = contextlib.ExitStack()
    error = None
    if jax.process_index() == 0:
        try:
            stack.enter_context(RunDirLock(run_dir))
            inside = os.path.abspath(checkpoint_dir or run_dir).startswith(os.path.abspath(run_dir) + os.sep)
            if checkpoint_dir and not inside:  # its own layout (step directories): locked, not marked
                stack.enter_context(RunDirLock(checkpoint_dir, "--checkpoint.dir", own=False))
        except UserError as e:
            stack.close()
            error = e
    if jax.process_count() > 1:  # every process leaves together: a refused lock must not strand the others
        from jax.experimental import multihost_utils
        ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            raise UserError(f"--run-dir {run_dir}: process 0 could not claim it (its error says why)")
    if error is not None:
        raise error
    return stack


def _is_job_log(path: str, name: str) -> bool:
    """A scheduler's log file (SLURM's --output, a shell's `> run/train.log`) exists before the run
    starts; Brigade writes no file of these suffixes, so it cannot be overwritten."""
    return name.endswith((".log", ".out", ".err")) and os.path.isfile(os.path.join(path, name))


class RunDirLock:
    """`with RunDirLock(dir):` claims `dir` for this run (creating it and its marker) or raises
    UserError naming the run that holds it. Process 0's job; other processes do not call it."""

    def __init__(self, path: str, flag: str = "--run-dir", own: bool = True):
        """own: a run directory (checked and marked); False: only locked."""
        self.path, self.flag, self.own, self._fd = os.path.abspath(path), flag, own, None

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if self.own:
            check_writable_run_dir(self.path, self.flag)
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"{self.flag} {self.path}: cannot create it ({_reason(e)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"{self.flag} {self.path}: cannot lock {LOCK} ({_reason(e)})") from None
            raise UserError(f"{self.flag} {self.path} is in use by another run ({holder}); wait for it to"
                            f" end, stop it, or use another --run-dir") from None
        self._fd = fd
        try:
            holder = {"host": socket.gethostname(), "pid": os.getpid(),
                      "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            marker = os.path.join(self.path, MARKER)
            if self.own and not os.path.exists(marker):
                with open(marker, "w") as f:
                    json.dump({"created_by": "brigade", "created_at": holder["since"]}, f)
                    f.write("\n")
        except OSError as e:
            self.release()
            raise UserError(f"{self.flag} {self.path}: cannot write into it ({_reason(e)})") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def prepare_run_dir(run_dir: str, config_text: str, resumed_step: int | None, goodput: Goodput) -> None:
    """A run's start in its directory: config.json (`config_text`); after a resume, one line more
    in resumes.jsonl, the goodput of the attempts before carried over from metrics.jsonl, and
    the records that the resumed checkpoint does not cover dropped; a fresh run starts a fresh log."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        f.write(config_text)
    resumes = os.path.join(run_dir, "resumes.jsonl")   # one line per attempt that resumed
    if resumed_step is not None:
        with open(resumes, "a") as f:
            f.write(json.dumps({"step": resumed_step, "time": goodput.started_at}) + "\n")
        with open(resumes) as f:
            n_resumes = sum(1 for ln in f if ln.strip())
        goodput.resume(read_records(run_dir), resumed_step, restarts=n_resumes)
        drop_records_after(run_dir, resumed_step)  # logged after that save by the run that died
    else:
        for path in (os.path.join(run_dir, "metrics.jsonl"), resumes):
            if os.path.exists(path):
                os.remove(path)


def drop_records_after(run_dir: str, step: int) -> None:
    """Keep only metrics.jsonl records up to `step`: a resumed run appends from there, so steps
    that a failed run logged after its last checkpoint (and that are now redone) appear once."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        n_lines = sum(1 for ln in f if ln.strip())
    keep = [rec for rec in read_records(run_dir) if rec["step"] <= step]
    if len(keep) != n_lines:  # records past `step`, or lines that are not records
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in keep)
        os.replace(path + ".tmp", path)


@contextlib.contextmanager
def run_dir_writes(run_dir: str):
    """Writing Brigade's own files into the run directory: an OSError (a full disk, a read-only
    or vanished directory) becomes one line naming the file and the reason."""
    try:
        yield
    except OSError as e:
        raise UserError(f"--run-dir {run_dir}: cannot write {e.filename or 'into it'} ({e.strerror or e});"
                        f" free space or fix the directory, then run the same command again") from None


def _read_holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {h['host']}, pid {h['pid']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def _reason(e: OSError) -> str:
    return (e.strerror or type(e).__name__) + (f": {e.filename}" if e.filename else "")
