"""The local tier's copy on a peer: losing one host's disk loses no local step.

Each process of a multi-process run saves its own shards to its local tier (checkpoint/tiers.py);
with `--checkpoint.local_peer true` (the default) it also keeps the shards of the process before it
(process i holds process i-1's, process 0 the last one's) in `<local_dir>/process-<i>-peer`. The
copy is made by stacking each array's per-device blocks along a new first dimension (one block
per device, so no block is a replica of another) and laying them out on the same devices with
each replaced by the device of the same local index on the next process (one collective-permute
of the state, over the network, at each local save); that is saved process-locally.

On resume a local step is usable when every process holds its own copy or the next process holds
its copy of it. A process whose disk was lost (a replaced host) reads nothing itself: the next
process restores its copy of that process's blocks, they are laid back onto their own devices
(the same collective, reversed), and the process builds its shards from them;
its metadata (data position, config) comes from a process that read its own. The copy restores
onto the mesh it was saved on, like the local tier itself.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoint.manager import Checkpointer
from checkpoint.tiers import LOCAL_FLAG, all_processes, layout
from errors import UserError

_SHARED_STEPS = 64  # the newest steps each process tells the others about, as in tiers.py


def peer_dir(local_dir: str, process: int) -> str:
    """Where `process` keeps the copy of the process before it."""
    return os.path.join(os.path.abspath(local_dir), f"process-{process}-peer")


def peer_tier(local: Checkpointer | None, local_dir: str, *, keep: int, async_save: bool):
    """The peer copies beside the local tier `local` (opened on the first ask, closed with it);
    None with one process or without a local tier."""
    if local is None or jax.process_count() == 1:
        return None
    if local.companions:
        return local.companions[0]
    tier = Checkpointer(
        peer_dir(local_dir, jax.process_index()),
        keep=keep,
        async_save=async_save,
        process_local=True,
        flag=LOCAL_FLAG,
    )
    local.companions.append(tier)
    return tier


def _device_lines(mesh: Mesh) -> tuple[Mesh, Mesh]:
    """The mesh's devices in a line, in the mesh's order, and the same line with each device
    replaced by the device of the same local index on the next process: blocks laid out on the
    second are held by the next process."""
    by_process: dict[int, list] = {}
    for d in sorted(mesh.devices.flat, key=lambda d: d.id):
        by_process.setdefault(d.process_index, []).append(d)
    n, place = len(by_process), {}
    for p, devices in by_process.items():
        for i, d in enumerate(devices):
            place[d] = by_process[(p + 1) % n][i]
    line = list(mesh.devices.flat)
    own = Mesh(np.asarray(line, dtype=object), ("devices",))
    return own, Mesh(np.asarray([place[d] for d in line], dtype=object), ("devices",))


def _blocks(x: jax.Array, line: Mesh) -> jax.Array:
    """`x`'s per-device blocks one after another along its first dimension, one per device of
    `line`: no block is a replica of another (a reshard of replicated data may read any replica,
    and a process that lost its copy holds placeholders). A device's block is its shard as it is
    (no device computation: the save runs under its mesh as the context mesh); a scalar's is
    made a 1-vector on the host."""
    held = {s.device: s.data for s in x.addressable_shards}
    mine = [d for d in line.devices.flat if d in held]
    if x.ndim == 0:
        held = {d: jax.device_put(np.asarray(held[d])[None], d) for d in mine}
    block = x.sharding.shard_shape(x.shape) or (1,)
    return jax.make_array_from_single_device_arrays(
        (line.devices.size * block[0], *block[1:]),
        NamedSharding(line, P("devices")),
        [held[d] for d in mine],
    )


def _unblocked(blocks: jax.Array, like) -> jax.Array:
    """The array of `like`'s shape and sharding whose blocks are `blocks` (laid out on the line)."""
    held = {s.device: s.data for s in blocks.addressable_shards}
    if len(like.shape) == 0:
        held = {d: jax.device_put(np.asarray(a).reshape(()), d) for d, a in held.items()}
    devices = like.sharding.addressable_devices
    return jax.make_array_from_single_device_arrays(
        like.shape, like.sharding, [held[d] for d in sorted(devices, key=lambda d: d.id)]
    )


def _stacked(a, line: Mesh) -> jax.ShapeDtypeStruct:
    """The abstract blocks (`_blocks`) of the abstract array `a`, laid out on `line`."""
    block = a.sharding.shard_shape(a.shape) or (1,)
    return jax.ShapeDtypeStruct(
        (line.devices.size * block[0], *block[1:]),
        a.dtype,
        sharding=NamedSharding(line, P("devices")),
    )


def _moved(blocks, line: Mesh):
    """Blocks laid out on another line of the same devices (a collective-permute across the
    processes), under that line as the context mesh: a reshard may not run under a context mesh
    of another device order (the save's)."""
    with jax.set_mesh(line):
        return jax.device_put(
            blocks, jax.tree.map(lambda _: NamedSharding(line, P("devices")), blocks)
        )


def save_copy(peer: Checkpointer, step: int, state, meta: dict, mesh: Mesh) -> None:
    """Save the previous process's blocks of `state` (every process calls it: a collective)."""
    n = jax.process_count()
    own, shifted = _device_lines(mesh)
    copy = _moved(jax.tree.map(lambda x: _blocks(x, own), state), shifted)
    peer.save(
        step, copy, {**meta, "local": {**layout(mesh), "peer_of": (jax.process_index() - 1) % n}}
    )


def _gather_steps(steps: list[int]) -> np.ndarray:
    padded = np.full(_SHARED_STEPS, -1, np.int64)
    mine = sorted(steps, reverse=True)[:_SHARED_STEPS]
    padded[: len(mine)] = mine
    return np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), -1)


def recoverable_steps(local: Checkpointer, peer: Checkpointer) -> list[int]:
    """The local steps every process can restore, newest first: from its own copy, or from the
    next process's copy of it."""
    own, copies = _gather_steps(local.all_steps()), _gather_steps(peer.all_steps())
    n = len(own)
    held = [set(own[p].tolist()) | set(copies[(p + 1) % n].tolist()) for p in range(n)]
    return sorted(set.intersection(*held) - {-1}, reverse=True)


def _copy_usable(peer: Checkpointer, step: int, mesh: Mesh) -> bool:
    if step not in peer.all_steps():
        return False
    saved = peer.meta(step).get("local", {})
    n = jax.process_count()
    return saved == {**layout(mesh), "peer_of": (jax.process_index() - 1) % n}


def _zeros(abstract):
    """Arrays of `abstract`'s shapes and shardings, zero on this process's devices (no I/O, no
    collective): what a process without a copy contributes to the collective it must join."""
    return jax.tree.map(
        lambda a: jax.make_array_from_callback(
            a.shape, a.sharding, lambda index: np.zeros(_extent(a.shape, index), a.dtype)
        ),
        abstract,
    )


def _extent(shape, index) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def _meta_from(has_own: np.ndarray, meta: dict | None) -> dict:
    """The metadata of the lowest process that read its own copy, on every process."""
    raw = np.frombuffer(json.dumps(meta or {}).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(len(raw)))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: len(raw)] = raw
    every = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    source = int(np.flatnonzero(has_own)[0])
    return json.loads(every[source][: sizes[source]].tobytes().decode())


def complete(
    peer: Checkpointer, step: int, abstract, mesh: Mesh, restored: tuple | None
) -> tuple | None:
    """Every process calls this once the processes agreed on `step`: `restored` is this process's
    (state, meta) read from its own copy, or None when it has none. -> (state, meta) on every
    process, a process without its own copy given its shards from the next process's copy; None
    when every process read its own (nothing to complete)."""
    n, me = jax.process_count(), jax.process_index()
    has_own = np.asarray(multihost_utils.process_allgather(np.int32(restored is not None))).reshape(
        -1
    )
    if has_own.all():
        return None
    own, shifted = _device_lines(mesh)
    on_shifted = jax.tree.map(lambda a: _stacked(a, shifted), abstract)
    # the process before this one lost its copy: this one reads its copy of it
    needed = not has_own[(me - 1) % n]
    usable = not needed or _copy_usable(peer, step, mesh)
    if not all_processes(usable):
        lost = ", ".join(str(p) for p in np.flatnonzero(has_own == 0))
        raise UserError(
            f"local step {step}: the copy of process(es) {lost} held by the next process was saved"
            f" on another mesh layout or is missing"
        )
    theirs = peer.restore(step, on_shifted)[0] if needed else _zeros(on_shifted)
    back = _moved(theirs, own)
    meta = _meta_from(has_own, restored[1] if restored else None)
    if restored is not None:
        return restored[0], meta
    return jax.tree.map(_unblocked, back, abstract), meta
