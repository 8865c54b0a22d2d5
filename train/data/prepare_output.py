"""prepare's output directory: an --out whose replacement would lose data refused before anything is
written or deleted, the temporary directory the dataset is written into, and the replacement of
an old dataset by the new one once it is complete (only the files prepare wrote are deleted)."""

from __future__ import annotations

import os
import sys
import tempfile

from checkpoint import storage
from errors import UserError
from train.data.index import listed_files, read_index


def _within(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or lies inside it (both already real paths)."""
    return os.path.commonpath([path, directory]) == directory


def check_out(out: str, inputs: list[str], files: list[str], overwrite: bool) -> None:
    """Refuses (UserError, before anything is written or deleted) an --out whose replacement would
    lose data: one that is or contains an input, the current directory, the home directory or /;
    one inside an input directory (the next run would read the dataset as input); an existing one
    without --overwrite; and, with it, anything but a directory that holds a prepared dataset and
    nothing else, so that the only files --overwrite deletes are ones `prepare` wrote."""
    if storage.is_local(out):  # an object store holds no input, no current or home directory
        _check_holds_nothing_of_value(out, inputs, files)
    if not storage.lexists(out):
        return
    if not overwrite:
        raise UserError(
            f"prepare: --out '{out}' already exists; choose another directory or pass --overwrite"
        )
    _check_only_a_dataset(out)


def _check_holds_nothing_of_value(out: str, inputs: list[str], files: list[str]) -> None:
    """A local --out that is or contains an input, the current or home directory or /, or lies
    inside an input directory: refused."""
    real = os.path.realpath(out)
    if os.path.lexists(out):  # a new directory cannot hold anything yet
        guarded = {
            "the current directory": os.getcwd(),
            "the home directory": os.path.expanduser("~"),
            "/": os.sep,
        }
        guarded |= {
            f"the input '{p}'": p for p in [*(i for i in inputs if os.path.exists(i)), *files]
        }
        for what, path in guarded.items():
            if _within(os.path.realpath(path), real):
                raise UserError(
                    f"prepare: --out '{out}' is or contains {what}; name a new directory for the"
                    " dataset"
                )
    for spec in inputs:
        if os.path.isdir(spec) and _within(real, os.path.realpath(spec)):
            raise UserError(
                f"prepare: --out '{out}' is inside the input directory '{spec}', whose files are"
                " all read as input; name a directory outside it"
            )


def _check_only_a_dataset(out: str) -> None:
    """An existing --out that --overwrite would replace: refused unless it is a directory that
    holds a prepared dataset and nothing else."""
    local = storage.is_local(out)
    only = "--overwrite replaces only a directory that holds a prepared dataset and nothing else"
    if (local and os.path.islink(out)) or not storage.isdir(out):
        raise UserError(
            f"prepare: --out '{out}' is"
            f" {'a symbolic link' if os.path.islink(out) else 'not a directory'}; {only}"
        )
    listed = listed_files(
        read_index(out, f"prepare: --out '{out}'", f"{only}; name a new directory")
    )
    present = set(storage.listdir(out))
    foreign = sorted(present - listed)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(
            f"prepare: --out '{out}' holds '{foreign[0]}'{more}, which prepare did not write;"
            f" {only}"
        )
    # prepare writes plain files only: a listed name that is a directory or a link holds (or points
    # at) something else, which deleting the old shards must not touch
    for name in sorted(present & listed):
        target = storage.join(out, name)
        if (local and os.path.islink(target)) or storage.isdir(target):
            kind = "a symbolic link" if local and os.path.islink(target) else "a directory"
            raise UserError(
                f"prepare: --out '{out}': '{name}', which its index names as a file of the dataset,"
                f" is {kind}; {only}"
            )


def replace_with(out: str, tmp: str) -> None:
    """Moves the finished `tmp` to `out`; an existing `out` (a dataset check_out accepted) goes only
    once the new one is in place, and only the files its index lists: anything that appeared since
    the check is kept, with a warning."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    listed = listed_files(
        read_index(out, f"prepare: --out '{out}'", "it changed while prepare ran")
    )
    trash = tempfile.mkdtemp(prefix=f"{os.path.basename(out)}.old-", dir=os.path.dirname(out))
    old = os.path.join(trash, "dataset")
    os.rename(out, old)
    os.rename(tmp, out)
    for name in listed:
        path = os.path.join(old, name)
        if os.path.isfile(path) and not os.path.islink(path):  # what prepare wrote: plain files
            os.remove(path)
    try:
        os.rmdir(old)
        os.rmdir(trash)
    except OSError:
        print(f"prepare: kept {old}: it holds files that prepare did not write", file=sys.stderr)


def make_tmp(out: str) -> str:
    """An empty directory next to `out` for the new dataset (renamed to `out` once complete)."""
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{os.path.basename(out)}.tmp-", dir=parent)
    except OSError as e:
        raise UserError(
            f"prepare: cannot create a directory next to --out '{out}': {e.strerror}"
        ) from None
