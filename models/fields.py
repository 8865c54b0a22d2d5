"""The field helpers every config section uses: `ranged` (a numeric field with its valid range)
and `option` (a string or bool field), both with the help text `--help` shows; `check_ranges`, the
one check of a section against its ranges. `Range` and `check_number` are errors.py's: the CLI
flags and environment variables share them."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any

from errors import Range, check_number


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
        check_number(
            flag_of(f.name), getattr(section, f.name), hints[f.name], rng, f.metadata["why"]
        )


# the kinds of a config.json value (models/hf_config.py and models/hf_gemma.py check keys with them)
def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is a Python int


def is_number(v) -> bool:
    # finite: Python's json reads NaN and Infinity
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
