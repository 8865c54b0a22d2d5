"""Replica groups of an HLO collective -> (devices per group, the mesh axes a group spans).

The spellings XLA prints (all seen in jax 0.10 / XLA:CPU output unless noted): explicit
`{{0,2},{1,3}}`, empty `{}` (= every device), iota `[4,2]<=[2,2,2]T(0,2,1)`, mesh-axes
`mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (optionally `, device_ids=(...)` and sub-axes `'a':(1)2`);
collective-permute names `source_target_pairs={{0,1},{1,0}}` instead.

Ids in replica groups of an SPMD program are logical ids 0..N-1 = positions in `mesh.devices.flat`
(jit's device assignment is the mesh order), not `Device.id`s.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    a = np.arange(math.prod(dims), dtype=np.int64).reshape(dims)
    return a.transpose(perm) if perm else a


def _ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", s)]


def iota_groups(spec: str) -> np.ndarray:
    """`[G,S]<=[d0,d1,...]T(p...)` -> int array [G, S]: iota over d, transposed by p, reshaped."""
    m = re.fullmatch(r"\s*\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", spec)
    if not m:
        raise ValueError(f"not an iota replica group list: {spec!r}")
    out = _ints(m.group(1))
    arr = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
    return arr.reshape(out[0], -1) if len(out) >= 2 else arr.reshape(1, -1)


def _device_array(spec: str | None, sizes: list[int]) -> np.ndarray:
    """device_ids of a mesh-axes list: None (iota), `8,3,7,...`, or `[4,16]T(1,0)` (iota
    reshape+transpose)."""
    n = math.prod(sizes)
    if not spec:
        return np.arange(n, dtype=np.int64).reshape(sizes)
    m = re.fullmatch(r"\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", spec)
    if m:
        arr = _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None)
    else:
        arr = np.asarray(_ints(spec), dtype=np.int64)
    return arr.reshape(sizes)


def mesh_axes_groups(spec: str) -> np.ndarray:
    """`mesh['a'=4,'b'=2] {'b'}` (optionally `, device_ids=(...)`, sub-axes `'a':(pre)size`) ->
    [G, S].

    Same rule as XLA's MeshAxesReplicaGroupList: split each mesh dim into the sub-axes named on it
    (row-major: pre-size is the product of the more-major parts), then the devices that differ only
    along the named (sub-)axes form one group.
    """
    m = re.fullmatch(r"\s*mesh\[([^\]]*)\](?:,\s*device_ids=\((.*)\))?\s*\{([^}]*)\}\s*", spec)
    if not m:
        raise ValueError(f"not a mesh-axes replica group list: {spec!r}")
    names, sizes = [], []
    for part in m.group(1).split(","):
        k, _, v = part.rpartition("=")
        names.append(k.strip().strip("'\""))
        sizes.append(int(v))
    refs = []  # (mesh dim, pre_size or None, size)
    for part in filter(None, (p.strip() for p in m.group(3).split(","))):
        r = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", part)
        d = names.index(r.group(1))
        refs.append((d, int(r.group(2)), int(r.group(3))) if r.group(2) else (d, None, sizes[d]))
    refined, where = [], {}  # sizes after splitting dims into sub-axes; ref index -> refined dim
    for d, full in enumerate(sizes):
        mine = sorted((pre, size, k) for k, (dd, pre, size) in enumerate(refs) if dd == d)
        if any(pre is None for pre, _, _ in mine):
            where[mine[0][2]] = len(refined)
            refined.append(full)
            continue
        done = 1
        for pre, size, k in mine:
            if pre != done:  # an un-named part between sub-axes
                refined.append(pre // done)
                done = pre
            where[k] = len(refined)
            refined.append(size)
            done *= size
        if done != full:
            refined.append(full // done)
    arr = _device_array(m.group(2), sizes).reshape(refined)
    grouped = [where[k] for k in range(len(refs))]
    perm = [i for i in range(len(refined)) if i not in grouped] + grouped
    size = math.prod(refined[i] for i in grouped)
    return arr.transpose(perm).reshape(-1, size)


def explicit_groups(spec: str) -> list[list[int]]:
    """`{{0,1},{2,3}}` -> [[0,1],[2,3]]; `{}` -> []."""
    return (
        [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", spec[1:-1])]
        if spec.strip() != "{}"
        else []
    )


def _axes_of_groups(groups, mesh) -> tuple[str, ...]:
    """Mesh axes (size > 1) whose coordinate varies inside some group. Ids are flat mesh
    positions."""
    if mesh is None:
        return ()
    shape = mesh.devices.shape
    if len({len(g) for g in groups}) == 1:
        blocks = [np.asarray(groups, dtype=np.int64)]  # rectangular: one vectorised check
    else:
        blocks = [np.asarray([g], dtype=np.int64) for g in groups if len(g)]
    axes = set()
    for g in blocks:
        if g.size == 0 or g.min() < 0 or g.max() >= math.prod(shape):
            return ()  # ids beyond this mesh: not the mesh the program was compiled for
        for i, c in enumerate(np.unravel_index(g, shape)):
            if shape[i] > 1 and (c != c[:, :1]).any():
                axes.add(i)
    return tuple(mesh.axis_names[i] for i in sorted(axes))


def _permute_groups(pairs: list[list[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Connected sets of devices of a permutation (union-find) and the non-self pairs."""
    parent: dict[int, int] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    moves = []
    for p in pairs:
        if len(p) != 2:
            continue
        s, t = p
        parent[find(s)] = find(t)
        if s != t:
            moves.append((s, t))
    comps = defaultdict(list)
    for x in list(parent):
        comps[find(x)].append(x)
    return list(comps.values()), moves


_RG_EXPLICIT = re.compile(r"replica_groups=(\{\}|\{\{[\d,\s{}]*?\}\})")
_RG_IOTA = re.compile(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_RG_MESH = re.compile(r"replica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\(.*?\))?\s*\{[^}]*\})")
_STP = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def groups_of(
    kind: str, attrs: str, mesh, num_devices: int, cache: dict
) -> tuple[int, tuple[str, ...]]:
    """(group size, axes) from an instruction's replica_groups / source_target_pairs attribute
    (`attrs`: its text after the operands); `cache` keeps one answer per spelling."""
    if kind == "collective-permute":
        m = _STP.search(attrs)
        key = "stp" + (m.group(1) if m else "")
        if key not in cache:
            comps, moves = _permute_groups(explicit_groups("{" + m.group(1) + "}") if m else [])
            n = max((len(c) for c in comps), default=0)
            axes = _axes_of_groups([list(p) for p in moves], mesh) if moves else ()
            cache[key] = (n, axes)
        return cache[key]
    for rx, build in (
        (_RG_IOTA, iota_groups),
        (_RG_MESH, mesh_axes_groups),
        (_RG_EXPLICIT, explicit_groups),
    ):
        m = rx.search(attrs)
        if m:
            key = m.group(1)
            if key not in cache:
                groups = build(key)
                if len(groups) == 0:  # `{}`: one group of every device
                    groups = [list(range(num_devices))] if num_devices else []
                if len(groups) == 0:
                    cache[key] = (0, ())
                else:
                    n = max(len(g) for g in groups)
                    cache[key] = (n, _axes_of_groups(groups, mesh))
            return cache[key]
    # No replica_groups attribute at all: every device takes part.
    if num_devices:
        return num_devices, _axes_of_groups([list(range(num_devices))], mesh)
    return 0, ()
