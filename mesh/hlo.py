"""Collectives read out of a compiled XLA program's optimized HLO text, attributed to mesh axes.

`plan` uses this to put "bytes moved per step" from the real compiled program next to theory:

    text = jax.jit(step).lower(*args).compile().as_text()
    colls = parse_collectives(text, mesh)
    summarize(colls)["all-gather"]["by_axes"]["fsdp"]["wire_bytes"]

Everything is per device. Formats handled (all seen in jax 0.10 / XLA:CPU output unless noted):
  * instructions  `%name = f32[8,4]{1,0} all-gather(%param), channel_id=1, replica_groups=..., ...`
    operands are usually bare `%name` references; older/hand-written text puts the shape inline
    (`all-reduce(f32[8]{0} %p)`), so both are accepted.
  * replica groups: explicit `{{0,2},{1,3}}`, empty `{}` (= every device), iota `[4,2]<=[2,2,2]T(0,2,1)`,
    and mesh-axes `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (optionally `, device_ids=(...)` and
    sub-axes `'a':(1)2`); collective-permute uses `source_target_pairs={{0,1},{1,0}}`.
  * async pairs `all-gather-start`/`-done` (GPU/TPU) count once, and so do collectives wrapped in an
    `async-start(...), calls=%wrapped` computation. XLA:CPU emits no async collectives.
  * while loops carry `backend_config={..."known_trip_count":{"n":"5"}}`; collectives inside run that
    many times per program run, multiplied through nesting.

Ids in replica groups of an SPMD program are logical ids 0..N-1 = positions in `mesh.devices.flat`
(jit's device assignment is the mesh order), not `Device.id`s.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")

# Bits per element. Sub-byte types (s4, f4e2m1fn, ...) are packed, so bytes = ceil(n * bits / 8).
_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "tf32": 32,
    "token": 0, "opaque": 0,
}


def _bits(dtype: str) -> int | None:
    if dtype in _BITS:
        return _BITS[dtype]
    # float8 / float6 / float4 families: f8e4m3fn, f8e5m2fnuz, f8e8m0fnu, f6e2m3fn, f4e2m1fn, ...
    m = re.match(r"f(\d+)e\d+m\d+", dtype)
    return int(m.group(1)) if m else None


@dataclasses.dataclass
class Collective:
    """One collective instruction of the HLO (per device)."""
    kind: str                # one of KINDS; an async "-start"/"-done" pair counts once, as the kind
    operand_bytes: int       # bytes of the operand(s) on one device (sum over tuple operands)
    result_bytes: int        # bytes of the result on one device
    group_size: int          # devices per replica group (n); permute: largest connected set of devices
    axes: tuple[str, ...]    # mesh axes that vary inside a replica group; () if unknown / no mesh
    count: int               # executions per program run: product of known enclosing while trip counts
    is_async: bool
    trip_count_known: bool = True   # False if some enclosing while had no known_trip_count (counted as 1)
    name: str = ""                  # HLO instruction name, for finding it again in the text

    def wire_bytes(self) -> float:
        """Bytes each device sends with ring algorithms (nccl-tests "bus bandwidth" conventions), times count."""
        n = self.group_size
        if n <= 1:
            return 0.0  # a group of one moves nothing
        frac = (n - 1) / n
        per_run = {
            "all-reduce": 2 * frac * self.operand_bytes,        # reduce-scatter + all-gather
            "all-gather": frac * self.result_bytes,              # receive everyone else's shard
            "reduce-scatter": frac * self.operand_bytes,
            "all-to-all": frac * self.operand_bytes,             # keep 1/n, send the rest
            # MoE's dropless exchange on GPU/TPU: what really moves depends on the routing; the
            # HLO only bounds it (the whole send buffer)
            "ragged-all-to-all": frac * self.operand_bytes,
            "collective-permute": float(self.operand_bytes),     # one send of the whole buffer
        }[self.kind]
        return per_run * self.count


# ---------------------------------------------------------------------------------------------
# Shapes

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: `f32[8,4]{1,0}`, `(f32[8]{0}, bf16[2,2])`, `s32[]`, `f32[<=16]`.

    Layouts (`{1,0}`, `{1,0:T(8,128)}`) and `/*index=5*/` comments carry no `type[` so are skipped.
    Dynamic dims `<=N` count their bound N.
    """
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _bits(dtype)
        if bits is None:
            continue
        n = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            if d:
                n *= int(d) if d.isdigit() else 1  # '?' (unbounded dynamic) counts as 1
        total += (n * bits + 7) // 8
    return total


# ---------------------------------------------------------------------------------------------
# Replica groups -> (group size, mesh axes)

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
    """device_ids of a mesh-axes list: None (iota), `8,3,7,...`, or `[4,16]T(1,0)` (iota reshape+transpose)."""
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
    """`mesh['a'=4,'b'=2] {'b'}` (optionally `, device_ids=(...)`, sub-axes `'a':(pre)size`) -> [G, S].

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
            if pre != done:               # an un-named part between sub-axes
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
    return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", spec[1:-1])] if spec.strip() != "{}" else []


def _axes_of_groups(groups, mesh) -> tuple[str, ...]:
    """Mesh axes (size > 1) whose coordinate varies inside some group. Ids are flat mesh positions."""
    if mesh is None:
        return ()
    shape = mesh.devices.shape
    if len({len(g) for g in groups}) == 1:
        blocks = [np.asarray(groups, dtype=np.int64)]          # rectangular: one vectorised check
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


# ---------------------------------------------------------------------------------------------
# HLO text scan

# `  ROOT %name = <shape> opcode(` ; the shape is lazy so it stops at the first ` word(`, which a
# shape never contains (layout letters like T( and S( follow ':' not a space).
_INSTR = re.compile(r"\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*\(")
_CALLS = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_RG_EXPLICIT = re.compile(r"replica_groups=(\{\}|\{\{[\d,\s{}]*?\}\})")
_RG_IOTA = re.compile(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_RG_MESH = re.compile(r"replica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\(.*?\))?\s*\{[^}]*\})")
_STP = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_START_KINDS = {k + "-start": k for k in KINDS}
_DONE_KINDS = {k + "-done": k for k in KINDS}


def _split_operands(rest: str) -> tuple[list[str], str]:
    """`a, (f32[2], f32[3]) b), attrs...` -> (['a', '(f32[2], f32[3]) b'], 'attrs...'): split the
    operand list at top-level commas up to the ')' that closes the opcode's '('."""
    depth, start, ops, end = 0, 0, [], len(rest)
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                end = i
                break
            depth -= 1
        elif ch == "," and depth == 0:
            ops.append(rest[start:i])
            start = i + 1
    ops.append(rest[start:end])
    # drop `/*index=5*/` comments that long operand lists carry
    return [o for o in (re.sub(r"/\*.*?\*/", "", o).strip() for o in ops) if o], rest[end + 1:]


@dataclasses.dataclass
class _Raw:
    comp: str
    name: str
    kind: str
    is_async: bool
    shape: str
    rest: str    # text after `opcode(`


def _scan(text: str):
    """One pass over the lines: per-computation name->shape tables, call edges, collectives."""
    tables: dict[str, dict[str, str]] = defaultdict(dict)
    edges: list[tuple[str, str, int | None]] = []   # (caller, callee, multiplier or None=unknown)
    async_callees: set[str] = set()
    raws: list[_Raw] = []
    dones: list[tuple[str, str, str]] = []            # (comp, operand text, shape) of "-done" ops
    comps: list[str] = []
    entry = None
    num_devices = 0
    cur = None
    for line in text.splitlines():
        if not line:
            continue
        if line[0] not in " \t":
            if line.startswith("HloModule"):
                m = re.search(r"num_partitions=(\d+)", line)
                r = re.search(r"replica_count=(\d+)", line)
                num_devices = (int(m.group(1)) if m else 1) * (int(r.group(1)) if r else 1)
            elif line.rstrip().endswith("{") and "->" in line:
                h = _HEADER.match(line)
                if h:
                    cur = h.group(2)
                    comps.append(cur)
                    if h.group(1):
                        entry = cur
            elif line.startswith("}"):
                cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        if cur is None:          # bare instruction lines (hand-written snippets): one implicit computation
            cur = ""
            comps.append(cur)
        name, shape, op = m.groups()
        tables[cur][name] = shape
        # Call edges. Cheap substring test first: most lines call nothing.
        if op not in ("async-done", "async-update") and (   # these repeat their start's calls=
                "calls=" in line or "to_apply=" in line or "body=" in line or "_computation" in line):
            trip = _TRIP.search(line) if op == "while" else None
            for attr, target in _CALLS.findall(line, m.end()):
                mult: int | None = 1
                if op == "while":
                    # the condition runs once more than the body; None = trip count unknown
                    mult = (int(trip.group(1)) + (attr == "condition")) if trip else None
                for callee in re.findall(r"%?([\w.\-]+)", target):
                    edges.append((cur, callee, mult))
                    if op == "async-start":
                        async_callees.add(callee)
        kind = op if op in KINDS else _START_KINDS.get(op)
        if kind:
            raws.append(_Raw(cur, name, kind, op != kind, shape, line[m.end():]))
        elif op in _DONE_KINDS:
            dones.append((cur, line[m.end():], shape))
    return tables, edges, async_callees, raws, dones, comps, entry, num_devices


def _dynamic_counts(edges, comps, entry):
    """Executions of each computation per program run, and whether every trip count on the way was known.

    Roots (ENTRY, or any computation nobody calls when there is no ENTRY) run once; a callee runs
    sum over call sites of caller_count * multiplier. Kahn's order over the call DAG: linear time.
    """
    callees = defaultdict(list)
    indeg = defaultdict(int)
    for caller, callee, mult in edges:
        callees[caller].append((callee, mult))
        indeg[callee] += 1
    count: dict[str, int] = defaultdict(int)
    known: dict[str, bool] = defaultdict(lambda: True)
    roots = [entry] if entry is not None else [c for c in comps if indeg[c] == 0]
    for r in roots:
        count[r] = 1
    queue = [c for c in dict.fromkeys(comps + [e[1] for e in edges]) if indeg[c] == 0]
    while queue:
        c = queue.pop()
        for callee, mult in callees[c]:
            count[callee] += count[c] * (mult if mult is not None else 1)
            known[callee] = known[callee] and known[c] and mult is not None
            indeg[callee] -= 1
            if indeg[callee] == 0:
                queue.append(callee)
    # A computation nothing reachable calls (a fragment without ENTRY wiring) still ran at least once.
    return {c: count[c] or 1 for c in set(comps) | set(count)}, known


def _operand_bytes(ops: list[str], table: dict[str, str], everywhere) -> int:
    """Sum of operand sizes: the inline shape if printed, else the defining instruction's shape
    (looked up in the same computation first, then module-wide via `everywhere()`)."""
    total = 0
    for o in ops:
        head, _, ref = o.rpartition(" ")
        if "[" in head:                       # shape printed inline: `f32[8]{0} %p`
            total += shape_bytes(head)
            continue
        ref = (ref or o).lstrip("%")
        shape = table.get(ref)
        if shape is None:                     # names are module-unique in XLA output
            shape = everywhere().get(ref, "")
        total += shape_bytes(shape)
    return total


def parse_collectives(hlo_text: str, mesh=None) -> list[Collective]:
    """Every collective instruction in `hlo_text` (optimized HLO from `compiled.as_text()`).

    With `mesh` (the jax.sharding.Mesh the program was compiled for) each collective names the mesh
    axes its replica groups span; without it `axes` is ().
    """
    tables, edges, async_callees, raws, dones, comps, entry, num_devices = _scan(hlo_text)
    counts, known = _dynamic_counts(edges, comps, entry)
    async_comps = _closure(async_callees, edges)
    if not num_devices and mesh is not None:
        num_devices = mesh.devices.size
    cache: dict[str, tuple[int, tuple[str, ...]]] = {}
    merged: dict[str, str] = {}

    def everywhere() -> dict[str, str]:   # module-wide name -> shape, built once, only if needed
        if not merged:
            for t in tables.values():
                merged.update(t)
        return merged

    out: list[Collective] = []
    by_name: dict[tuple[str, str], Collective] = {}
    for r in raws:
        ops, attrs = _split_operands(r.rest)
        table = tables[r.comp]
        operand = _operand_bytes(ops, table, everywhere)
        shape_b = shape_bytes(r.shape)
        if not r.is_async or r.kind == "all-reduce":
            result = shape_b
        else:   # `(operands..., results..., [contexts])` tuple; the matching -done corrects it below
            result = max(shape_b - operand, 0)
        n, axes = _groups(r.kind, attrs, mesh, num_devices, cache)
        c = Collective(kind=r.kind, operand_bytes=operand, result_bytes=result, group_size=n, axes=axes,
                       count=counts.get(r.comp, 1), is_async=r.is_async or r.comp in async_comps,
                       trip_count_known=known[r.comp], name=r.name)
        out.append(c)
        by_name[(r.comp, r.name)] = c
    for comp, rest, shape in dones:       # `%x-done = f32[64] all-gather-done(%x-start)`: true result
        ops, _ = _split_operands(rest)
        if ops:
            start = by_name.get((comp, ops[0].rpartition(" ")[2].lstrip("%")))
            if start is not None:
                start.result_bytes = shape_bytes(shape)
    return out


def _closure(roots: set[str], edges) -> set[str]:
    """Computations reachable from `roots` (everything an async wrapper calls is async too)."""
    callees = defaultdict(list)
    for caller, callee, _ in edges:
        callees[caller].append(callee)
    seen, stack = set(roots), list(roots)
    while stack:
        for c in callees[stack.pop()]:
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def _groups(kind, attrs, mesh, num_devices, cache) -> tuple[int, tuple[str, ...]]:
    """(group size, axes) from the replica_groups / source_target_pairs attribute; cached per spelling."""
    if kind == "collective-permute":
        m = _STP.search(attrs)
        key = "stp" + (m.group(1) if m else "")
        if key not in cache:
            comps, moves = _permute_groups(explicit_groups("{" + m.group(1) + "}") if m else [])
            n = max((len(c) for c in comps), default=0)
            axes = _axes_of_groups([list(p) for p in moves], mesh) if moves else ()
            cache[key] = (n, axes)
        return cache[key]
    for rx, build in ((_RG_IOTA, iota_groups), (_RG_MESH, mesh_axes_groups), (_RG_EXPLICIT, explicit_groups)):
        m = rx.search(attrs)
        if m:
            key = m.group(1)
            if key not in cache:
                groups = build(key)
                if len(groups) == 0:           # `{}`: one group of every device
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


def summarize(colls: list[Collective]) -> dict:
    """Totals per kind (every kind present, zeros when absent), split by the axes key "data,fsdp"
    ("-" when no axis is known). count/operand_bytes/wire_bytes include the dynamic count."""
    out = {k: {"count": 0, "operand_bytes": 0, "wire_bytes": 0.0, "by_axes": {}, "async": 0} for k in KINDS}
    for c in colls:
        s = out[c.kind]
        wire = c.wire_bytes()
        s["count"] += c.count
        s["operand_bytes"] += c.operand_bytes * c.count
        s["wire_bytes"] += wire
        s["async"] += c.count if c.is_async else 0
        a = s["by_axes"].setdefault(",".join(c.axes) or "-", {"count": 0, "operand_bytes": 0, "wire_bytes": 0.0})
        a["count"] += c.count
        a["operand_bytes"] += c.operand_bytes * c.count
        a["wire_bytes"] += wire
    return out
