"""Orbax checkpoints of the train state: asynchronous, sharded, restorable onto any mesh.

A checkpoint directory holds one directory per step, `<dir>/<step>/{state/, meta/}`: `state` the
TrainState arrays (OCDBT/tensorstore; every process writes only its own shards), `meta` a
human-readable JSON (config, model config, mesh, data position, versions). Orbax commits a step
atomically (written under `<step>.orbax-checkpoint-tmp`, renamed on success), so a process killed
mid-save leaves the previous step as the latest and the half-written one is never listed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoint import storage
from checkpoint.array_store import check_array_store
from checkpoint.echoes import quiet_failed_read_echoes
from checkpoint.integrity import (
    StepNames,
    UnreadableCheckpoint,
    check_files,
    cross_process_failure,
    diagnose,
)
from checkpoint.layout import (  # noqa: F401  (RUN_SUBDIR: for callers)
    RUN_SUBDIR,
    check_meta,
    is_params_only,
    lora_mismatch,
)
from checkpoint.owner import Owner, Retention
from errors import UserError, expect
from mesh.shard import path_names


class _QuietBackgroundSaveErrors(logging.Filter):
    """Orbax logs a failed background write (e.g. a full disk) with long tracebacks from its
    threads before the error reaches the caller, which reports it in one line
    (checkpoint.saving.SaveFailed); keep Orbax's record, as one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "orbax" in record.pathname:
            record.msg, record.args = record.getMessage().splitlines()[0][:300], ()
            record.exc_info = record.exc_text = None
        return True


class _QuietLocalSaves(logging.Filter):
    """Orbax warns at every save of a process-local checkpoint (the local tier) that it logs no
    global write speed for it: nothing to act on, once per save."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Global object size logging disabled" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietBackgroundSaveErrors())
logging.getLogger("absl").addFilter(_QuietLocalSaves())
quiet_failed_read_echoes()


_is_array = lambda x: hasattr(x, "shape")  # noqa: E731  (ShapeDtypeStruct, jax.Array, ArrayMetadata)


def _type_handlers(process_local: bool) -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's standard handlers, with replica-parallel saving only where it can pay off.

    Replica-parallel saving splits the writing of a replicated shard over its replicas; that only
    helps when the replicas live on different hosts. On one host it buys nothing and costs an
    eager `lax.slice` per (array, replica) that XLA compiles on the first save: 3.7 s of blocked
    loop for the tiny model on data=4,model=2 (measured; 0.05 s without).

    process_local: every process writes every shard it holds (the replica of its first shard, not
    replica 0, which may live on another process) and finalizes alone: the configuration of
    Orbax's emergency (local) checkpoint manager."""
    th = ocp.type_handlers
    scalar = th.ScalarHandler()
    array = (
        th.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)
        if process_local
        else th.ArrayHandler(use_replica_parallel=None if jax.process_count() > 1 else False)
    )
    return th.create_type_handler_registry(
        (int, scalar),
        (float, scalar),
        (bytes, scalar),
        (np.number, scalar),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, array),
        (str, th.StringHandler()),
    )


def _unused(path: str) -> str:
    """`path`, or `path2`, `path3`, ... : the first that does not exist (nothing is overwritten)."""
    out, n = path, 1
    while storage.lexists(out):
        n += 1
        out = f"{path}{n}"
    return out


def shared_directory(path: str) -> str:
    """Process 0's absolute `path`, on every process: all processes must write one checkpoint,
    so the directory is the one process 0 was given (it must be on storage every host reaches)."""
    path = storage.absolute(path)
    if jax.process_count() == 1:
        return path
    from jax.experimental import multihost_utils

    buf = np.zeros(4096, np.uint8)
    raw = np.frombuffer(path.encode()[:4096], np.uint8)
    buf[: len(raw)] = raw
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(buf[buf != 0]).decode()


class Checkpointer:
    """One checkpoint directory: save (asynchronous), list, read metadata, restore onto any mesh."""

    def __init__(
        self,
        directory: str,
        *,
        keep: int = 3,
        keep_every: int = 0,
        async_save: bool = True,
        create: bool = True,
        process_local: bool = False,
        flag: str = "--checkpoint.dir",
        run_owner: Owner | None = None,
    ):
        """process_local: this process's own copy on host-local storage (the local tier,
        checkpoint/tiers.py): it writes every shard it holds and commits without the other
        processes, which do the same into their own directories. `flag`: the option named when
        the directory cannot be created. `run_owner`: the run saving here and the steps it
        wrote, the only ones retention deletes (checkpoint/owner.py); None: every step is its own."""
        directory = storage.absolute(directory)
        check_array_store(directory, flag)  # s3:// and the like would fail at the first save
        owner = (
            process_local or jax.process_index() == 0
        )  # who creates, checks and tidies the directory
        if create:
            try:
                if owner:
                    storage.makedirs(directory)
            except OSError as e:
                raise UserError(f"{flag}: cannot create '{directory}': {e.strerror or e}") from None
            # an object store says whether a write is allowed only when one is tried (the first save)
            if owner and storage.is_local(directory) and not os.access(directory, os.W_OK):
                raise UserError(f"{flag}: '{directory}' is not writable")
        elif not storage.isdir(directory):
            raise UserError(f"'{directory}': no such checkpoint directory")
        self.directory, self.process_local, self.run_owner = directory, process_local, run_owner
        self.companions: list = []  # savers of the same run closed with this one (the local tier)
        if create and owner and storage.is_local(directory):  # object stores have no symbolic links
            self._set_aside_links()
        self._names = StepNames(
            skip_links=create
        )  # a reader never deletes: it may read through a link
        alone = (
            ocp.options.MultiprocessingOptions(  # no barrier with the other processes
                primary_host=None,
                active_processes={jax.process_index()},
                # the directory's name too: a process's own copy and the one it keeps of a peer
                # (checkpoint/peer_copy.py) are two managers whose barriers must not meet
                barrier_sync_key_prefix=(
                    f"brigade-local-{jax.process_index()}-{os.path.basename(directory)}"
                ),
            )
            if process_local
            else None
        )
        options = ocp.CheckpointManagerOptions(
            # the newest `keep` of this run's own steps, steps % keep_every == 0, others' steps
            preservation_policy=Retention(keep, keep_every, run_owner),
            enable_async_checkpointing=async_save,
            create=create
            and not process_local,  # Orbax's create: a barrier for the other processes
            step_name_format=self._names,
            **(
                dict(
                    multiprocessing_options=alone,
                    save_root_metadata=False,
                    enable_per_process_directory_creation=True,
                )
                if alone
                else {}
            ),
        )
        json_handler = ocp.JsonCheckpointHandler(
            **({"multiprocessing_options": alone} if alone else {})
        )
        state_handler = ocp.PyTreeCheckpointHandler(
            type_handler_registry=_type_handlers(process_local),
            **({"multiprocessing_options": alone} if alone else {}),
        )
        self._mngr = ocp.CheckpointManager(
            directory, options=options, item_handlers={"state": state_handler, "meta": json_handler}
        )

    # -- listing and metadata (nothing is loaded) ------------------------------------------------
    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Every committed step, also those whose `_CHECKPOINT_METADATA` Orbax cannot read (reading
        them raises UnreadableCheckpoint, so the loop falls back past them like any damaged step)."""
        return sorted(set(self._mngr.all_steps()) | set(self._names.unlisted))

    def step_dir(self, step: int) -> str:
        return storage.join(self.directory, str(step))

    def meta(self, step: int) -> dict:
        """The step's `meta` JSON; UnreadableCheckpoint naming the field when it is not of the shape
        make_meta writes (checkpoint.layout.META_SCHEMA)."""
        with self._reading(step):
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
                "meta"
            ]
        return check_meta(meta, self.step_dir(step))

    def _set_aside_links(self) -> None:
        """Rename each step that is a symbolic link to `<step>.symlink`: the link itself, never its
        target. Orbax would list it as a step and, once it is old enough, fail every save trying to
        delete it; a link is also no checkpoint this directory's retention may delete through."""
        for name in sorted(os.listdir(self.directory)):
            link = os.path.join(self.directory, name)
            if not (name.isdigit() and os.path.islink(link)):
                continue
            target, dst = os.readlink(link), _unused(f"{link}.symlink")
            try:
                os.rename(link, dst)
            except OSError as e:
                raise UserError(
                    f"checkpoint step {link} is a symbolic link (to {target}) and cannot be set aside"
                    f" ({e.strerror}); move it out of {self.directory}"
                ) from None
            print(
                f"warning: checkpoint step {link} is a symbolic link (to {target}); set aside as {dst}"
                f" (the link only, its target untouched) so that removing old steps never deletes through it",
                flush=True,
            )

    # -- integrity ------------------------------------------------------------------------------
    def check_files(self, step: int) -> None:
        """UnreadableCheckpoint if one of the step's metadata files is missing, is not valid JSON
        or is JSON of the wrong shape (cheap: only those small files are read; damaged array data
        fails the read of the arrays, and `_reading` then names its file)."""
        if step in self._names.unlisted:
            raise UnreadableCheckpoint(
                self.step_dir(step), "_CHECKPOINT_METADATA", self._names.unlisted[step]
            )
        check_files(self.step_dir(step), check_meta)

    def _check_whole(self, step: int) -> dict:
        """check_files -> the step's meta; UserError for a local-tier copy of a multi-process run
        read as an ordinary checkpoint (--resume PATH, --init-from, export): it holds only the
        shards of the process that wrote it, and the others would read back as zeros."""
        self.check_files(step)
        meta = self.meta(step)
        local = {} if self.process_local else meta.get("local", {})
        if local.get("processes", 1) > 1:
            raise UserError(
                f"checkpoint {self.step_dir(step)} is process {local.get('process')}'s local-tier copy"
                f" of a {local['processes']}-process run: it holds only that process's shards; use a"
                f" step of the run's --checkpoint.dir"
            )
        return meta

    @contextlib.contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """Turn any failure to read step `step` (Orbax, tensorstore, JSON, OS errors) into an
        UnreadableCheckpoint naming the step directory and, where it can be told, the file."""
        if step in self._names.unlisted:  # Orbax does not list it: reading would say only 'no step'
            self.check_files(step)
        try:
            yield
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (whatever a damaged file makes Orbax raise)
            if cross_process_failure(
                e
            ):  # the processes did not meet: the files may be fine, never set them aside
                raise
            raise diagnose(self.step_dir(step), e, lambda: self.check_files(step)) from None

    def arrays(self, step: int) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """(name, global shape, dtype) of every saved array, from Orbax's metadata files: step,
        then params, then the optimizer state."""
        with self._reading(step):
            saved = self._mngr.item_metadata(step)["state"]
        out = [
            (n, tuple(m.shape), np.dtype(m.dtype)) for n, m in path_names(saved, is_leaf=_is_array)
        ]
        return sorted(
            out, key=lambda a: ({"step": 0, "params": 1}.get(a[0].split("/")[0], 2), a[0])
        )

    # -- save and restore --------------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: dict) -> None:
        """Returns once the device arrays are copied to host memory (so the caller may donate or
        overwrite them); with async_save the files are written and committed in the background."""
        if self.run_owner is not None:
            self.run_owner.wrote(step)  # before Orbax's retention, which consults it, runs
        self._mngr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore into `abstract_state` (ShapeDtypeStructs with shardings, on any mesh): each
        device reads only the slices of the saved arrays that its new shards cover. Nothing is
        read twice: damaged array data fails the restore itself, which then names the file."""
        meta = self._check_whole(step)
        self.check_compatible(step, abstract_state, meta)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        with self._reading(step):
            out = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args)
                ),
            )
        return out["state"], meta

    def set_aside(self, step: int, suffix: str = ".unreadable") -> str:
        """Rename an unreadable step to `<step>.unreadable` (Orbax then no longer lists it, and this
        run may save that step again); nothing is deleted. -> the new path."""
        src = self.step_dir(step)
        dst = f"{src}{suffix}"
        if self.process_local or jax.process_index() == 0:
            dst = _unused(dst)
            storage.rename(src, dst)
        if jax.process_count() > 1 and not self.process_local:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"brigade_set_aside_{step}")
        self._mngr.reload()
        return dst

    def delete(self, step: int) -> None:
        """Remove `step` from a local tier (this process's own copy: no other process is involved)."""
        shutil.rmtree(self.step_dir(step))
        self._mngr.reload()

    def restore_params_to_host(self, step: int) -> dict:
        """Only the `params` subtree, as numpy arrays in host memory (the optimizer state is not read)."""
        self._check_whole(step)
        with self._reading(step):
            saved = self._mngr.item_metadata(step)["state"]
        try:
            params_md = saved["params"]
        except (KeyError, TypeError):
            raise UserError(f"checkpoint {self.step_dir(step)} has no 'params'") from None
        item = {
            "params": jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
                params_md,
                is_leaf=_is_array,
            )
        }
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        with self._reading(step):
            out = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=item, restore_args=restore_args, partial_restore=True
                    )
                ),
            )
        return out["state"]["params"]

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the `params` subtree, read straight into `abstract_params`' shardings (on any mesh;
        cast to their dtypes), from a full or a parameters-only checkpoint. UserError listing the
        arrays whose shapes differ."""
        self._check_whole(step)
        self._check_shapes(step, abstract_params, prefix="params/", what=" (parameters)")
        item = {"params": abstract_params}
        with self._reading(step):
            out = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=item,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                        partial_restore=True,
                    )
                ),
            )
        return out["state"]["params"]

    def check_compatible(self, step: int, abstract_state: Any, meta: dict | None = None) -> None:
        """UserError listing every array whose saved shape differs from `abstract_state`'s (metadata only)."""
        if is_params_only(meta or self.meta(step)):
            raise UserError(
                f"checkpoint {self.step_dir(step)} holds parameters only (an export);"
                f" it cannot resume training"
            )
        self._check_shapes(step, abstract_state)

    def _check_shapes(self, step: int, abstract: Any, prefix: str = "", what: str = "") -> None:
        """UserError listing every saved array under `prefix` whose shape differs from `abstract`'s
        (a tree below `prefix`), and those only one side has; reads metadata only."""
        saved = {n: shape for n, shape, _ in self.arrays(step) if n.startswith(prefix)}
        want = {prefix + n: tuple(s.shape) for n, s in path_names(abstract, is_leaf=_is_array)}
        bad = [
            f"{n}: checkpoint {saved[n] if n in saved else 'has none'} vs model {shape}"
            for n, shape in want.items()
            if saved.get(n) != shape
        ]
        bad += [
            f"{n}: checkpoint {shape} vs model has none"
            for n, shape in saved.items()
            if n not in want
        ]
        if bad:
            lora = lora_mismatch(self.meta(step), saved, want, self.step_dir(step))
            if lora:  # adapters for a whole model, or the reverse: their arrays would only confuse
                raise UserError(lora)
            raise UserError(
                f"checkpoint {self.step_dir(step)}{what} does not match this model config"
                f" ({len(bad)} arrays differ): "
                + "; ".join(bad[:8])
                + (" ..." if len(bad) > 8 else "")
            )

    def wait(self) -> None:
        """Block until every save in flight is committed."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Commit what is in flight and close, the companions too (each one even if another failed)."""
        with contextlib.ExitStack() as closing:
            for other in self.companions:
                closing.callback(other.close)
            self._mngr.wait_until_finished()
            self._mngr.close()


def open_checkpoint(path: str) -> tuple[Checkpointer, int]:
    """PATH -> (its checkpoint directory, opened for reading; the step). PATH may be one step's
    directory (`.../checkpoints/40`), a checkpoint directory (its latest committed step), a
    run directory (its `checkpoints/`) or a local tier's directory (the copy of its first process
    that holds a step: `process-0/`, else the next)."""
    expect("open_checkpoint", "path", path, (str, os.PathLike), "a directory's path")
    path = storage.absolute(os.fspath(path))
    if not storage.isdir(path):
        raise UserError(f"'{path}': no such checkpoint directory")
    base = storage.basename(path)
    if base.isdigit() and storage.isdir(storage.join(path, "state")):
        ck = Checkpointer(storage.dirname(path), create=False)
        if int(base) not in ck.all_steps():
            raise UserError(f"'{path}' is not a committed checkpoint (its save never finished)")
        return ck, int(base)
    # a local tier's directory (checkpoint/tiers.py) holds one checkpoint directory per process
    processes = sorted(
        (n for n in storage.listdir(path) if re.fullmatch(r"process-\d+", n)),
        key=lambda n: int(n[8:]),
    )
    for d in (path, storage.join(path, RUN_SUBDIR), *(storage.join(path, n) for n in processes)):
        if storage.isdir(d):
            ck = Checkpointer(d, create=False)
            step = ck.latest_step()
            if step is not None:
                return ck, step
    raise UserError(
        f"'{path}' holds no committed checkpoint (expected a step directory such as"
        f" checkpoints/40, a checkpoint directory, a run directory or a --checkpoint.local_dir)"
    )
