"""Whose checkpoint directory a run saves into: its own, or one it was told to adopt.

A `--checkpoint.dir` copied from another run's command points this run at that run's
checkpoints: it would resume from them as if they were its own, and its retention
(--checkpoint.keep) would delete that run's older steps. So before anything is created, a
checkpoint directory that belongs to another run is refused in one line, unless the user says
`--checkpoint.adopt true`. It belongs to another run when

- its record (checkpoint/owner.py RECORD) names another run directory, or, without a record
  (a directory written before records existed),
- it is, or sits directly in, a run directory other than this run's (`brigade-run.json` or
  Brigade's config.json: another run's `checkpoints/`), or its newest step's metadata names
  another run directory as the one it was saved from.

The directory inside this run's own run directory (the default `<run-dir>/checkpoints`) is this
run's unless its record names another run: one that adopted it since. A record found in another
directory than the one it was written for came along with a copy (or a move): the copy is no
other run's, inside its run directory its steps are the copy's own, elsewhere they are kept.

Retention deletes only the steps the run wrote itself (the record's `written`). A directory of
this run's own without a record (written before records existed, or copied) counts its steps as
the run's own; a directory elsewhere without one, and an adopted directory, keep every step they
held when this run came: they were not this run's to delete. (Deleting an adopted directory's
older steps would be defensible once the adopting run has saved newer ones, but the adopting run
cannot know that the run it took them from will never be resumed from them again.)
"""

from __future__ import annotations

import json
import os

from checkpoint import storage
from checkpoint.layout import META_ITEM
from checkpoint.owner import Owner, read_record
from checkpoint.saving import step_list
from errors import UserError
from train.run.rundir import is_run_dir

ADOPT_FLAG = "--checkpoint.adopt true"


def _real(path: str) -> str:
    """A path compared as the same directory whichever way it is spelled (links, `..`)."""
    return (
        os.path.realpath(storage.local_path(path)) if storage.is_local(path) else path.rstrip("/")
    )


def _within(inner: str, outer: str) -> bool:
    """`inner` lies inside `outer` (both as `_real` gives them: '/'-separated)."""
    return inner.startswith(outer.rstrip("/") + "/")


def _steps(directory: str) -> list[int]:
    try:
        return sorted(int(n) for n in storage.listdir(directory) if n.isdigit())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _saved_from(directory: str, step: int) -> str:
    """The run directory that the step's metadata names (its config's logging.run_dir), "" when
    it cannot be read: only a hint, for directories written before owner records existed."""
    try:
        meta = json.loads(
            storage.read_text(storage.join(directory, str(step), META_ITEM, "metadata"))
        )
        run_dir = meta["config"]["logging"]["run_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return run_dir if isinstance(run_dir, str) else ""


def _holder(run_dir: str, directory: str, record: dict | None, steps: list[int], copy: bool) -> str:
    """The other run that `directory` belongs to, or "" when it is this run's to save into.
    `copy`: its record was written for another directory (it is a copy of that one)."""
    run, ck = _real(run_dir), _real(directory)
    if record is not None and "unreadable" not in record:
        named = record["run_dir"]  # even inside this run's directory: a run that adopted it
        return "" if _real(named) == run else named
    if _within(ck, run):
        return ""
    parent = storage.dirname(ck)
    for candidate in (ck, parent):
        if candidate != run and storage.isdir(candidate) and is_run_dir(candidate):
            return candidate
    if copy or not steps:  # a copy's metadata names the run it was copied from
        return ""
    named = _saved_from(directory, steps[-1])
    return named if named and _real(named) != run else ""


def checkpoint_owner(
    run_dir: str, directory: str, adopt: bool, writer: bool, flag: str = "--checkpoint.dir"
) -> Owner:
    """The run `run_dir` as the owner of checkpoint directory `directory`, with the steps it
    wrote there; UserError naming the other run when the directory is another run's and `adopt`
    is not set. Reads only: the record is written at this run's first save. `writer`: this
    process keeps the record."""
    record = read_record(directory) if storage.isdir(directory) else None
    copied = record.get("directory") if record and "unreadable" not in record else None
    if copied is not None and copied == storage.absolute(directory):
        copied = None
    record = None if copied is not None else record  # it describes the original, not this copy
    steps = _steps(directory)
    holder = _holder(run_dir, directory, record, steps, copy=copied is not None)
    if holder and not adopt:
        held = f"; it holds steps {step_list(steps)}" if steps else ""
        instead = (
            f"leave {flag} empty (this run's own <run-dir>/checkpoints) or choose another"
            if flag == "--checkpoint.dir"
            else f"choose another {flag}"
        )
        raise UserError(
            f"{flag} {directory} belongs to another run ({holder}{held}): saving there would"
            f" resume from that run's checkpoints and delete its older ones; {instead}, or pass"
            f" {ADOPT_FLAG} to continue from them (this run then never deletes them)"
        )
    owner = Owner(storage.absolute(directory), storage.absolute(run_dir), set(), writer=writer)
    if holder:
        owner.adopted_from = holder
        _note(writer, f"{flag} {directory}: adopted from {holder} ({ADOPT_FLAG}); its steps", steps)
    elif record is not None and "unreadable" not in record:
        owner.written, owner.since = set(record["written"]), record.get("since", "")
        owner.adopted_from = record.get("adopted_from", "")
    elif record is not None:
        why = record["unreadable"]
        _note(
            writer, f"{flag} {directory}: its owner record is unreadable ({why}); its steps", steps
        )
    elif _within(_real(directory), _real(run_dir)):
        owner.written = set(steps)  # the run's own directory, from before records (or a copy)
    elif copied is not None:
        _note(writer, f"{flag} {directory}: a copy of {copied}; its steps", steps)
    else:
        _note(writer, f"{flag} {directory}: steps saved before this run came here,", steps)
    return owner


def _note(writer: bool, what: str, steps: list[int]) -> None:
    if steps and writer:  # one process says it
        print(
            f"note: {what} {step_list(steps)} are kept (--checkpoint.keep removes only the"
            f" steps this run saves)",
            flush=True,
        )
