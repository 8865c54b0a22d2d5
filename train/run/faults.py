"""Fault injection for tests and drills, behind one seam: every `BRIGADE_INJECT_*` variable is read
here, checked, and turned into one typed `Faults` that the loop, the run and the data pipeline
consult (`current()`); nothing else reads them. A malformed value, a step the run never reaches, a
process it does not have or an unknown `BRIGADE_INJECT_` name (a typo would silently drill nothing)
is one line at start, before anything is compiled (Trainer, `python -m train`).

| variable | e.g. | the fault |
|---|---|---|
| BRIGADE_INJECT_NAN_STEPS | 5,6,7 | those steps' loss weights are NaN (non-finite gradients) |
| BRIGADE_INJECT_SPIKE_STEPS | 10 | every target of that step's batch is the last token id |
| BRIGADE_INJECT_HANG_STEPS | 5 | the loop hangs after that step (the watchdog's drill) |
| BRIGADE_INJECT_STEP_DELAY | 1:0.5 | process 1 sleeps 0.5 s after every step (a straggler) |
| BRIGADE_INJECT_KILL_AT_SHUTDOWN_PROCESSES | 1 | killed just before the shutdown barrier |

Steps count from 1, as the log does; processes are jax.process_index() values.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from errors import UserError, check_number

PREFIX = "BRIGADE_INJECT_"
STEP_LISTS = {"NAN_STEPS": "nan_steps", "SPIKE_STEPS": "spike_steps", "HANG_STEPS": "hang_steps"}
PROCESS_LISTS = {"KILL_AT_SHUTDOWN_PROCESSES": "kill_at_shutdown"}
DELAY = "STEP_DELAY"
NAMES = tuple(PREFIX + n for n in (*STEP_LISTS, DELAY, *PROCESS_LISTS))
MAX_DELAY_S = 3600  # a straggler drill's sleep after each step; time.sleep refuses inf and NaN


@dataclasses.dataclass(frozen=True)
class Faults:
    """The faults a run acts out; the default, no variable set, is none."""

    nan_steps: frozenset[int] = frozenset()
    spike_steps: frozenset[int] = frozenset()
    hang_steps: frozenset[int] = frozenset()
    delay: tuple[int, float] | None = None  # (process, seconds it sleeps after each step)
    kill_at_shutdown: frozenset[int] = frozenset()  # processes

    def delay_s(self, process: int) -> float:
        return self.delay[1] if self.delay and self.delay[0] == process else 0.0

    def check(self, steps: int, processes: int | None = None, own_data: bool = False) -> Faults:
        """UserError for a step beyond the run's `steps`, (where known) a process beyond its
        `processes`, or NaN steps with the user's `own_data` (Trainer(data=...): the NaN weights
        are the built-in pipeline's): a drill that would silently never happen."""
        if own_data and self.nan_steps:
            raise UserError(
                f"{PREFIX}NAN_STEPS: poisons the built-in data pipeline's batches, and this Trainer"
                f" was given data=; unset it (BRIGADE_INJECT_SPIKE_STEPS works on any data)"
            )
        for short, attr in STEP_LISTS.items():
            if late := sorted(s for s in getattr(self, attr) if s > steps):
                raise UserError(
                    f"{PREFIX}{short}: step {late[0]} is beyond --steps {steps}; the run would"
                    f" never reach it"
                )
        targets = [(PREFIX + n, p) for n, a in PROCESS_LISTS.items() for p in getattr(self, a)]
        targets += [(PREFIX + DELAY, self.delay[0])] if self.delay else []
        for name, p in targets if processes is not None else ():
            if p >= processes:
                raise UserError(
                    f"{name}: process {p} does not exist; this job's processes are 0 to"
                    f" {processes - 1}"
                )
        return self


def parse(env: Mapping[str, str]) -> Faults:
    """The Faults of an environment; UserError (one line) for the first variable that is wrong.
    An empty value is the same as none."""
    values = {k: v.strip() for k, v in env.items() if k.startswith(PREFIX) and v.strip()}
    for name in sorted(values):
        if name not in NAMES:
            raise UserError(
                f"{name}: not a fault injection variable; valid: {', '.join(NAMES)} (unset it)"
            )
    fields = {attr: _ints(PREFIX + s, values, 1, "step") for s, attr in STEP_LISTS.items()}
    fields |= {attr: _ints(PREFIX + s, values, 0, "process") for s, attr in PROCESS_LISTS.items()}
    return Faults(**fields, delay=_delay(values.get(PREFIX + DELAY)))


def _ints(name: str, values: Mapping[str, str], low: int, what: str) -> frozenset[int]:
    raw = values.get(name, "")
    items = [x.strip() for x in raw.split(",")] if raw else []
    if not all(re.fullmatch(r"[+-]?\d+", x) for x in items):
        raise UserError(f"{name}={raw!r}: expected comma-separated {what} numbers, e.g. 5,6")
    return frozenset(check_number(f"{name} {what}", int(x), int, f">={low}") for x in items)


def _delay(raw: str | None) -> tuple[int, float] | None:
    if not raw:
        return None
    name = PREFIX + DELAY
    process, sep, seconds = raw.partition(":")
    try:
        p, s = int(process), float(seconds)
    except ValueError:
        p = s = None
    if not sep or p is None:
        raise UserError(f"{name}={raw!r}: expected PROCESS:SECONDS, e.g. 1:0.5")
    check_number(f"{name} process", p, int, ">=0")
    check_number(f"{name} seconds", s, float, f"[0, {MAX_DELAY_S}]")
    return p, s


_parsed: tuple[tuple, Faults] | None = None  # (the BRIGADE_INJECT_ items it was parsed from, it)


def current() -> Faults:
    """This process's Faults, parsed once (again only if the variables change: a test's setenv)."""
    global _parsed
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(PREFIX)))
    if _parsed is None or _parsed[0] != key:
        _parsed = (key, parse(dict(key)))
    return _parsed[1]
