"""Pipeline schedules as arithmetic, without arrays: which micro-batch each stage runs at each tick
(GPipe, circular, 1F1B, interleaved 1F1B), the bubble, the chart and its plot, the collective-permute bytes they
imply, and the one-line check of a schedule setting. models/pipeline.py and models/pipeline_1f1b.py
run them; `plan` reports them.

Letters as in models/pipeline.py.
"""

from __future__ import annotations

from errors import UserError
from models.config import SCHEDULES

# the schedules whose backward is written out tick by tick (models/pipeline_1f1b.py)
EXPLICIT = ("1f1b", "interleaved_1f1b", "zb_h1")
# the schedules that run R > 1 layer chunks per device
CHUNKED = ("circular", "interleaved_1f1b")


# ------------------------------------------------------------------------------ validation


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(
    *,
    n_layers: int,
    batch: int,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    schedule: str = "gpipe",
    batch_shards: int = 1,
) -> None:
    """Raise a one-line UserError for a pipeline config that cannot run; call it before compiling.
    `batch` is the batch of one forward pass, `batch_shards` the mesh size its dim is split over."""
    P, M, R = stages, microbatches, repeats
    if schedule not in SCHEDULES:
        raise UserError(f"--pipeline.schedule '{schedule}' is not one of {', '.join(SCHEDULES)}")
    if R < 1:
        raise UserError(f"--pipeline.repeats={R} must be >= 1")
    if schedule not in CHUNKED and R != 1:
        raise UserError(
            f"--pipeline.repeats={R} needs --pipeline.schedule circular or interleaved_1f1b"
            f" ({schedule} runs each stage's layers once)"
        )
    if schedule == "interleaved_1f1b" and R < 2:
        raise UserError(
            f"--pipeline.schedule interleaved_1f1b needs --pipeline.repeats >= 2 (layer chunks per"
            f" device); with repeats={R} it is 1f1b"
        )
    if P < 1:
        raise UserError(f"--mesh pipeline={P} must be >= 1")
    if M < P:
        raise UserError(
            f"--pipeline.microbatches={M} is less than the {P} stages of --mesh pipeline={P};"
            f" use microbatches >= {P} (more shrinks the bubble)"
        )
    if schedule in CHUNKED and M % P:
        raise UserError(
            f"--pipeline.microbatches={M} must be a multiple of --mesh pipeline={P} for the {schedule}"
            f" schedule; valid: {', '.join(str(P * i) for i in range(1, 5))}, ..."
        )
    if n_layers % (P * R):
        pipes = [p for p in _divisors(n_layers) if (n_layers // p) % R == 0]
        reps = [r for r in _divisors(n_layers) if (n_layers // r) % P == 0]
        raise UserError(
            f"model.n_layers={n_layers} is not divisible by --mesh pipeline={P} x --pipeline.repeats={R}"
            f" = {P * R}; with repeats={R} valid pipeline sizes are {pipes}, with pipeline={P} valid"
            f" repeats are {reps or 'none'}"
        )
    if batch % M:
        ok = [m for m in _divisors(batch) if m >= P and (schedule not in CHUNKED or m % P == 0)]
        raise UserError(
            f"batch size {batch} (train.batch_size per forward pass) is not divisible by"
            f" --pipeline.microbatches={M}; valid microbatches: {ok}"
        )
    if (batch // M) % batch_shards:
        ok = [
            m
            for m in _divisors(batch)
            if m >= P
            and (batch // m) % batch_shards == 0
            and (schedule not in CHUNKED or m % P == 0)
        ]
        raise UserError(
            f"micro-batch size {batch}/{M} = {batch // M} (train.batch_size / --pipeline.microbatches)"
            f" is not divisible by the {batch_shards} batch shards (mesh data x fsdp x expert);"
            f" valid microbatches: {ok}"
        )


# ------------------------------------------------------------------------------ the schedule


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


def schedule_bubble(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The bubble by its formula: (P-1)/(R*M+P-1); zb_h1: 2(P-1)/(3M+2(P-1)), with a forward, an
    input-gradient backward and a weight-gradient backward taking the same time (see `table_zb`)."""
    if schedule == "zb_h1":
        return 2 * (stages - 1) / (3 * microbatches + 2 * (stages - 1))
    return bubble_fraction(stages, microbatches, repeats)


def bubble_counted(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle share of the program's slots, counted in its timetable: every tick that runs a
    forward (backward, weight gradient) runs it on all stages, masked where a stage has none (the SPMD
    program), so each such tick is P slots; the busy ones are those the table fills. A forward, an
    input-gradient and a weight-gradient pass count one unit each, so 1f1b's backward (both
    gradients) counts two."""
    P, M, R = stages, microbatches, repeats
    if schedule in EXPLICIT:
        if schedule == "zb_h1":
            table, units = table_zb(P, M), (1, 1, 1)
        else:
            table, units = (
                [[(f, b, None) for f, b in row] for row in table_1f1b(P, M, R)],
                (1, 2, 0),
            )
        ticks = [
            {t for row in table for t, c in enumerate(row) if c[k] is not None} for k in range(3)
        ]
        busy = sum(u for row in table for c in row for x, u in zip(c, units) if x is not None)
        return 1 - busy / (P * sum(len(tk) * u for tk, u in zip(ticks, units)))
    table = schedule_table(P, M, R)  # the backward pass runs the forward's ticks in reverse
    return 1 - sum(c is not None for row in table for c in row) / (P * len(table[0]))


def stage_layers(stage: int, n_layers: int, stages: int, repeats: int = 1) -> list[range]:
    """The layer ranges a pipeline device holds: chunks stage, stage + P, ... of J = L/(R*P) layers."""
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


def schedule_chart(
    stages: int,
    microbatches: int,
    repeats: int = 1,
    schedule: str = "gpipe",
    n_layers: int | None = None,
) -> str:
    """Text chart: one row per stage, one column per tick, forward (F<m>) then backward (B<m>),
    `.` = idle; with repeats `F<m>.<r>`. The backward pass is the reverse scan of the forward ticks
    (1f1b: `chart_1f1b`, forward and backward in the same ticks)."""
    validate(
        n_layers=n_layers or stages * repeats,
        batch=microbatches,
        stages=stages,
        microbatches=microbatches,
        repeats=repeats,
        schedule=schedule,
    )
    if schedule in EXPLICIT:
        return chart_1f1b(stages, microbatches, n_layers, repeats, schedule)
    table = schedule_table(stages, microbatches, repeats)
    cell = lambda kind, c: (
        "." if c is None else f"{kind}{c[0]}" + (f".{c[1]}" if repeats > 1 else "")
    )
    rows = [
        [cell("F", c) for c in row] + ["|"] + [cell("B", c) for c in reversed(row)] for row in table
    ]
    width = max(len(c) for row in rows for c in row)

    def label(s):
        if not n_layers:
            return f"stage {s}"
        return (
            f"stage {s} (layers "
            + ", ".join(
                f"{r.start}-{r.stop - 1}" for r in stage_layers(s, n_layers, stages, repeats)
            )
            + ")"
        )

    lw = max(len(label(s)) for s in range(stages))
    ticks = n_ticks(stages, microbatches, repeats)
    title = (
        f"{schedule} schedule: {stages} stages x {microbatches} micro-batches x {repeats} repeats;"
        f" {ticks} ticks forward + {ticks} backward; bubble (P-1)/(R*M+P-1) ="
        f" {bubble_fraction(stages, microbatches, repeats):.1%}"
    )
    lines = [title]
    lines += [
        label(s).ljust(lw) + "  " + " ".join(c.rjust(width) for c in row)
        for s, row in enumerate(rows)
    ]
    return "\n".join(lines)


def plot_schedule(
    stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe", *, path: str
) -> str:
    """Write the schedule chart as a PNG (needs matplotlib); returns the path."""
    validate(
        n_layers=stages * repeats,
        batch=microbatches,
        stages=stages,
        microbatches=microbatches,
        repeats=repeats,
        schedule=schedule,
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    ticks = n_ticks(stages, microbatches, repeats)
    columns = 2
    if (
        schedule in EXPLICIT
    ):  # forward and backward share the ticks: each tick is an F column and a B (and W) column
        cells = [
            (s, x, kind, f"{kind}{m}" + (f".{r}" if repeats > 1 else ""), m)
            for s, x, kind, m, r in cells_1f1b(stages, microbatches, repeats, schedule)
        ]
        ticks, columns = ticks_1f1b(stages, microbatches, repeats), 3 if schedule == "zb_h1" else 2
    else:  # the backward pass is the forward ticks reversed, right of the line
        cells = [
            (s, x, kind, f"{kind}{c[0]}" + (f".{c[1]}" if repeats > 1 else ""), c[0])
            for s, row in enumerate(schedule_table(stages, microbatches, repeats))
            for t, c in enumerate(row)
            if c is not None
            for x, kind in ((t, "F"), (2 * ticks - 1 - t, "B"))
        ]
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * columns * ticks), 0.6 * stages + 1.2))
    for s, x, kind, text, m in cells:
        alpha = {"F": 1.0, "B": 0.55, "W": 0.3}[kind]
        ax.add_patch(plt.Rectangle((x, s), 1, 1, color=cmap(m % 20), alpha=alpha, ec="white"))
        ax.text(x + 0.5, s + 0.5, text, ha="center", va="center", fontsize=7)
    if schedule not in EXPLICIT:
        ax.axvline(ticks, color="black", lw=1)
    ax.set_xlim(0, columns * ticks)
    ax.set_ylim(stages, 0)
    ax.set_yticks([s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel(
        {"zb_h1": "tick (forward F, input gradient B, weight gradients W)"}.get(
            schedule,
            "tick (forward F, backward B)" if schedule in EXPLICIT else "tick (forward | backward)",
        )
    )
    ax.set_title(
        f"{schedule}: P={stages}, M={microbatches}, R={repeats}, bubble "
        f"{schedule_bubble(schedule, stages, microbatches, repeats):.1%}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def permute_bytes_theory(
    *,
    batch: int,
    seq: int,
    d_model: int,
    itemsize: int,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    batch_shards: int = 1,
) -> dict[str, int]:
    """Collective-permute bytes per device per train step (forward + backward).

    `useful`: activation bytes of the batch x R repeats x 2 directions (forward activations,
    backward gradients), the issue's figure; `sent`: what the program really moves, one micro-batch
    per tick including the P-1 bubble ticks (the roll is unconditional), which is what the
    compiled HLO shows."""
    if stages == 1:
        return {"useful": 0, "sent": 0}
    mb_bytes = (batch // microbatches // batch_shards) * seq * d_model * itemsize
    return {
        "useful": 2 * mb_bytes * microbatches * repeats,
        "sent": 2 * mb_bytes * n_ticks(stages, microbatches, repeats),
    }


# ------------------------------------------------------------------------------ 1F1B (models/pipeline_1f1b.py)
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
    most = []
    for row in table_1f1b(stages, microbatches, repeats):
        started = done = peak = 0
        for f, b in row:
            done += b is not None
            peak = max(peak, started - done + (f is not None))
            started += f is not None
        most.append(peak)
    return most


def chart_1f1b(
    stages: int,
    microbatches: int,
    n_layers: int | None = None,
    repeats: int = 1,
    schedule: str = "1f1b",
) -> str:
    """Text chart: one row per stage, one column per tick: `F<m>` forward, `B<m>` backward,
    `F<m>B<n>` both, `.` idle; with chunks (R > 1) `F<m>.<r>`; zb_h1 adds `W<m>` (weight gradients)."""
    P, M, R = stages, microbatches, repeats
    validate(
        n_layers=n_layers or P * R, batch=M, stages=P, microbatches=M, repeats=R, schedule=schedule
    )
    name = lambda kind, c: "" if c is None else f"{kind}{c[0]}" + (f".{c[1]}" if R > 1 else "")
    table = (
        table_zb(P, M)
        if schedule == "zb_h1"
        else [[(f, b, None) for f, b in row] for row in table_1f1b(P, M, R)]
    )
    rows = [[name("F", f) + name("B", b) + name("W", w) or "." for f, b, w in row] for row in table]
    width = max(len(c) for row in rows for c in row)
    label = lambda s: (
        f"stage {s}"
        + (
            ""
            if not n_layers
            else " (layers "
            + ", ".join(f"{r.start}-{r.stop - 1}" for r in stage_layers(s, n_layers, P, R))
            + ")"
        )
    )
    lw = max(len(label(s)) for s in range(P))
    kinds = lambda slots: [SLOT_NAMES[k] for k in slots if k != "H"]
    runs = ", ".join(
        f"{count} {'+'.join(kinds(slots))}{'-only' if len(kinds(slots)) == 1 else ''}"
        for _, _, count, slots in phases(schedule, P, M, R)
    )
    formula = (
        "2(P-1)/(3M+2(P-1))" if schedule == "zb_h1" else f"(P-1)/({'R*' if R > 1 else ''}M+P-1)"
    )
    title = (
        f"{schedule} schedule: {P} stages x {M} micro-batches"
        + (f" x {R} chunks" if R > 1 else "")
        + f"; {ticks_1f1b(P, M, R)} ticks ({runs}); at most {max(in_flight_1f1b(P, M, R))} stage inputs in flight"
        f" per device"
        + (f", {max(w_in_flight(P, M))} W inputs" if schedule == "zb_h1" else "")
        + f"; bubble {formula} = {schedule_bubble(schedule, P, M, R):.1%}"
    )
    return "\n".join(
        [title]
        + [
            label(s).ljust(lw) + "  " + " ".join(c.rjust(width) for c in row)
            for s, row in enumerate(rows)
        ]
    )


SLOT_NAMES = {"F": "forward", "B": "backward", "W": "weight-gradient"}


def cells_1f1b(stages: int, microbatches: int, repeats: int = 1, schedule: str = "1f1b"):
    """(stage, x, kind, micro-batch, chunk) per drawn cell: a tick is a column per slot kind (F, B[, W])."""
    if schedule == "zb_h1":
        table, kinds = table_zb(stages, microbatches), "FBW"
    else:
        table, kinds = table_1f1b(stages, microbatches, repeats), "FB"
    return [
        (s, len(kinds) * t + kinds.index(kind), kind, c[0], c[1])
        for s, row in enumerate(table)
        for t, cs in enumerate(row)
        for kind, c in zip(kinds, cs)
        if c is not None
    ]


# ------------------------------------------------------------------------------ zero bubble (ZB-H1)
# 1F1B's timetable with each backward split in two (models/split_backward.py): B, the input
# gradient, runs in 1F1B's backward slot; W, the weight gradients, waits. Stage s defers micro-batch
# m's W by s ticks, to tick m + 2(P-1), the tick in which stage 0 runs m's B, so every stage runs its
# W of m in the same tick and the W slot exists in M ticks instead of 1F1B's M+P-1: the P-1 weight
# gradient slots of the cool-down and the warm-up's first backwards are gone. Per device a tick runs
# at most one F, one B and one W; stage s keeps the W inputs of s+1 micro-batches (`w_slots`).


def weight_item(t, stages: int, microbatches: int):
    """-> (m, valid): at tick t every stage runs the weight gradients of micro-batch m."""
    m = t - 2 * (stages - 1)
    return m, (m >= 0) & (m < microbatches)


def w_slots(stages: int, microbatches: int) -> int:
    """Micro-batches whose W inputs a device keeps between their B and their W."""
    return min(stages, microbatches)


def phases(
    schedule: str, stages: int, microbatches: int, repeats: int = 1
) -> list[tuple[str, int, int, str]]:
    """[(name, first tick, tick count, slots)]: the explicit schedule's ticks in runs of the same
    slots: F forward, H the head (last stage), B backward (zb_h1: input gradient only), W weight gradients."""
    P, M = stages, microbatches
    if schedule != "zb_h1":
        return [(n, a, c, k) for (n, a, c), k in zip(phases_1f1b(P, M, repeats), ("F", "FHB", "B"))]
    return [
        ("warm-up", 0, P - 1, "F"),
        ("steady", P - 1, P - 1, "FHB"),
        ("steady+W", 2 * P - 2, M - P + 1, "FHBW"),
        ("cool-down", M + P - 1, P - 1, "BW"),
    ]


def table_zb(
    stages: int, microbatches: int
) -> list[list[tuple[tuple | None, tuple | None, tuple | None]]]:
    """[stage][tick] -> ((m, 0) forward or None, (m, 0) input gradient or None, (m, 0) weight gradients or None)."""

    def w(t):
        m, ok = weight_item(t, stages, microbatches)
        return (m, 0) if ok else None

    return [
        [(f, b, w(t)) for t, (f, b) in enumerate(row)] for row in table_1f1b(stages, microbatches)
    ]


def w_in_flight(stages: int, microbatches: int) -> list[int]:
    """Per device, the most micro-batches whose B ran and whose W had not (counted after a tick's B)."""
    most = []
    for row in table_zb(stages, microbatches):
        b = w = peak = 0
        for _, bi, wi in row:
            b += bi is not None
            peak = max(peak, b - w)
            w += wi is not None
        most.append(peak)
    return most
