"""One timetable per pipeline schedule: which micro-batch each stage runs at each tick, forward and
backward, as arithmetic without arrays; the bubble by its formula and counted in the table; the
stage inputs a schedule keeps. The engines run them (gpipe.py: the forward-scan schedules;
explicit.py: the written-out ones), `plan` prices them (plan/schedules.py,
plan/activation_memory.py) and draws them (charts.py).

A schedule is a `Timetable` registered in TIMETABLES at the end of this file; its name is then a
--pipeline.schedule choice (models/config.py reads SCHEDULES from here) and every consumer finds it.

Letters as in models/pipeline/__init__.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

FORWARD_SCAN = "forward_scan"  # gpipe.py: the backward is autodiff of the forward ticks
EXPLICIT_PROGRAM = "explicit"  # explicit.py: forward and backward slots in the same ticks

# ------------------------------------------------------------------------------ forward scan


def iteration(i, stages: int, microbatches: int, repeats: int):
    """The i-th (micro-batch, repeat) pair a stage runs (stage s runs pair i at tick i + s).
    Micro-batches go in groups of P through all R repeats before the next group starts; with R = 1
    this is simply (i, 0). Works on ints and on jnp arrays."""
    group, rest = i // (stages * repeats), i % (stages * repeats)
    r, j = rest // stages, rest % stages
    return group * stages + j, r


def n_ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    return repeats * microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle share of each device's ticks: (P-1) / (R*M + P-1) (GPipe: R = 1)."""
    return (stages - 1) / n_ticks(stages, microbatches, repeats)


def stage_layers(stage: int, n_layers: int, stages: int, repeats: int = 1) -> list[range]:
    """The layer ranges a pipeline device holds: chunks stage, stage + P, ... of J = L/(R*P)
    layers."""
    k = n_layers // (stages * repeats)
    return [range((r * stages + stage) * k, (r * stages + stage + 1) * k) for r in range(repeats)]


def schedule_table(
    stages: int, microbatches: int, repeats: int = 1
) -> list[list[tuple[int, int] | None]]:
    """[stage][tick] -> (micro-batch, repeat) run in the forward pass, or None (bubble)."""
    P, M, R = stages, microbatches, repeats
    return [
        [iteration(t - s, P, M, R) if 0 <= t - s < R * M else None for t in range(n_ticks(P, M, R))]
        for s in range(P)
    ]


# ------------------------------------------------------------------------------ 1F1B
# The 1F1B timetable with R chunks per device (R = 1: 1F1B; R > 1: interleaved 1F1B). Virtual stage
# v = r*P + s holds chunk r of device s; micro-batches go round in groups of P as in the circular
# forward (`iteration`), so micro-batch m = g*P + j meets virtual stage v forward at tick
# g*P*R + j + v and backward at tick g*P*R + j + 2(V-1) - v (V = R*P): the last virtual stage runs
# a micro-batch's backward in its forward's tick, and each backward step goes one virtual stage
# back per tick. Per device that is at most one forward and one backward per tick.


def ring_slots(stages: int, microbatches: int, repeats: int = 1) -> int:
    """K: stage inputs each device keeps; virtual stage v holds one for 2(V-1-v) ticks."""
    return max(1, min(repeats * microbatches, 2 * (repeats * stages - 1)))


def phases_1f1b(stages: int, microbatches: int, repeats: int = 1) -> list[tuple[str, int, int]]:
    """[(name, first tick, tick count)]: warm-up (F only), steady (F and B), cool-down (B only)."""
    P, M, R = stages, microbatches, repeats
    return [
        ("warm-up", 0, R * P - 1),
        ("steady", R * P - 1, R * (M - P) + P),
        ("cool-down", R * M + P - 1, R * P - 1),
    ]


def slots_1f1b(stages: int, microbatches: int, repeats: int = 1) -> list[tuple[str, int, int, str]]:
    """`phases_1f1b` with each run's slots: F forward, H the head (last stage), B backward."""
    runs = phases_1f1b(stages, microbatches, repeats)
    return [(n, a, c, k) for (n, a, c), k in zip(runs, ("F", "FHB", "B"))]


def ticks_1f1b(stages: int, microbatches: int, repeats: int = 1) -> int:
    return repeats * (microbatches + stages) + stages - 2


def forward_item(t, stage, stages: int, microbatches: int, repeats: int = 1):
    """-> (m, r, i, valid): at tick t device `stage` runs forward micro-batch m through its chunk r,
    the i-th pair of its order (valid when 0 <= i < R*M). Ints or arrays."""
    i = t - stage
    m, r = iteration(i, stages, microbatches, repeats)
    return m, r, i, (i >= 0) & (i < repeats * microbatches)


def backward_item(t, stage, stages: int, microbatches: int, repeats: int = 1):
    """-> (m, r, i, valid): at tick t device `stage` runs the backward of micro-batch m through its
    chunk r, whose forward was its i-th pair (see the timetable above). Ints or arrays."""
    P, R = stages, repeats
    u = t - 2 * (R * P - 1) + stage  # = g*P*R - r*P + j
    j, q = u % P, u // P  # q = g*R - r, 0 <= r < R
    g = -((-q) // R)
    r = g * R - q
    m = g * P + j
    return m, r, (g * R + r) * P + j, (m >= 0) & (m < microbatches)


def table_1f1b(
    stages: int, microbatches: int, repeats: int = 1
) -> list[list[tuple[tuple | None, tuple | None]]]:
    """[stage][tick] -> ((m, r) run forward or None, (m, r) run backward or None)."""

    def item(fn, t, s):
        m, r, _, ok = fn(t, s, stages, microbatches, repeats)
        return (m, r) if ok else None

    return [
        [
            (item(forward_item, t, s), item(backward_item, t, s))
            for t in range(ticks_1f1b(stages, microbatches, repeats))
        ]
        for s in range(stages)
    ]


def in_flight_1f1b(stages: int, microbatches: int, repeats: int = 1) -> list[int]:
    """Per device, the most (micro-batch, chunk) stage inputs whose forward ran and whose backward
    had not, counted after each tick's backward and before its forward."""
    return _in_flight(table_1f1b(stages, microbatches, repeats))


def _in_flight(table) -> list[int]:
    most = []
    for row in table:
        started = done = peak = 0
        for f, b, *_ in row:
            done += b is not None
            peak = max(peak, started - done + (f is not None))
            started += f is not None
        most.append(peak)
    return most


# ------------------------------------------------------------------------------ zero bubble (ZB-H1)
# 1F1B's timetable with each backward split in two (split_backward.py): B, the input gradient, runs
# in 1F1B's backward slot; W, the weight gradients, waits. Stage s defers micro-batch m's W by s
# ticks, to tick m + 2(P-1), the tick in which stage 0 runs m's B, so every stage runs its W of m
# in the same tick and the W slot exists in M ticks instead of 1F1B's M+P-1: the P-1 weight
# gradient slots of the cool-down and the warm-up's first backwards are gone. Per device a tick
# runs at most one F, one B and one W; stage s keeps the W inputs of s+1 micro-batches (`w_slots`).


def weight_item(t, stages: int, microbatches: int):
    """-> (m, valid): at tick t every stage runs the weight gradients of micro-batch m."""
    m = t - 2 * (stages - 1)
    return m, (m >= 0) & (m < microbatches)


def w_slots(stages: int, microbatches: int) -> int:
    """Micro-batches whose W inputs a device keeps between their B and their W."""
    return min(stages, microbatches)


def slots_zb(stages: int, microbatches: int, repeats: int = 1) -> list[tuple[str, int, int, str]]:
    """[(name, first tick, tick count, slots)]: F forward, H head, B input gradient, W weight
    gradients."""
    P, M = stages, microbatches
    return [
        ("warm-up", 0, P - 1, "F"),
        ("steady", P - 1, P - 1, "FHB"),
        ("steady+W", 2 * P - 2, M - P + 1, "FHBW"),
        ("cool-down", M + P - 1, P - 1, "BW"),
    ]


def table_zb(
    stages: int, microbatches: int
) -> list[list[tuple[tuple | None, tuple | None, tuple | None]]]:
    """[stage][tick] -> ((m, 0) forward, (m, 0) input gradient, (m, 0) weight gradients; each or
    None)."""

    def w(t):
        m, ok = weight_item(t, stages, microbatches)
        return (m, 0) if ok else None

    return [
        [(f, b, w(t)) for t, (f, b) in enumerate(row)] for row in table_1f1b(stages, microbatches)
    ]


def w_in_flight(stages: int, microbatches: int) -> list[int]:
    """Per device, the most micro-batches whose B ran and whose W had not (after a tick's B)."""
    return _w_in_flight(table_zb(stages, microbatches))


def _w_in_flight(table) -> list[int]:
    most = []
    for row in table:
        b = w = peak = 0
        for _, bi, wi in row:
            b += bi is not None
            peak = max(peak, b - w)
            w += wi is not None
        most.append(peak)
    return most


def bubble_zb(stages: int, microbatches: int, repeats: int = 1) -> float:
    """2(P-1)/(3M+2(P-1)), with a forward, an input-gradient backward and a weight-gradient
    backward taking the same time (see `table_zb`)."""
    return 2 * (stages - 1) / (3 * microbatches + 2 * (stages - 1))


# ------------------------------------------------------------------------------ the timetables


@dataclasses.dataclass(frozen=True)
class Timetable:
    """One schedule. `engine`: FORWARD_SCAN (gpipe.py runs `iteration`'s order and differentiates
    it) or EXPLICIT_PROGRAM (explicit.py runs `slots`, and at each tick the items below).
    `chunked`: runs R > 1 layer chunks per device (M must then be a multiple of P); `min_repeats`
    and `unchunked` (the schedule it is with fewer chunks) for its check. `bubble(P, M, R)`: the
    formula, `formula(R)` its text; `table(P, M, R)`: [stage][tick] -> the forward pass's
    (m, r) or None (forward scan), or (forward, backward, weight gradients) cells (explicit)."""

    name: str
    engine: str
    bubble: Callable[[int, int, int], float]
    formula: Callable[[int], str]
    table: Callable[[int, int, int], list]
    chunked: bool = False
    min_repeats: int = 1
    unchunked: str = ""
    about: str = ""  # what --help says of it, after its name
    # the explicit program: its runs of ticks with the same slots, what each slot runs at tick t,
    # the stage inputs each device keeps, and the W inputs (None: B and W run together)
    slots: Callable | None = None
    forward_item: Callable | None = None
    backward_item: Callable | None = None
    weight_item: Callable | None = None
    ring_slots: Callable | None = None
    w_slots: Callable | None = None

    @property
    def splits_backward(self) -> bool:
        """Whether each backward runs as B now and W later (split_backward.py)."""
        return self.weight_item is not None

    def ticks(self, P: int, M: int, R: int = 1) -> int:
        if self.engine == FORWARD_SCAN:
            return n_ticks(P, M, R)
        return sum(count for _, _, count, _ in self.slots(P, M, R))

    def in_flight(self, P: int, M: int, R: int = 1) -> int:
        """The most micro-batch passes a device holds between their forward and backward."""
        return M * R if self.engine == FORWARD_SCAN else max(_in_flight(self.table(P, M, R)))

    def w_inputs(self, P: int, M: int, R: int = 1) -> int:
        """The most micro-batches a device keeps W inputs of, between their B and their W (0
        where each backward runs whole)."""
        return max(_w_in_flight(self.table(P, M, R))) if self.splits_backward else 0

    def bubble_counted(self, P: int, M: int, R: int = 1) -> float:
        """The idle share of the program's slots, counted in its timetable: every tick that runs a
        forward (backward, weight gradient) runs it on all stages, masked where a stage has none
        (the SPMD program), so each such tick is P slots; the busy ones are those the table fills.
        A forward, an input-gradient and a weight-gradient pass count one unit each, so a backward
        that is both gradients counts two. The forward scan's backward runs its forward ticks in
        reverse."""
        table = self.table(P, M, R)
        if self.engine == FORWARD_SCAN:
            return 1 - sum(c is not None for row in table for c in row) / (P * len(table[0]))
        units = (1, 1, 1) if self.splits_backward else (1, 2, 0)
        ticks = [
            {t for row in table for t, c in enumerate(row) if c[k] is not None} for k in range(3)
        ]
        busy = sum(u for row in table for c in row for x, u in zip(c, units) if x is not None)
        return 1 - busy / (P * sum(len(tk) * u for tk, u in zip(ticks, units)))


def _one_f_one_b(**kw) -> dict:
    """The fields 1f1b and interleaved_1f1b share."""
    return dict(
        engine=EXPLICIT_PROGRAM,
        bubble=bubble_fraction,
        formula=lambda R: f"(P-1)/({'R*' if R > 1 else ''}M+P-1)",
        table=lambda P, M, R: [[(f, b, None) for f, b in row] for row in table_1f1b(P, M, R)],
        slots=slots_1f1b,
        forward_item=forward_item,
        backward_item=backward_item,
        ring_slots=ring_slots,
        **kw,
    )


def _forward_scan(**kw) -> dict:
    return dict(
        engine=FORWARD_SCAN,
        bubble=bubble_fraction,
        formula=lambda R: "(P-1)/(R*M+P-1)",
        table=schedule_table,
        **kw,
    )


TIMETABLES: dict[str, Timetable] = {
    t.name: t
    for t in (
        Timetable("gpipe", **_forward_scan()),
        Timetable("circular", **_forward_scan(chunked=True)),
        Timetable(
            "1f1b",
            **_one_f_one_b(
                about="each stage alternates forward and backward, keeping at most 2(P-1)"
                " micro-batches, not M"
            ),
        ),
        Timetable(
            "interleaved_1f1b",
            **_one_f_one_b(
                chunked=True,
                min_repeats=2,
                unchunked="1f1b",
                about="the same over R chunks per device, bubble / R",
            ),
        ),
        Timetable(
            "zb_h1",
            **{
                **_one_f_one_b(),
                "bubble": bubble_zb,
                "formula": lambda R: "2(P-1)/(3M+2(P-1))",
                "table": lambda P, M, R: table_zb(P, M),
                "slots": slots_zb,
                "weight_item": weight_item,
                "w_slots": w_slots,
                "about": "1f1b with each backward split, the weight gradients deferred",
            },
        ),
    )
}
SCHEDULES = tuple(TIMETABLES)
EXPLICIT = tuple(n for n, t in TIMETABLES.items() if t.engine == EXPLICIT_PROGRAM)
CHUNKED = tuple(n for n, t in TIMETABLES.items() if t.chunked)


def timetable(schedule: str) -> Timetable:
    """The registered timetable of `schedule` (a name PipelineConfig.validate has checked)."""
    return TIMETABLES[schedule]


def schedule_bubble(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The bubble of `schedule` by its formula."""
    return TIMETABLES[schedule].bubble(stages, microbatches, repeats)


def bubble_counted(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The bubble of `schedule` counted in its timetable (Timetable.bubble_counted)."""
    return TIMETABLES[schedule].bubble_counted(stages, microbatches, repeats)
