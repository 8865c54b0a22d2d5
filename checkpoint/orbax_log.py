"""Orbax's error records during a run: kept off the screen, in a file of the run directory.

When a save fails (a full disk) or a step's metadata is garbled, Orbax logs `ERROR:absl:`
records (from its background threads, with tracebacks, several times over) before the error
reaches Brigade, which then says what happened in one line. On the user's screen those records
bury that line; in a file they are what a bug report needs. So while a run is `kept_in` its
run directory, every error record of Orbax's goes to `<run-dir>/orbax-errors.txt`
(`orbax-errors.<process>.txt` on the other processes of a multi-process job) instead of the
screen, and a final error line names that file when it holds this run's records.

A run directory the run has not started in yet (no config.json: it may still be taken back,
train/run/startup.py) gets the records when the run ends; if it is gone by then (a refused run),
they go to the system's temporary directory, and the line names that file instead. Outside a
run (inspect, export) the records go where they always went.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator

from checkpoint import storage
from errors import UserError

_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")


class _Kept:
    """The records of the run in progress (one at a time per process)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.run_dir: str | None = None  # None: no run is keeping them
        self.pending: list[str] = []  # formatted records not yet in a file
        self.path = ""  # the file this run's records went to, "" while none did
        self.name = "orbax-errors.txt"

    def add(self, record: logging.LogRecord) -> None:
        with self.lock:
            self.pending.append(_FORMAT.format(record) + "\n")
            run_dir = self.run_dir
            if run_dir and storage.isfile(storage.join(run_dir, "config.json")):  # run started
                self._flush(run_dir)

    def _flush(self, directory: str) -> bool:
        """Append the pending records to `directory`'s file -> whether they are there now."""
        if not self.pending:
            return True
        path = storage.join(directory, self.name)
        try:
            storage.append_text(path, "".join(self.pending))
        except OSError:  # a full disk may refuse even this: the records stay pending
            return False
        self.pending, self.path = [], path
        return True

    def finish(self) -> str:
        """Write what is pending (the run directory, else the temporary directory) -> the file
        that holds this run's records, "" when there were none (or nowhere took them)."""
        with self.lock:
            if self.pending and not (storage.isdir(self.run_dir) and self._flush(self.run_dir)):
                self.name = f"brigade-orbax-errors.{os.getpid()}.txt"
                self._flush(tempfile.gettempdir())
            path, self.run_dir, self.pending, self.path = self.path, None, [], ""
            return path


_kept = _Kept()


class _ToTheRunDir(logging.Filter):
    """Takes Orbax's error records while a run keeps them (they then reach no handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _kept.run_dir is None or record.levelno < logging.ERROR:
            return True
        if "orbax" not in record.pathname:
            return True
        _kept.add(record)
        return False


def install() -> None:
    """Put the filter first on the absl logger (before any that shortens Orbax's records)."""
    log = logging.getLogger("absl")
    if not any(isinstance(f, _ToTheRunDir) for f in log.filters):
        log.filters.insert(0, _ToTheRunDir())


@contextlib.contextmanager
def kept_in(run_dir: str, process: int = 0) -> Iterator[None]:
    """Orbax's error records go to `run_dir`'s file while the block runs; a UserError leaving
    it gets the file's name appended to its line when the file holds records of this run."""
    install()
    _kept.run_dir = run_dir
    _kept.name = "orbax-errors.txt" if process == 0 else f"orbax-errors.{process}.txt"
    try:
        yield
    except UserError as e:
        path = _kept.finish()
        if path and e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]} (Orbax's report: {path})", *e.args[1:])
        raise
    finally:
        _kept.finish()
