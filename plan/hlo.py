"""Collectives read out of a compiled XLA program's optimized HLO text, attributed to mesh axes.

`plan` uses this to put "bytes moved per step" from the real compiled program next to theory:

    text = jax.jit(step).lower(*args).compile().as_text()
    colls = parse_collectives(text, mesh)
    summarize(colls)["all-gather"]["by_axes"]["fsdp"]["wire_bytes"]

Everything is per device. Formats handled (all seen in jax 0.10 / XLA:CPU output unless noted):
  * instructions  `%name = f32[8,4]{1,0} all-gather(%param), channel_id=1, replica_groups=..., ...`
    operands are usually bare `%name` references; older/hand-written text puts the shape inline
    (`all-reduce(f32[8]{0} %p)`), so both are accepted.
  * replica groups in every spelling XLA prints (plan/replica_groups.py reads them).
  * async pairs `all-gather-start`/`-done` (GPU/TPU) count once, and so do collectives wrapped in an
    `async-start(...), calls=%wrapped` computation. XLA:CPU emits no async collectives.
  * while loops carry `backend_config={..."known_trip_count":{"n":"5"}}`; collectives inside run
    that many times per program run, multiplied through nesting.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from plan.replica_groups import groups_of

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)

# Bits per element. Sub-byte types (s4, f4e2m1fn, ...) are packed, so bytes = ceil(n * bits / 8).
_BITS = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "tf32": 32,
    "token": 0,
    "opaque": 0,
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

    kind: str  # one of KINDS; an async "-start"/"-done" pair counts once, as the kind
    operand_bytes: int  # bytes of the operand(s) on one device (sum over tuple operands)
    result_bytes: int  # bytes of the result on one device
    group_size: int  # devices per replica group (n); permute: largest connected set of devices
    axes: tuple[str, ...]  # mesh axes that vary inside a replica group; () if unknown / no mesh
    count: int  # executions per program run: product of known enclosing while trip counts
    is_async: bool
    # False if some enclosing while had no known_trip_count (counted as 1)
    trip_count_known: bool = True
    name: str = ""  # HLO instruction name, for finding it again in the text

    def wire_bytes(self) -> float:
        """Bytes each device sends with ring algorithms (nccl-tests "bus bandwidth" conventions),
        times count."""
        n = self.group_size
        if n <= 1:
            return 0.0  # a group of one moves nothing
        frac = (n - 1) / n
        per_run = {
            "all-reduce": 2 * frac * self.operand_bytes,  # reduce-scatter + all-gather
            "all-gather": frac * self.result_bytes,  # receive everyone else's shard
            "reduce-scatter": frac * self.operand_bytes,
            "all-to-all": frac * self.operand_bytes,  # keep 1/n, send the rest
            # MoE's dropless exchange on GPU/TPU: what really moves depends on the routing; the
            # HLO only bounds it (the whole send buffer)
            "ragged-all-to-all": frac * self.operand_bytes,
            "collective-permute": float(self.operand_bytes),  # one send of the whole buffer
        }[self.kind]
        return per_run * self.count


# ---------------------------------------------------------------------------------------------
# Shapes

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: `f32[8,4]{1,0}`, `(f32[8]{0}, bf16[2,2])`, `s32[]`,
    `f32[<=16]`.

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
# HLO text scan

# `  ROOT %name = <shape> opcode(` ; the shape is lazy so it stops at the first ` word(`, which a
# shape never contains (layout letters like T( and S( follow ':' not a space).
_INSTR = re.compile(r"\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(")
_HEADER = re.compile(r"(ENTRY\s+)?%?([^\s(]+)\s*\(")
_CALLS = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
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
    return [o for o in (re.sub(r"/\*.*?\*/", "", o).strip() for o in ops) if o], rest[end + 1 :]


@dataclasses.dataclass
class _Raw:
    comp: str
    name: str
    kind: str
    is_async: bool
    shape: str
    rest: str  # text after `opcode(`


def _scan(text: str):
    """One pass over the lines: per-computation name->shape tables, call edges, collectives."""
    tables: dict[str, dict[str, str]] = defaultdict(dict)
    edges: list[tuple[str, str, int | None]] = []  # (caller, callee, multiplier or None=unknown)
    async_callees: set[str] = set()
    raws: list[_Raw] = []
    dones: list[tuple[str, str, str]] = []  # (comp, operand text, shape) of "-done" ops
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
        if cur is None:  # bare instruction lines (hand-written snippets): one implicit computation
            cur = ""
            comps.append(cur)
        name, shape, op = m.groups()
        tables[cur][name] = shape
        # Call edges. Cheap substring test first: most lines call nothing.
        if op not in ("async-done", "async-update") and (  # these repeat their start's calls=
            "calls=" in line or "to_apply=" in line or "body=" in line or "_computation" in line
        ):
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
            raws.append(_Raw(cur, name, kind, op != kind, shape, line[m.end() :]))
        elif op in _DONE_KINDS:
            dones.append((cur, line[m.end() :], shape))
    return tables, edges, async_callees, raws, dones, comps, entry, num_devices


def _dynamic_counts(edges, comps, entry):
    """Executions of each computation per program run, and whether every trip count on the way was
    known.

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
    # A computation nothing reachable calls (a fragment without ENTRY wiring)
    # still ran at least once.
    return {c: count[c] or 1 for c in set(comps) | set(count)}, known


def _operand_bytes(ops: list[str], table: dict[str, str], everywhere) -> int:
    """Sum of operand sizes: the inline shape if printed, else the defining instruction's shape
    (looked up in the same computation first, then module-wide via `everywhere()`)."""
    total = 0
    for o in ops:
        head, _, ref = o.rpartition(" ")
        if "[" in head:  # shape printed inline: `f32[8]{0} %p`
            total += shape_bytes(head)
            continue
        ref = (ref or o).lstrip("%")
        shape = table.get(ref)
        if shape is None:  # names are module-unique in XLA output
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

    def everywhere() -> dict[str, str]:  # module-wide name -> shape, built once, only if needed
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
        else:  # `(operands..., results..., [contexts])` tuple; the matching -done corrects it below
            result = max(shape_b - operand, 0)
        n, axes = groups_of(r.kind, attrs, mesh, num_devices, cache)
        c = Collective(
            kind=r.kind,
            operand_bytes=operand,
            result_bytes=result,
            group_size=n,
            axes=axes,
            count=counts.get(r.comp, 1),
            is_async=r.is_async or r.comp in async_comps,
            trip_count_known=known[r.comp],
            name=r.name,
        )
        out.append(c)
        by_name[(r.comp, r.name)] = c
    for comp, rest, shape in dones:  # `%x-done = f32[64] all-gather-done(%x-start)`: true result
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


def summarize(colls: list[Collective]) -> dict:
    """Totals per kind (every kind present, zeros when absent), split by the axes key "data,fsdp"
    ("-" when no axis is known). count/operand_bytes/wire_bytes include the dynamic count."""
    out = {
        k: {"count": 0, "operand_bytes": 0, "wire_bytes": 0.0, "by_axes": {}, "async": 0}
        for k in KINDS
    }
    for c in colls:
        s = out[c.kind]
        wire = c.wire_bytes()
        s["count"] += c.count
        s["operand_bytes"] += c.operand_bytes * c.count
        s["wire_bytes"] += wire
        s["async"] += c.count if c.is_async else 0
        a = s["by_axes"].setdefault(
            ",".join(c.axes) or "-", {"count": 0, "operand_bytes": 0, "wire_bytes": 0.0}
        )
        a["count"] += c.count
        a["operand_bytes"] += c.operand_bytes * c.count
        a["wire_bytes"] += wire
    return out
