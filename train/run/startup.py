"""A run's start: what it checks before it creates anything, and what it takes back when it is
refused after all.

A refused run must leave the disk as it found it: a run directory made for it and left holding
only `brigade-run.json`, a lock file and an empty `checkpoints/` is a skeleton that the next run
takes for a run (a `--resume latest` would try to continue it). So

- what can be checked without creating anything is checked first (`check_before_creating`:
  whose the checkpoint directory is, the local tier's directory, the storage the checkpoints
  go to; the loop opens the data, where a vocabulary too small for it is refused, before
  claiming the run directory too);
- what can only be found out later (a `--resume PATH` that does not fit, a step too large for
  the devices, a tokenizer mismatch) is refused with the skeleton taken back: `Skeleton` notes
  what exists before the run claims its directories, and `undo` removes what the run created
  since, only when all of it is skeleton (marker, lock and owner files, empty directories).
  Anything else new (config.json: the run had started) keeps everything.
"""

from __future__ import annotations

import os

import jax

from checkpoint import storage
from checkpoint.array_store import check_array_store
from checkpoint.layout import RUN_SUBDIR
from checkpoint.manager import Checkpointer, shared_directory
from checkpoint.owner import RECORD, Owner
from checkpoint.tiers import LOCAL_FLAG, local_tier, process_dir
from errors import UserError
from train.run.ownership import checkpoint_owner
from train.run.rundir import LOCK, MARKER

SKELETON_FILES = frozenset({MARKER, LOCK, RECORD})


def checkpoint_dir(cfg) -> str:
    """The directory the run saves into: --checkpoint.dir, else <run-dir>/checkpoints."""
    return cfg.checkpoint.dir or storage.join(cfg.logging.run_dir, RUN_SUBDIR)


def local_tier_dir(cfg) -> str:
    """This process's directory of the local tier, "" without one."""
    local = cfg.checkpoint.local_dir
    return process_dir(local, jax.process_index()) if local else ""


def check_before_creating(cfg, directory: str) -> tuple[Owner, Owner | None]:
    """Everything about the run's directories that can be refused before one is created: the
    checkpoint directory `directory` on storage Orbax writes arrays to, and this run's to save
    into (train/run/ownership.py); the local tier's directory creatable and writable, outside it,
    and this run's too. -> the run as the owner of its checkpoint directory and of this
    process's local tier (None without one)."""
    c = cfg.checkpoint
    flag = "--checkpoint.dir" if c.dir else "--run-dir"
    check_array_store(directory, flag)
    run_dir = cfg.logging.run_dir
    owner = checkpoint_owner(run_dir, directory, c.adopt, jax.process_index() == 0, flag)
    if not c.local_dir:
        return owner, None
    _check_local_dir(c.local_dir, directory)
    return owner, checkpoint_owner(run_dir, local_tier_dir(cfg), c.adopt, True, LOCAL_FLAG)


def _check_local_dir(local_dir: str, shared: str) -> None:
    """The refusals of checkpoint/tiers.py local_tier, made before anything exists: inside the
    persistent directory, or a directory that cannot be created or written."""
    root, own = os.path.abspath(local_dir), process_dir(local_dir, jax.process_index())
    shared = storage.absolute(shared)
    within = lambda inner, outer: inner == outer or inner.startswith(outer + os.sep)  # noqa: E731
    if within(root, shared) or within(shared, own):
        raise UserError(
            f"{LOCAL_FLAG} {local_dir}: inside the persistent checkpoint directory {shared}"
            f" (or holding it); choose a directory outside it, on storage local to each host"
        )
    existing = own
    while not os.path.lexists(existing):  # the nearest part of the path that exists
        existing = os.path.dirname(existing)
    # worded as the Checkpointer that would create it words them (checkpoint/manager.py)
    if not os.path.isdir(existing):
        raise UserError(f"{LOCAL_FLAG}: cannot create '{own}': Not a directory ({existing})")
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == own:
            raise UserError(f"{LOCAL_FLAG}: '{own}' is not writable")
        raise UserError(f"{LOCAL_FLAG}: cannot create '{own}': Permission denied ({existing})")


class Skeleton:
    """What exists of `paths` (local directories a run creates) before the run claims them."""

    def __init__(self, *paths: str):
        self._before: list[tuple[str, set[str] | None]] = []
        for path in dict.fromkeys(p for p in paths if p and storage.is_local(p)):
            path = os.path.abspath(storage.local_path(path))
            top = path
            while not os.path.lexists(top) and not os.path.lexists(os.path.dirname(top)):
                top = os.path.dirname(top)  # the outermost directory the run will create
            listed = set(os.listdir(top)) if os.path.isdir(top) else None
            self._before.append((top, listed))

    def _new(self) -> list[str]:
        out = []
        for top, listed in self._before:
            if listed is None:
                out += [top] if os.path.lexists(top) else []
            elif os.path.isdir(top):
                out += [os.path.join(top, n) for n in os.listdir(top) if n not in listed]
        return sorted(set(out))

    def undo(self) -> bool:
        """Remove what the run created since, if it is all skeleton -> whether anything was. An
        OSError (a file appearing meanwhile) leaves the rest: untidy, never unsafe."""
        new = self._new()
        if not new or not all(_skeleton(p) for p in new):
            return False
        try:
            for path in new:
                _remove(path)
        except OSError:
            return False
        return True


def _skeleton(path: str) -> bool:
    if os.path.islink(path):
        return False
    if os.path.isdir(path):
        return all(_skeleton(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.basename(path) in SKELETON_FILES


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        for name in os.listdir(path):
            _remove(os.path.join(path, name))
        os.rmdir(path)  # empty now: it held skeleton alone
    elif os.path.exists(path):
        os.remove(path)


def open_checkpoints(cfg, owners=(None, None)) -> Checkpointer:
    """The directory a run saves into: --checkpoint.dir, else <run_dir>/checkpoints (and its local
    tier, with --checkpoint.local_dir). `owners`: the run as the owner of each of them
    (`check_before_creating`): retention deletes the run's own steps alone."""
    c = cfg.checkpoint
    saver = Checkpointer(
        shared_directory(checkpoint_dir(cfg)),
        keep=c.keep,
        keep_every=c.keep_every,
        async_save=c.async_save,
        run_owner=owners[0],
    )
    if owners[1] is not None:  # opened now with its owner; resume and saves find it
        local_tier(
            saver, c.local_dir, keep=c.local_keep, async_save=c.async_save, run_owner=owners[1]
        )
    return saver
