"""Sharding helpers driven by the logical-axis table: specs, constraints, divisibility and
under-sharding checks."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.rules import MeshAxes, current_rules, logical_to_spec


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's sharding by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names))


def named(
    mesh: Mesh, names: tuple[str | None, ...], rules: Mapping[str, MeshAxes] | None = None
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))


def tree_shardings(mesh: Mesh, axes_tree: Any, rules: Mapping[str, MeshAxes] | None = None) -> Any:
    """A tree of logical-name tuples -> the same tree of NamedShardings."""
    return jax.tree.map(lambda names: named(mesh, names, rules), axes_tree, is_leaf=is_axis_names)


def is_axis_names(x) -> bool:
    """A leaf of a logical-axes tree: a tuple of axis names (or None), e.g. ("embed", "mlp")."""
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def axes_size(mesh: Mesh, entry) -> int:
    """Number of shards a PartitionSpec entry (None, 'a' or ('a','b')) makes."""
    return math.prod(mesh.shape[a] for a in entry_axes(entry))


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry, in order: None -> (), 'fsdp' -> ('fsdp',),
    ('data', 'model') -> ('data', 'model')."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec) -> set[str]:
    """The mesh axes a PartitionSpec uses: P('fsdp', ('data','model'), None) ->
    {fsdp, data, model}."""
    return {a for entry in spec for a in entry_axes(entry)}


def data_parallel_axes(mesh: Mesh, batch_axes, param_specs) -> tuple[str, ...]:
    """The leading batch mesh axes (size > 1) that shard no parameter: plain data parallelism,
    where each replica holds whole parameters (and the data-parallel sync runs)."""
    used = set().union(*(spec_axes(s) for s in param_specs))
    out = []
    for a in batch_axes:
        if mesh.shape[a] == 1:
            continue
        if a in used:
            break
        out.append(a)
    return tuple(out)


def check_divisible(
    mesh: Mesh,
    shapes: Any,
    axes_tree: Any,
    rules: Mapping[str, MeshAxes] | None = None,
    hints: Mapping[str, str] | None = None,
) -> None:
    """Raise UserError for the first array dim that its mesh axes do not divide.

    `hints` maps a logical name to the config field that sets it (e.g. 'heads' -> 'model.n_heads').
    """
    rules = current_rules() if rules is None else rules
    flat_shapes = _flatten_with_names(shapes, is_leaf=lambda s: hasattr(s, "shape"))
    flat_axes = dict(_flatten_with_names(axes_tree, is_leaf=is_axis_names))
    for path, sds in flat_shapes:
        names = flat_axes[path]
        spec = logical_to_spec(names, rules)
        for dim, (name, entry) in enumerate(zip(names, spec)):
            n = axes_size(mesh, entry)
            size = sds.shape[dim]
            if n > 1 and size % n:
                axes = (entry,) if isinstance(entry, str) else entry
                where = (
                    f"{hints[name]}={size}"
                    if hints and name in hints
                    else f"{path} dim {dim} ({name}={size})"
                )
                choices = [d for d in range(1, size + 1) if size % d == 0]
                over = "x".join(f"{a}={mesh.shape[a]}" for a in axes)
                raise UserError(
                    f"{where} is not divisible by mesh {over} = {n} (logical axis '{name}' ->"
                    f" {axes}); valid sizes for that product: {choices}"
                )


def warn_undersharded(
    mesh: Mesh, arrays: Any, min_bytes: int = 1 << 20, axes: tuple[str, ...] = ("fsdp", "model")
) -> list[str]:
    """Warn, naming the array, when a large array is replicated over a parameter-sharding mesh
    axis of size > 1 (the silent mis-sharding peers' users lose days to). Returns the messages."""
    msgs = []
    for path, x in _flatten_with_names(arrays, is_leaf=lambda s: hasattr(s, "shape")):
        nbytes = math.prod(x.shape) * x.dtype.itemsize
        spec = getattr(x.sharding, "spec", P())
        used = spec_axes(spec)
        missing = [a for a in axes if mesh.shape[a] > 1 and a not in used]
        if nbytes >= min_bytes and missing:
            over = ", ".join(f"{a}={mesh.shape[a]}" for a in missing)
            msg = (
                f"{path} ({nbytes / 2**20:.1f} MiB, shape {tuple(x.shape)}, spec {spec}) is"
                f" replicated over mesh axis {over}; check the logical-axis rules"
            )
            msgs.append(msg)
            warnings.warn(msg, stacklevel=2)
    return msgs


def _flatten_with_names(tree, is_leaf=None) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [("/".join(_key(k) for k in path), leaf) for path, leaf in flat]


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


path_names = _flatten_with_names
