"""Mesh axes, `--mesh` / `--mesh-dcn` parsing and size resolution.

A mesh spec is `axis=size,...` over AXES; unnamed axes are 1 and one axis may be -1 ("the rest").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from errors import UserError, expect

# Outermost first. The most talkative axis (model, then expert, then context) is innermost so that
# it lands on the closest devices (same NVLink island / ICI neighbours); data and pipeline go
# outermost, across hosts (DCN). `context` shards the sequence: its K/V exchange runs every layer.
AXES = ("pipeline", "data", "fsdp", "context", "expert", "model")


def parse_spec(spec: str | dict | None, flag: str = "--mesh") -> dict[str, int]:
    """'data=2,fsdp=-1' -> {'data': 2, 'fsdp': -1}. Raises UserError naming the bad part."""
    if spec is None or spec == "" or spec == {}:
        return {}
    if isinstance(spec, dict):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise UserError(
                    f"{flag}: '{part}' is not axis=size; example: {flag} data=2,fsdp=2,model=2"
                )
            name, _, value = part.partition("=")
            items.append((name.strip(), value.strip()))
    sizes: dict[str, int] = {}
    for name, value in items:
        if name not in AXES:
            raise UserError(f"{flag}: unknown mesh axis '{name}'; valid axes: {', '.join(AXES)}")
        if name in sizes:
            raise UserError(f"{flag}: axis '{name}' is given twice")
        try:
            size = int(value)
        except (TypeError, ValueError):
            raise UserError(f"{flag}: size of '{name}' must be an integer, got '{value}'") from None
        if size == 0 or size < -1:
            raise UserError(
                f"{flag}: size of '{name}' must be a positive integer or -1, got {size}"
            )
        sizes[name] = size
    if sum(1 for s in sizes.values() if s == -1) > 1:
        both = [n for n, s in sizes.items() if s == -1]
        raise UserError(f"{flag}: only one axis may be -1, got {', '.join(both)}")
    return sizes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Resolved axis sizes, ordered as AXES. `dcn` holds the part of each axis that spans
    hosts/slices (1 = all inside one host/slice)."""

    sizes: tuple[int, ...]
    dcn: tuple[int, ...]

    def __getitem__(self, axis: str) -> int:
        return self.sizes[AXES.index(axis)]

    @property
    def ici(self) -> tuple[int, ...]:
        return tuple(s // d for s, d in zip(self.sizes, self.dcn))

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(AXES, self.sizes))

    def __str__(self) -> str:
        used = [f"{a}={s}" for a, s in zip(AXES, self.sizes) if s > 1]
        return ",".join(used) or "single device"


def resolve(
    spec: str | dict | None, n_devices: int, dcn_spec: str | dict | None = None
) -> MeshShape:
    """Fill in -1 and unnamed axes so the product is n_devices; default: all devices on `data`."""
    sizes = parse_spec(spec)
    if not sizes:
        sizes = {"data": -1}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        axis = next(n for n, s in sizes.items() if s == -1)
        if n_devices % fixed:
            raise UserError(
                f"--mesh: the named axes multiply to {fixed}, which does not divide the"
                f" {n_devices} devices, so '{axis}=-1' has no solution; the fixed part must be one"
                f" of {_divisors(n_devices)}"
            )
        sizes[axis] = n_devices // fixed
    elif fixed != n_devices:
        raise UserError(
            f"--mesh: axis sizes multiply to {fixed} but there are {n_devices} devices;"
            f" make the product {n_devices} or set one axis to -1"
        )
    dcn = parse_spec(dcn_spec, flag="--mesh-dcn")
    if -1 in dcn.values():
        raise UserError("--mesh-dcn: -1 is not allowed; give the number of hosts/slices per axis")
    for name, d in dcn.items():
        total = sizes.get(name, 1)
        if total % d:
            raise UserError(
                f"--mesh-dcn: {name}={d} does not divide the mesh's {name}={total};"
                f" valid: {_divisors(total)}"
            )
    return MeshShape(tuple(sizes.get(a, 1) for a in AXES), tuple(dcn.get(a, 1) for a in AXES))


def mesh_text(sizes) -> str:
    """A mesh's axis sizes as `--mesh` text, axes of size 1 left out: {'data': 4, 'fsdp': 1,
    'model': 2} (or a Mesh's `.shape`) -> 'data=4,model=2'; '1 device' when every axis is 1."""
    expect("mesh_text", "sizes", sizes, Mapping, "axis sizes such as a Mesh's .shape")
    names = [a for a in AXES if a in sizes] + [a for a in sizes if a not in AXES]
    return ",".join(f"{a}={sizes[a]}" for a in names if sizes[a] > 1) or "1 device"
