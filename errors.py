"""The one exception type for bad user input, and the helpers that make every CLI report it in
one line.

Anything raised as `UserError` is shown by the CLIs as a single line (no traceback) and exits
with status 2. Every message names the culprit and the valid choices. A number is checked against
its declared `Range` by one function, `check_number`, whether it comes from a config field
(models/config.py `ranged`), a CLI flag (`number`) or an environment variable. A public Python
entry point checks its arguments' types with `expect` (a TypeError naming the argument and the
type it wants). A stdout closed by its reader (`brigade inspect --json | head -1`) ends nothing
and prints nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import math
import os
import re
import reprlib
import sys
from collections.abc import Callable
from typing import Any


class UserError(ValueError):
    """Bad configuration or input, reported to the user as one line."""


# ------------------------------------------------------------------ numbers and their ranges

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


def check_number(name: str, value: int | float, tp: type, rng: Range | str, why: str = "") -> Any:
    """`value` when `rng` admits it, else UserError `NAME VALUE: must be RANGE (WHY)`: the one
    range check of config fields, CLI flags and environment variables."""
    rng = Range.parse(rng) if isinstance(rng, str) else rng
    if not rng.admits(value):
        raise UserError(f"{name} {value}: must be {rng.describe(tp)}{f' ({why})' if why else ''}")
    return value


class number:
    """argparse `type=` of a numeric flag with its valid range: `type=number(float, ">=0")`. The
    text is parsed here (argparse's one-line error for `--iters x`); the range is checked by
    ArgParser once the flag's name is known (`check_number`'s one line, as for config fields)."""

    def __init__(self, tp: type, spec: str):
        self.tp, self.range = tp, Range.parse(spec)
        self.__name__ = tp.__name__  # argparse names the type in its messages

    def __call__(self, text: str) -> int | float:
        try:
            return self.tp(text)
        except ValueError:
            kind = "an integer" if self.tp is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None


# ------------------------------------------------------------------ the command lines


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`PROG: error: ... (see --help)`) and exit status 2,
    like every other bad input: no usage dump. Every CLI's parser (and subparser) is one.
    `explain_unknown(flag)`, where given, words the error for an option the parser does not know
    (e.g. with the valid options of the flag's config section). A flag of `type=number(...)` out
    of its range is a UserError after parsing, named as the user wrote it (`--top-k -1: must
    be an integer >= 0`)."""

    def __init__(self, *args, explain_unknown: Callable[[str], str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.explain_unknown = explain_unknown

    def error(self, message: str):
        if self.explain_unknown and message.startswith("unrecognized arguments:"):
            message = self.explain_unknown(message.split(":", 1)[1].split()[0])
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            if isinstance(action.type, number) and value is not None:
                flag = max(action.option_strings, key=len, default=action.dest)
                for v in value if isinstance(value, list) else [value]:
                    check_number(flag, v, action.type.tp, action.type.range)
        return ns, rest


def one_line_errors(main):
    """Decorate a CLI's `main(argv) -> exit status`: a UserError becomes `error: ...` on stderr
    and status 2, with no traceback; a stdout closed by its reader is quiet
    (`quiet_closed_stdout`)."""

    @functools.wraps(main)
    @quiet_closed_stdout
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run


# ------------------------------------------------------------------ a stdout its reader closed


class QuietWhenClosed:
    """sys.stdout while a CLI runs: once its reader is gone (`| head -1`, a killed `tee`), what is
    printed goes to /dev/null instead of raising BrokenPipeError in whatever was printing (a
    training run's step lines go on, the run itself too); everything else is the stream's own."""

    def __init__(self, stream):
        self.stream = stream

    def _quiet(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:  # the descriptor itself: the interpreter's last flush at exit goes there too
            os.dup2(devnull, self.stream.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            self.stream = open(os.devnull, "w")  # a stream without a descriptor (a capture)
        finally:
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._quiet()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._quiet()
            self.stream.flush()  # what was buffered goes to /dev/null, not to a second error

    def __getattr__(self, name: str):  # fileno, isatty, encoding, buffer ...: the stream's own
        return getattr(self.stream, name)


def quiet_closed_stdout(main):
    """Decorate a CLI's main: stdout is a QuietWhenClosed for its duration, flushed before it
    returns (so that the interpreter's flush at exit has nothing left to fail on)."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        outer = sys.stdout
        if isinstance(outer, QuietWhenClosed) or outer is None:
            return main(*args, **kwargs)
        sys.stdout = quiet = QuietWhenClosed(outer)
        try:
            return main(*args, **kwargs)
        finally:
            quiet.flush()
            if sys.stdout is quiet:
                sys.stdout = outer

    return run


# ------------------------------------------------------------------ the Python API's arguments


def expect(where: str, name: str, value: Any, types: type | tuple[type, ...], what: str) -> Any:
    """`value` when it is one of `types`, else TypeError `WHERE: NAME must be WHAT, got TYPE VALUE`:
    a public entry point's arguments are checked before they fail deep inside (jit, a thread)."""
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in _tuple(types)):
        return value
    raise TypeError(f"{where}: {name} must be {what}, got {type(value).__name__} {_short(value)}")


def expect_callable(where: str, name: str, value: Any, optional: bool = False) -> Any:
    """`value` when it is callable (or None where `optional`), else expect's TypeError."""
    if callable(value) or (optional and value is None):
        return value
    what = "a function (or None)" if optional else "a function"
    raise TypeError(f"{where}: {name} must be {what}, got {type(value).__name__} {_short(value)}")


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _short(value: Any) -> str:
    short = reprlib.Repr()
    short.maxstring = short.maxother = 60
    return short.repr(value)
