"""One path abstraction for run directories, checkpoints and prepared datasets: local paths and
object stores (`gs://`, `s3://`, `az://`, `hf://`) alike, through etils' `epath` (as Orbax).

A local path (no `scheme://`, or `file://`) goes through `os` as it always did: its atomic
renames, appends, memory maps and `flock` are what the run directory's guarantees rest on.
Anything else goes through `epath.Path`, whose backend is fsspec (gcsfs, s3fs, adlfs) or
TensorFlow's gfile when TensorFlow is installed; docs/storage.md says what to install. On an
object store

- a whole-object write is atomic (readers see the old object or the new one), so `write_text`
  needs no temporary name;
- there is no append: `append_text` reads the object and writes it back whole (for the
  run's small, rare records: resumes.jsonl, restarts.jsonl), and `AppendLog` (metrics.jsonl)
  rewrites its object from memory at most every `upload_every_s` and at close;
- there is no memory map: prepared shards are read by byte ranges (`read_range`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time

from errors import UserError

SCHEMES = ("gs://", "s3://", "az://", "hf://")
# scheme -> the package epath's fsspec backend needs for it, and the extra of pyproject.toml that
# installs it (None: not one of Brigade's extras)
BACKENDS = {
    "gs://": ("gcsfs", "gcs"),
    "s3://": ("s3fs", "s3"),
    "az://": ("adlfs", None),
    "hf://": ("huggingface_hub", None),
}


def is_local(p: str | os.PathLike) -> bool:
    """True for a local path: no URL scheme, or file://."""
    text = os.fspath(p)
    return "://" not in text or text.startswith("file://")


def local_path(p: str | os.PathLike) -> str:
    """A local path as os understands it (file:// stripped)."""
    text = os.fspath(p)
    return text[len("file://") :] if text.startswith("file://") else text


def path(p: str | os.PathLike):
    """`p` as an `epath.Path` (imported here: it costs ~0.2 s that local-only commands skip)."""
    require_backend(p)
    from etils import epath

    return epath.Path(p)


def require_backend(p: str | os.PathLike, flag: str = "") -> None:
    """UserError naming the package to install when `p`'s scheme needs one that is missing (fsspec
    would raise an ImportError from deep inside the first read or write); `flag`, where given,
    is the option that named `p`. With TensorFlow installed, epath uses its gfile instead, which
    needs none of them."""
    text = os.fspath(p)
    for scheme, (package, extra) in BACKENDS.items():
        if not text.startswith(scheme) or package in sys.modules:
            continue
        from fsspec.registry import registry  # the implementations registered in this process

        if scheme[:-3] in registry:  # imported already, or registered by the program itself
            continue
        if importlib.util.find_spec(package) is None and not _tensorflow_serves():
            how = f"pip install {package}" + (
                f" (or pip install 'brigade[{extra}]')" if extra else ""
            )
            raise UserError(
                f"{flag + ' ' if flag else ''}{text}: {scheme} paths need the {package} package,"
                f" which is not installed; {how}"
            )


def _tensorflow_serves() -> bool:
    """Whether epath reads URLs through TensorFlow's gfile (etils.epath.gpath's own rule)."""
    if os.environ.get("EPATH_USE_TF", "").lower() in ("false", "no", "f", "0"):
        return False
    return importlib.util.find_spec("tensorflow") is not None


def join(p: str, *names: str) -> str:
    """os.path.join for local paths; '/'-joined for URLs (never os.sep)."""
    if is_local(p):
        return os.path.join(p, *names)
    return "/".join([p.rstrip("/"), *names])


def absolute(p: str) -> str:
    """A local path made absolute; a URL as it is (it is absolute already)."""
    return os.path.abspath(local_path(p)) if is_local(p) else p.rstrip("/")


def basename(p: str) -> str:
    return (
        os.path.basename(os.path.normpath(local_path(p)))
        if is_local(p)
        else p.rstrip("/").rsplit("/", 1)[-1]
    )


def dirname(p: str) -> str:
    return os.path.dirname(local_path(p)) if is_local(p) else p.rstrip("/").rsplit("/", 1)[0]


def exists(p: str) -> bool:
    return os.path.exists(local_path(p)) if is_local(p) else path(p).exists()


def lexists(p: str) -> bool:
    """Whether anything is at `p`, a dangling symbolic link included (local); exists() for a URL."""
    return os.path.lexists(local_path(p)) if is_local(p) else path(p).exists()


def isdir(p: str) -> bool:
    return os.path.isdir(local_path(p)) if is_local(p) else path(p).is_dir()


def isfile(p: str) -> bool:
    return os.path.isfile(local_path(p)) if is_local(p) else path(p).is_file()


def listdir(p: str) -> list[str]:
    """The names in directory `p` (FileNotFoundError when there is none)."""
    if is_local(p):
        return os.listdir(local_path(p))
    if not path(p).is_dir():
        raise FileNotFoundError(2, "No such directory", p)
    return [child.name for child in path(p).iterdir()]


def makedirs(p: str) -> None:
    if is_local(p):
        os.makedirs(local_path(p), exist_ok=True)
    else:
        path(p).mkdir(parents=True, exist_ok=True)


def getsize(p: str) -> int:
    return os.path.getsize(local_path(p)) if is_local(p) else path(p).stat().length


def remove(p: str) -> None:
    """Delete file `p`; a missing one is no error."""
    if is_local(p):
        if os.path.exists(local_path(p)):
            os.remove(local_path(p))
    else:
        path(p).unlink(missing_ok=True)


def rename(src: str, dst: str) -> None:
    """os.rename locally; on an object store a copy and a delete of each object (not atomic)."""
    if is_local(src):
        os.rename(local_path(src), local_path(dst))
    else:
        path(src).rename(dst)


def open_file(p: str, mode: str = "r", **kw):
    """A file object: builtins.open for a local path, epath's for a URL (errors= and the like
    apply to local text files only: epath's text mode is UTF-8 throughout)."""
    if is_local(p):
        return open(local_path(p), mode, **kw)
    return path(p).open(mode)


def read_text(p: str) -> str:
    with open_file(p, "r", errors="replace") as f:
        return f.read()


def write_text(p: str, text: str) -> None:
    """Replace `p` with `text` so that a reader finds the old content or the new, never a part:
    a temporary file renamed over it locally; one object write on an object store."""
    if not is_local(p):
        path(p).write_text(text)
        return
    tmp = f"{local_path(p)}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, local_path(p))
    except OSError:
        if os.path.exists(tmp):  # a full disk: no half-written file left beside the run's own
            os.remove(tmp)
        raise


def append_text(p: str, text: str) -> None:
    """Add `text` at the end of `p` (created if missing). An object store cannot append: the
    object is read and written back whole, for small files written a few times per run."""
    if is_local(p):
        with open(local_path(p), "a") as f:
            f.write(text)
        return
    before = path(p).read_text() if path(p).exists() else ""
    path(p).write_text(before + text)


def read_range(p: str, offset: int, size: int) -> bytes:
    """`size` bytes of file `p` from byte `offset` (fewer at its end): one ranged read, not the
    whole object (fsspec's file objects fetch the bytes a seek and read ask for)."""
    with open_file(p, "rb") as f:
        f.seek(offset)
        return f.read(size)


def upload_dir(local_dir: str, url: str, last: str) -> None:
    """Copy the files of `local_dir` into directory `url`, `last` after all the others (a reader
    that finds it finds the rest), then delete the files of `url` that `local_dir` lacks (the
    caller checked that `url` held only files it may replace). Not atomic, as nothing on an
    object store is: a reader during the copy may see old and new files."""
    for name in sorted(os.listdir(local_dir), key=lambda n: n == last):
        with (
            open(os.path.join(local_dir, name), "rb") as src,
            path(join(url, name)).open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 24)
    for name in set(listdir(url)) - set(os.listdir(local_dir)):
        remove(join(url, name))


class AppendLog:
    """A text file that grows by lines (metrics.jsonl). Local: appended and flushed line by line
    (a reader tails it). Object store: the lines are kept and the object rewritten whole at most
    every `upload_every_s` seconds and at close (a write per line would cost a request each and
    rewrite ever more bytes), starting from what the object held."""

    def __init__(self, p: str, upload_every_s: float = 30.0):
        self.name, self.upload_every_s = p, upload_every_s
        if is_local(p):
            self._f, self._lines = open(local_path(p), "a"), None
        else:
            self._f, self._lines = None, [path(p).read_text()] if path(p).exists() else []
            self._uploaded = time.monotonic()

    def write(self, line: str) -> None:
        if self._f is not None:
            self._f.write(line)
            self._f.flush()
            return
        self._lines.append(line)
        if time.monotonic() - self._uploaded >= self.upload_every_s:
            self.flush()

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()
        else:
            path(self.name).write_text("".join(self._lines))
            self._uploaded = time.monotonic()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        else:
            self.flush()
