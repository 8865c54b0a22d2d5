"""Where the pipeline's arrays live, shared by both engines (gpipe.py, explicit.py): the stage dim
on the 'stages' mesh axes, the replica dim on the data-parallel axes that hold whole copies of the
weights, and each micro-batch's rows on what is left of the batch axes.

Letters as in models/pipeline/__init__.py.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

from mesh.rules import current_rules, logical_to_spec
from mesh.shard import entry_axes

REPLICAS = "pipeline_replicas"  # logical name of the replica dim, only inside the pipeline
_FREE = PartitionSpec.UNCONSTRAINED


def stages() -> int:
    """The pipeline axis's size on the mesh in context (1: no pipeline)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "pipeline" not in mesh.shape else mesh.shape["pipeline"]


def mesh_size(axes) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape[a] for a in axes)


def batch_axes() -> tuple[str, ...]:
    """The mesh axes a micro-batch's rows are split over outside the pipeline (the batch rule
    less the stage axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    return entry_axes(logical_to_spec(("stages", "batch"))[1]) if not mesh.empty else ()


def replica_axes_of(replica_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The batch mesh axes of `replica_axes` (PipelineConfig.replica_axes) that are real (> 1):
    what the replica dim A is sharded over."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in batch_axes() if a in replica_axes and mesh.shape[a] > 1)


def replicas(replica_axes: tuple[str, ...]) -> int:
    """A: how many data replicas the pipeline splits each micro-batch into."""
    return mesh_size(replica_axes_of(replica_axes))


def inner_rules(replicas: tuple[str, ...]) -> dict:
    """The rules inside the pipeline. The stage dim owns the 'stages' mesh axes and the replica
    dim owns `replicas` (replica_axes_of), so every other logical axis drops them: e.g. a rule
    batch -> data+fsdp+expert+pipeline (which splits the embedding and head's batch over
    'pipeline' too) shards a micro-batch's rows over fsdp+expert inside, data being the replica
    dim."""
    rules = current_rules()
    taken = set(rules.get("stages", ())) | set(replicas)
    inner = {name: tuple(a for a in axes if a not in taken) for name, axes in rules.items()}
    return inner | {"stages": tuple(rules.get("stages", ())), REPLICAS: replicas}


def _spec(names: tuple[str | None, ...], free_from: int) -> PartitionSpec:
    """The spec of `names`, with dims from `free_from` on left to the partitioner."""
    spec = list(logical_to_spec(names))
    return PartitionSpec(*spec[:free_from], *[_FREE] * (len(spec) - free_from))


def pin(x: jax.Array, names: tuple[str | None, ...], free_from: int | None = None) -> jax.Array:
    """A sharding constraint by logical names (dims past `names` replicated, dims from
    `free_from` on left to the partitioner); nothing on a mesh of one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    names = names + (None,) * (x.ndim - len(names))
    return jax.lax.with_sharding_constraint(
        x, _spec(names, x.ndim if free_from is None else free_from)
    )


def act_names(ndim: int) -> tuple[str | None, ...]:
    """Logical names of one micro-batch [b, T, D, ...] (the decoder's activation layout)."""
    return ("batch", "seq", "act_embed")[:ndim] + (None,) * max(0, ndim - 3)


def split_microbatches(a_B: jax.Array, M: int, A: int) -> jax.Array:
    """[B, ...] -> [M, A, b/A, ...] (b = B/M): micro-batch m = rows m, m+M, ..., which keeps the
    batch shards local, then split into the A replicas' pieces."""
    b = a_B.shape[0] // M
    a = a_B.reshape(A, b // A, M, *a_B.shape[1:]).transpose(2, 0, 1, *range(3, a_B.ndim + 2))
    return pin(a, (None, REPLICAS) + act_names(a_B.ndim))


def stage_axis():
    """The mesh axes of the stage dim (vmap's spmd_axis_name), None without a mesh."""
    mesh_empty = jax.sharding.get_abstract_mesh().empty
    return None if mesh_empty else logical_to_spec(("stages",))[0]


def replica_axis(A: int):
    """The mesh axes of the replica dim (vmap's spmd_axis_name), None for one replica."""
    return logical_to_spec((REPLICAS,))[0] if A > 1 else None
