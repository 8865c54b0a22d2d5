"""How Brigade sets Orbax up: the checkpoint manager of one directory (its retention, step names,
and a process-local copy's options), the type handlers (replica-parallel saving only where it pays
off), and Orbax's routine log records kept to one line.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoint.integrity import StepNames
from checkpoint.owner import Owner, Retention


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


def quiet_routine_records() -> None:
    """Install the filters above on absl's logger, which Orbax logs through."""
    logging.getLogger("absl").addFilter(_QuietBackgroundSaveErrors())
    logging.getLogger("absl").addFilter(_QuietLocalSaves())


def type_handlers(process_local: bool) -> ocp.type_handlers.TypeHandlerRegistry:
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


def checkpoint_manager(
    directory: str,
    names: StepNames,
    *,
    keep: int,
    keep_every: int,
    run_owner: Owner | None,
    async_save: bool,
    create: bool,
    process_local: bool,
) -> ocp.CheckpointManager:
    """Orbax's manager of `directory`: a `state` item (the TrainState's arrays) and a `meta` item
    (JSON) per step, steps named by `names`. process_local: this process alone writes, creates
    its directories and commits (no barrier with the others), as a local tier's copy does."""
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
        # Orbax's create is a barrier for the other processes
        create=create and not process_local,
        step_name_format=names,
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
    alone_options = {"multiprocessing_options": alone} if alone else {}
    json_handler = ocp.JsonCheckpointHandler(**alone_options)
    state_handler = ocp.PyTreeCheckpointHandler(
        type_handler_registry=type_handlers(process_local), **alone_options
    )
    return ocp.CheckpointManager(
        directory, options=options, item_handlers={"state": state_handler, "meta": json_handler}
    )
