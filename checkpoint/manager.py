"""Orbax checkpoints of the train state: asynchronous, sharded, restorable onto any mesh.

A checkpoint is `<dir>/<step>/{state/, meta/}`: `state` holds the TrainState arrays (every process
writes only its own shards, OCDBT/tensorstore), `meta` a human-readable JSON (config, model
config, mesh, data position). Orbax commits a step atomically (a temporary directory renamed on
success), so a process killed mid-save leaves the previous step as the latest.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from mesh.errors import UserError
from mesh.shard import path_names


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, keep_every: int = 0, async_save: bool = True):
        directory = os.path.abspath(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise UserError(f"--checkpoint.dir: cannot create '{directory}': {e.strerror}") from None
        if not os.access(directory, os.W_OK):
            raise UserError(f"--checkpoint.dir: '{directory}' is not writable")
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep > 0 else None,
            keep_period=keep_every if keep_every > 0 else None,  # recovery points, never deleted
            enable_async_checkpointing=async_save, create=True)
        self._mngr = ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Returns once device arrays are copied to host; the write continues in the background."""
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore into `abstract_state`'s shardings (any mesh): each device reads only its shards."""
        self._check_shapes(step, abstract_state)
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def meta(self, step: int) -> dict:
        return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _check_shapes(self, step: int, abstract_state: Any) -> None:
        saved = self._mngr.item_metadata(step)["state"]
        saved_shapes = {n: tuple(m.shape) for n, m in path_names(saved, is_leaf=lambda x: hasattr(x, "shape"))}
        want = {n: tuple(s.shape) for n, s in path_names(abstract_state, is_leaf=lambda x: hasattr(x, "shape"))}
        bad = [f"{n}: checkpoint {saved_shapes.get(n, 'missing')} vs model {shape}"
               for n, shape in want.items() if saved_shapes.get(n) != shape]
        if bad:
            raise UserError(f"checkpoint {self.directory}/{step} does not match this model config"
                            f" ({len(bad)} arrays): " + "; ".join(bad[:6]) + (" ..." if len(bad) > 6 else ""))

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
