"""The runs/ folder of named runs (train/run/rundir.py start_named_run): which run is the newest when
`runs/latest` no longer leads to one, and taking back a named directory that a refused run made.

`runs/latest` is a symbolic link to the newest named run. It dangles once its target is deleted
or moved (a user cleaning up a failed run, a sync that skipped it). `--resume latest` means
"continue the newest run"; it never writes into the run it continues (the continuation gets a
directory of its own and only reads the checkpoint), so falling back to the newest run that
still exists is safe, and it is what the link would have named had the missing run never been.
The settings check of `--resume latest` then applies to that run as to any other.
"""

from __future__ import annotations

import os
import re

# <YYYYmmdd-HHMMSS>-<model>-<mesh>[-N]: the names start_named_run gives (rundir.run_name)
_NAMED = re.compile(r"^\d{8}-\d{6}-")
# a named run directory this process made -> the target `runs/latest` had before (None: no link)
_made: dict[str, str | None] = {}


def newest_run(root: str) -> str | None:
    """The newest named run under `root` that exists and has started (its config.json): by the
    start time in its name, then by when it wrote its config (two runs of one second). None
    when there is none. Links are not runs (`latest` itself, or a user's)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        path = os.path.join(root, name)
        config = os.path.join(path, "config.json")
        if _NAMED.match(name) and not os.path.islink(path) and os.path.isfile(config):
            found.append((name[:15], os.path.getmtime(config), path))
    return max(found)[2] if found else None


def dangling_target(link: str) -> str | None:
    """Where `link` points when it is a symbolic link to nothing, else None."""
    if os.path.islink(link) and not os.path.exists(link):
        return os.readlink(link)
    return None


def instead_of_dangling(link: str) -> str | None:
    """--resume latest when `link` dangles: the newest run that exists (None: none), said in
    one line with where the link points."""
    root, prev = os.path.dirname(link), newest_run(os.path.dirname(link))
    then = f"continuing the newest run that exists, {prev}" if prev else "no other run under"
    print(
        f"warning: --resume latest: {link} is a dangling link (to {dangling_target(link)}, which"
        f" does not exist); " + (then if prev else f"{then} {root}; starting a new one"),
        flush=True,
    )
    return prev


def note_made(run_dir: str, link: str) -> None:
    """start_named_run made `run_dir` and is about to point `link` at it: remember the link's
    target before, for `withdraw`."""
    _made[run_dir] = os.readlink(link) if os.path.islink(link) else None


def withdraw(run_dir: str, link: str) -> bool:
    """Take back a named run directory this process made, when the run was refused before it
    wrote anything (it is empty): remove it and point `link` back where it pointed before (or
    remove the link, when there was none). A directory holding anything stays, and so does a
    link that another run has re-pointed since. -> whether it was withdrawn."""
    if run_dir not in _made:
        return False
    before = _made.pop(run_dir)
    try:
        os.rmdir(run_dir)  # only an empty directory: the run wrote nothing of its own
    except OSError:
        return False
    try:
        if os.path.islink(link) and os.readlink(link) == os.path.basename(run_dir):
            if before is None:
                os.remove(link)
            else:
                tmp = f"{link}.{os.getpid()}.tmp"
                os.symlink(before, tmp)
                os.replace(tmp, link)
    except OSError:  # the link is a convenience: a failure to restore it loses nothing
        pass
    return True
