"""Telling a damaged checkpoint step from an intact one, and naming the damaged file.

A committed step is `<step>/{_CHECKPOINT_METADATA, state/{_METADATA, _sharding, manifest.ocdbt,
d/, ocdbt.process_<i>/d/}, meta/metadata}`. The small JSON files are checked whole before a step
is used (present, valid JSON, the shape their reader expects); the array data is checked by
reading it, once, in the restore itself: when that fails, `diagnose` turns the error into one line
naming the step and the file. Paths go through checkpoint/storage.py (local or object store);
the file named from tensorstore's error text is found for local steps, where its messages name it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import orbax.checkpoint as ocp

from checkpoint import storage
from errors import UserError

# Files every committed step has, relative to its directory; the JSON ones must also parse.
REQUIRED = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt", "meta/metadata")
JSON_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/_sharding", "meta/metadata")
_TS_FILE = re.compile(r'local file "([^"]*[^/"])"')  # tensorstore names the file it failed on
# ... or, for a stored value, the OCDBT key and the database: value_file finds the key's file
_OCDBT_KEY = re.compile(r'Error reading "([^"]+)" in OCDBT database at local file "([^"]+)/"')


class UnreadableCheckpoint(UserError):
    """A committed step whose files are missing, truncated or corrupt. `file` is the culprit
    (relative to the step directory) when it could be told, else ''."""

    def __init__(self, step_dir: str, file: str, reason: str):
        self.step_dir, self.file, self.reason = step_dir, file, reason
        where = f"file {file}: " if file else ""
        super().__init__(f"checkpoint {step_dir} is unreadable ({where}{reason})")


# What a cross-process wait says when it fails (XLA:CPU's gloo collectives, jax.distributed's
# barriers): the processes did not meet in time, which says nothing about the files.
_CROSS_PROCESS = re.compile(
    r"Gloo|collective|AllGather|AllReduce|[Bb]arrier|DEADLINE_EXCEEDED|UNAVAILABLE"
)


def cross_process_failure(err: BaseException) -> bool:
    """Whether `err` (or an exception it wraps) is a failed cross-process wait: a JAX runtime
    error of a collective or a barrier, not a damaged checkpoint file."""
    e, seen = err, 0
    while e is not None and seen < 8:
        if type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and _CROSS_PROCESS.search(
            str(e)
        ):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _first_line(e: Exception) -> str:
    return (
        f"{type(e).__name__}: "
        + (str(e).split("[tensorstore_spec=")[0].strip().splitlines() or [""])[0][:300]
    )


def _orbax_parser(rel: str) -> Callable[[Any], Any] | None:
    """Orbax's own parser of the JSON file `rel`, so that a file it would choke on is caught
    here."""
    if rel == "_CHECKPOINT_METADATA":
        from orbax.checkpoint._src.metadata import step_metadata_serialization

        return step_metadata_serialization.deserialize
    if rel == "state/_METADATA":
        from orbax.checkpoint._src.metadata import tree

        return tree.InternalTreeMetadata.from_json
    return None


def shape_problem(rel: str, raw: Any) -> str:
    """Why the parsed JSON file `rel` is not what Orbax expects there ('' if it is)."""
    parse = _orbax_parser(rel)
    try:
        if parse:
            parse(raw)
        elif not isinstance(raw, dict):
            raise ValueError(f"expected an object, got {type(raw).__name__}")
    except Exception as e:  # noqa: BLE001  (whatever Orbax's parser raises for a wrong shape)
        return f"not in Orbax's format: {_first_line(e)}"
    return ""


def step_metadata_problem(step_path: str) -> str:
    """Why Orbax cannot read this step's `_CHECKPOINT_METADATA` although it parses as JSON ('' if it
    can, or if the file is missing or not JSON: Orbax then lists the step and check_files names
    it)."""
    try:
        with storage.open_file(storage.join(step_path, "_CHECKPOINT_METADATA"), "rb") as f:
            raw = json.loads(f.read())
    except (OSError, ValueError):
        return ""
    return shape_problem("_CHECKPOINT_METADATA", raw)


class StepNames:
    """Orbax's standard step names (`<dir>/<step>`), listing only the steps Orbax can handle.

    When Orbax opens a directory it parses every step's `_CHECKPOINT_METADATA`, and one of the
    wrong shape (`[]`, a timestamp that is a string) stops it with a bare ValueError: one damaged
    step would make the whole directory unusable. Such steps stay out of Orbax's list; `unlisted`
    keeps their reasons, and the Checkpointer reports them as unreadable steps. With `skip_links`,
    steps that are symbolic links stay out too: Orbax removes old steps (keep) with rmtree, which
    refuses a link ('Cannot call rmtree on a symbolic link') and so fails every save."""

    def __init__(self, skip_links: bool):
        self._standard = ocp.step.standard_name_format()
        self.skip_links = skip_links
        self.unlisted: dict[int, str] = {}  # step -> why Orbax cannot list it

    def build_name(self, step: int) -> str:
        return self._standard.build_name(step)

    def find_step(self, base_path, step: int):
        return self._standard.find_step(base_path, step)

    def find_all(self, base_path) -> Iterator:
        listed, self.unlisted = [], {}
        for m in self._standard.find_all(base_path):
            if self.skip_links and os.path.islink(m.path):
                continue
            problem = step_metadata_problem(str(m.path))
            if problem:
                self.unlisted[m.step] = problem
            else:
                listed.append(m)
        return iter(listed)


def unused_path(path: str) -> str:
    """`path`, or `path2`, `path3`, ... : the first that does not exist (nothing is overwritten)."""
    out, n = path, 1
    while storage.lexists(out):
        n += 1
        out = f"{path}{n}"
    return out


def set_aside_links(directory: str) -> None:
    """Rename each step of the (local) checkpoint `directory` that is a symbolic link to
    `<step>.symlink`: the link itself, never its target. Orbax would list it as a step and, once it
    is old enough, fail every save trying to delete it; a link is also no checkpoint this
    directory's retention may delete through."""
    for name in sorted(os.listdir(directory)):
        link = os.path.join(directory, name)
        if not (name.isdigit() and os.path.islink(link)):
            continue
        target, dst = os.readlink(link), unused_path(f"{link}.symlink")
        try:
            os.rename(link, dst)
        except OSError as e:
            raise UserError(
                f"checkpoint step {link} is a symbolic link (to {target}) and cannot be set"
                f" aside ({e.strerror}); move it out of {directory}"
            ) from None
        print(
            f"warning: checkpoint step {link} is a symbolic link (to {target}); set aside as"
            f" {dst} (the link only, its target untouched) so that removing old steps never"
            " deletes through it",
            flush=True,
        )


def check_files(step_dir: str, check_meta: Callable[[Any, str], Any]) -> None:
    """UnreadableCheckpoint if one of the step's metadata files is missing, is not valid JSON or is
    JSON of the wrong shape (`check_meta(parsed, step_dir)` checks meta/metadata). Cheap: nothing
    but those small files is read."""
    for rel in REQUIRED:
        if not storage.isfile(storage.join(step_dir, rel)):
            raise UnreadableCheckpoint(step_dir, rel, "missing")
    for rel in JSON_FILES:
        path = storage.join(step_dir, rel)
        if not storage.exists(path):
            continue
        try:
            with storage.open_file(path, "rb") as f:
                raw = json.loads(f.read())  # JSON only: nothing in a checkpoint is ever unpickled
        except (OSError, ValueError) as e:
            raise UnreadableCheckpoint(step_dir, rel, f"not valid JSON: {e}") from None
        if rel == "meta/metadata":
            check_meta(raw, step_dir)
        elif problem := shape_problem(rel, raw):
            raise UnreadableCheckpoint(step_dir, rel, problem)
    data = storage.join(step_dir, "state", "d")
    if storage.isdir(data):
        for name in sorted(storage.listdir(data)):
            if storage.getsize(storage.join(data, name)) == 0:
                raise UnreadableCheckpoint(step_dir, f"state/d/{name}", "empty")


def diagnose(step_dir: str, err: Exception, check: Callable[[], None]) -> UnreadableCheckpoint:
    """The UnreadableCheckpoint for `err`, raised while reading the step in `step_dir`. Orbax wraps
    tensorstore's error (which names the file or the OCDBT key) in one that names neither
    ('Encountered error while reading array index ... <bound method pybind11...>'), so the
    innermost cause speaks; with no file in any message, `check` (the metadata check) may name
    one."""
    chain = [err]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    reason = _first_line(chain[-1])
    for e in reversed(chain):  # the innermost first
        key = _OCDBT_KEY.search(str(e))
        if key and os.path.abspath(key.group(2)) == os.path.join(step_dir, "state"):
            found = value_file(os.path.join(step_dir, "state"), key.group(1))
            if found:  # the file is named: the database's path in the reason says nothing more
                short = reason.replace(key.group(0), f'Error reading "{key.group(1)}"')
                return UnreadableCheckpoint(step_dir, found[0], found[1] or short)
        files = [f for f in _TS_FILE.findall(str(e)) if f.startswith(step_dir + os.sep)]
        if files:
            return UnreadableCheckpoint(step_dir, os.path.relpath(files[-1], step_dir), reason)
    if getattr(err, "filename", None):
        return UnreadableCheckpoint(step_dir, os.path.relpath(str(err.filename), step_dir), reason)
    try:
        check()
    except UnreadableCheckpoint as u:
        return u
    return UnreadableCheckpoint(step_dir, "", reason)


def value_file(state_dir: str, key: str) -> tuple[str, str] | None:
    """(the file holding OCDBT `key`'s value, relative to the step directory; 'missing' or
    'truncated ...' when its size tells, else ''), or None if the B+tree does not tell. Descends
    the tree through tensorstore's node dump: a few small reads, done only after a failure."""
    import tensorstore as ts

    try:
        url = f"file://{state_dir}/" if storage.is_local(state_dir) else f"{state_dir.rstrip('/')}/"
        base = ts.KvStore.open(url).result()
        location = ts.ocdbt.dump(base).result()["versions"][-1]["root"].get("location")
        prefix, target = b"", key.encode()
        while location:
            node = ts.ocdbt.dump(base, location).result()
            entries = node["entries"]
            if node["height"] == 0:
                hit = next((e for e in entries if prefix + e["key"] == target), None)
                return (
                    None
                    if hit is None
                    else _stat_value(state_dir, hit.get("indirect_value") or location)
                )
            # an interior entry's key is the first of its subtree, whose keys drop its common prefix
            below = [e for e in entries if prefix + e["key"] <= target] or entries[:1]
            location, prefix = below[-1]["location"], prefix + below[-1]["subtree_common_prefix"]
    except Exception:  # noqa: BLE001  (a damaged tree: the caller falls back to the error's text)
        return None
    return None


def _stat_value(state_dir: str, location: str) -> tuple[str, str]:
    """An OCDBT location ('value:<base>:<file>:<offset>:<length>', or the 'btreenode:...' of a
    value stored inline) -> (its file relative to the step directory, 'missing' / 'truncated ...'
    when its size shows it, else '')."""
    head, offset, length = location.rsplit(":", 2)
    _, base, rel = head.split(":", 2)
    parts = [part.strip("/") for part in (base, rel) if part.strip("/")]
    path = storage.join(state_dir, *parts)
    rel_step = "/".join([storage.basename(state_dir), *parts])
    if not storage.exists(path):
        return rel_step, "missing"
    size, need = storage.getsize(path), int(offset) + int(length)
    return rel_step, (
        f"truncated: {size} bytes, a stored value needs {need}" if size < need else ""
    )
