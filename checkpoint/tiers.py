"""The local tier: frequent saves to host-local storage, next to the persistent checkpoints.

`--checkpoint.local_dir DIR` gives each process its own checkpoint directory, `DIR/process-<i>`,
on storage only its host reaches (a local SSD, a RAM disk). Every `--checkpoint.local_every`
steps each process writes there every shard it holds, and commits it without waiting for the
others (Orbax's local-checkpoint configuration: no primary host, no cross-process barrier); the
persistent tier (`--checkpoint.dir`, shared storage) still saves every `--checkpoint.every` steps.
A step is saved to one tier: the persistent one when both are due.

A process's copy holds only the shards of the mesh it was saved on, so it restores only onto
that mesh, laid out on the same devices in the same processes: its meta records the layout
(`meta.local`), and a step saved on another layout is never read (reading it would fill the
shards it lacks with zeros). Resume (train/run/resume.py) takes the newest step that every process
holds intact locally when it is newer than the persistent tier's newest, and the persistent tier
otherwise; the processes decide that together, so that they all resume from one step. With
several processes each also keeps the copy of the process before it (checkpoint/peer_copy.py), so
that a process whose disk is lost still resumes from the newest local step.

Orbax's own multi-tier manager (orbax.checkpoint.experimental.emergency) is not used: with one
data-parallel replica it ignores the local directory altogether (a one-process run would have
no local tier), it needs the state replicated across the replicas of one mesh axis (FSDP across
hosts is not), it saves the arrays alone (no metadata: data position, config), and it would
replace the persistent checkpoints' integrity checks and fall-back.
"""

from __future__ import annotations

import contextlib
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from checkpoint.manager import Checkpointer
from errors import UserError

LOCAL_FLAG = "--checkpoint.local_dir"
# the newest local steps each process tells the others about (local_keep is a few)
_SHARED_STEPS = 64


def process_dir(local_dir: str, process: int) -> str:
    """A process's own directory in the local tier."""
    return os.path.join(os.path.abspath(local_dir), f"process-{process}")


def local_tier(
    saver: Checkpointer, local_dir: str, *, keep: int, async_save: bool, run_owner=None
) -> Checkpointer | None:
    """The local tier of the run saving into `saver` (the persistent tier): opened on the first
    ask and closed with `saver` (it is one of its companions); None without `local_dir`. Every
    process opens its own; UserError on every process when one cannot (not writable, or inside
    the persistent directory, where its steps would be taken for the run's shared checkpoints)."""
    if not local_dir:
        return None
    for tier in saver.companions:
        if tier.process_local:
            return tier
    root, shared = os.path.abspath(local_dir), saver.directory
    own = process_dir(root, jax.process_index())

    def within(inner: str, outer: str) -> bool:
        return inner == outer or inner.startswith(outer + os.sep)

    error, tier = None, None
    try:
        if within(root, shared) or within(shared, own):
            raise UserError(
                f"{LOCAL_FLAG} {local_dir}: inside the persistent checkpoint directory {shared}"
                f" (or holding it); choose a directory outside it, on storage local to each host"
            )
        tier = Checkpointer(
            own,
            keep=keep,
            async_save=async_save,
            process_local=True,
            flag=LOCAL_FLAG,
            run_owner=run_owner,  # its own steps alone are deleted (checkpoint/owner.py)
        )
    except UserError as e:
        error = e
    if not all_processes(error is None) and error is None:
        raise UserError(
            f"{LOCAL_FLAG} {local_dir}: another process could not use it (its error says why)"
        )
    if error is not None:
        raise error
    saver.companions.append(tier)
    return tier


def all_processes(ok: bool) -> bool:
    """Whether `ok` holds on every process (each process passes its own)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def steps_everywhere(tier: Checkpointer) -> list[int]:
    """The committed steps that every process holds in its local tier, newest first."""
    mine = sorted(tier.all_steps(), reverse=True)[:_SHARED_STEPS]
    if jax.process_count() == 1:
        return mine
    padded = np.full(_SHARED_STEPS, -1, np.int64)
    padded[: len(mine)] = mine
    held = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), -1)
    common = set(held[0].tolist()).intersection(*(row.tolist() for row in held[1:])) - {-1}
    return sorted(common, reverse=True)


def layout(mesh: Mesh) -> dict:
    """What a process's local copy depends on: this process and the devices of the mesh, in
    order."""
    return {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "device_ids": [int(d.id) for d in mesh.devices.flat],
    }


def saved_elsewhere(tier: Checkpointer, step: int, mesh: Mesh) -> str:
    """'' when this process's copy of `step` restores onto `mesh` here, else why not."""
    saved = tier.meta(step).get("local")
    if saved != layout(mesh):
        return (
            f"local step {step} in {tier.directory} was saved by another process or on another mesh"
            f" layout (it holds only that process's shards)"
        )
    return ""


def drop_after(tier: Checkpointer, step: int | None) -> None:
    """Delete this process's local steps after `step` (all with None): they belong to a trajectory
    the run no longer continues (this run resumes from `step`), and new saves would collide. A
    step this run did not write (its tier was adopted: checkpoint/owner.py) is set aside as
    `<step>.foreign` instead, never deleted."""
    owner = tier.run_owner
    for s in tier.all_steps():
        if step is None or s > step:
            with contextlib.suppress(FileNotFoundError):
                if owner is None or s in owner.written:
                    tier.delete(s)
                else:
                    moved = tier.set_aside(s, ".foreign")
                    print(
                        f"note: local step {s}, not saved by this run, set aside as {moved}",
                        flush=True,
                    )
