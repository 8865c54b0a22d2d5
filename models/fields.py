"""The field helpers every config section uses: `ranged` (a numeric field with its valid range)
and `option` (a string or bool field), both with the help text `--help` shows; `check_ranges`, the
one check of a section against its ranges."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable
from typing import Any

from errors import UserError

_BOUND = re.compile(r"(>=?)\s*(\S+)")
_INTERVAL = re.compile(r"([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])")


def _number(text: str) -> int | float:
    # ints stay exact: float(2**63 - 1) would round up and admit 2**63
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


@dataclasses.dataclass(frozen=True)
class Range:
    """Where a numeric option may lie, written `>0`, `>=1`, `[0, 1)` or `(0, 1]`. NaN is never in
    a range and inf only where the range names it with a closed bracket (`[0, inf]`)."""

    spec: str
    lo: int | float
    hi: int | float
    lo_open: bool
    hi_open: bool

    @classmethod
    def parse(cls, spec: str) -> Range:
        if m := _BOUND.fullmatch(spec.strip()):
            return cls(spec, _number(m[2]), math.inf, m[1] == ">", True)
        if m := _INTERVAL.fullmatch(spec.strip()):
            return cls(spec, _number(m[2]), _number(m[3]), m[1] == "(", m[4] == ")")
        raise ValueError(f"range {spec!r}: expected >X, >=X or an interval like [0, 1)")

    @property
    def allows_inf(self) -> bool:
        return (self.hi == math.inf and not self.hi_open) or (
            self.lo == -math.inf and not self.lo_open
        )

    def admits(self, value: int | float) -> bool:
        if math.isnan(value) or (math.isinf(value) and not self.allows_inf):
            return False
        return (value > self.lo if self.lo_open else value >= self.lo) and (
            value < self.hi if self.hi_open else value <= self.hi
        )

    def describe(self, tp: type) -> str:
        """`an integer >= 1`, `a finite number > 0`, `a number in [0, 1)`: how messages state it."""
        if self.hi == math.inf and self.hi_open:
            kind = "an integer" if tp is int else "a finite number"
            return f"{kind} {'>' if self.lo_open else '>='} {self.lo}"
        return f"{'an integer' if tp is int else 'a number'} in {self.spec}"


def ranged(default: int | float, spec: str, help: str = "", why: str = "") -> Any:
    """A numeric dataclass field with its valid range (`Range` syntax) and the text `--help` shows
    for it; `why` is added to the message of a value outside the range where the range alone does
    not explain itself."""
    return dataclasses.field(
        default=default, metadata={"range": Range.parse(spec), "why": why, "help": help}
    )


def option(default: str | bool, help: str) -> Any:
    """A string or bool dataclass field and the text `--help` shows for it."""
    return dataclasses.field(default=default, metadata={"help": help})


def numeric_fields(cls) -> list[dataclasses.Field]:
    """The int and float fields of a config dataclass (bool is not numeric here)."""
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]


def check_ranges(section: Any, flag_of: Callable[[str], str]) -> None:
    """UserError `FLAG VALUE: must be RANGE` for the first numeric field of `section` outside its
    declared range; `flag_of(field)` is the option as the user writes it."""
    hints = typing.get_type_hints(type(section))
    for f in numeric_fields(type(section)):
        rng = f.metadata.get("range")
        if rng is None:  # a programming error: every numeric option declares where it may lie
            raise TypeError(
                f"{type(section).__name__}.{f.name} has no declared range; define it with ranged()"
            )
        value = getattr(section, f.name)
        if not rng.admits(value):
            why = f" ({f.metadata['why']})" if f.metadata["why"] else ""
            raise UserError(
                f"{flag_of(f.name)} {value}: must be {rng.describe(hints[f.name])}{why}"
            )
