"""Pipeline schedules as arithmetic, without arrays: which micro-batch each stage runs at each tick
(GPipe, circular, 1F1B), the bubble, the chart and its plot, the collective-permute bytes they
imply, and the one-line check of a schedule setting. models/pipeline.py and models/pipeline_1f1b.py
run them; `plan` reports them.

Letters as in models/pipeline.py.
"""
from __future__ import annotations

from errors import UserError
from models.config import SCHEDULES


# ------------------------------------------------------------------------------ validation

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(*, n_layers: int, batch: int, stages: int, microbatches: int, repeats: int = 1,
             schedule: str = "gpipe", batch_shards: int = 1) -> None:
    """Raise a one-line UserError for a pipeline config that cannot run; call it before compiling.
    `batch` is the batch of one forward pass, `batch_shards` the mesh size its dim is split over."""
    P, M, R = stages, microbatches, repeats
    if schedule not in SCHEDULES:
        raise UserError(f"--pipeline.schedule '{schedule}' is not one of {', '.join(SCHEDULES)}")
    if R < 1:
        raise UserError(f"--pipeline.repeats={R} must be >= 1")
    if schedule != "circular" and R != 1:
        raise UserError(f"--pipeline.repeats={R} needs --pipeline.schedule circular"
                        f" ({schedule} runs each stage's layers once)")
    if P < 1:
        raise UserError(f"--mesh pipeline={P} must be >= 1")
    if M < P:
        raise UserError(f"--pipeline.microbatches={M} is less than the {P} stages of --mesh pipeline={P};"
                        f" use microbatches >= {P} (more shrinks the bubble)")
    if schedule == "circular" and M % P:
        raise UserError(f"--pipeline.microbatches={M} must be a multiple of --mesh pipeline={P} for the circular"
                        f" schedule; valid: {', '.join(str(P * i) for i in range(1, 5))}, ...")
    if n_layers % (P * R):
        pipes = [p for p in _divisors(n_layers) if (n_layers // p) % R == 0]
        reps = [r for r in _divisors(n_layers) if (n_layers // r) % P == 0]
        raise UserError(f"model.n_layers={n_layers} is not divisible by --mesh pipeline={P} x --pipeline.repeats={R}"
                        f" = {P * R}; with repeats={R} valid pipeline sizes are {pipes}, with pipeline={P} valid"
                        f" repeats are {reps or 'none'}")
    if batch % M:
        ok = [m for m in _divisors(batch) if m >= P and (schedule != "circular" or m % P == 0)]
        raise UserError(f"batch size {batch} (train.batch_size per forward pass) is not divisible by"
                        f" --pipeline.microbatches={M}; valid microbatches: {ok}")
    if (batch // M) % batch_shards:
        ok = [m for m in _divisors(batch) if m >= P and (batch // m) % batch_shards == 0
              and (schedule != "circular" or m % P == 0)]
        raise UserError(f"micro-batch size {batch}/{M} = {batch // M} (train.batch_size / --pipeline.microbatches)"
                        f" is not divisible by the {batch_shards} batch shards (mesh data x fsdp x expert);"
                        f" valid microbatches: {ok}")


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


def stage_layers(stage: int, n_layers: int, stages: int, repeats: int = 1) -> list[range]:
    """The layer ranges a pipeline device holds: chunks stage, stage + P, ... of J = L/(R*P) layers."""
    k = n_layers // (stages * repeats)
    return [range((r * stages + stage) * k, (r * stages + stage + 1) * k) for r in range(repeats)]


def schedule_table(stages: int, microbatches: int, repeats: int = 1) -> list[list[tuple[int, int] | None]]:
    """[stage][tick] -> (micro-batch, repeat) run in the forward pass, or None (bubble)."""
    P, M, R = stages, microbatches, repeats
    return [[iteration(t - s, P, M, R) if 0 <= t - s < R * M else None for t in range(n_ticks(P, M, R))]
            for s in range(P)]


def schedule_chart(stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe",
                   n_layers: int | None = None) -> str:
    """Text chart: one row per stage, one column per tick, forward (F<m>) then backward (B<m>),
    `.` = idle; with repeats `F<m>.<r>`. The backward pass is the reverse scan of the forward ticks
    (1f1b: `chart_1f1b`, forward and backward in the same ticks)."""
    validate(n_layers=n_layers or stages * repeats, batch=microbatches, stages=stages,
             microbatches=microbatches, repeats=repeats, schedule=schedule)
    if schedule == "1f1b":
        return chart_1f1b(stages, microbatches, n_layers)
    table = schedule_table(stages, microbatches, repeats)
    cell = lambda kind, c: "." if c is None else f"{kind}{c[0]}" + (f".{c[1]}" if repeats > 1 else "")
    rows = [[cell("F", c) for c in row] + ["|"] + [cell("B", c) for c in reversed(row)] for row in table]
    width = max(len(c) for row in rows for c in row)
    def label(s):
        if not n_layers:
            return f"stage {s}"
        return f"stage {s} (layers " + ", ".join(f"{r.start}-{r.stop - 1}" for r in
                                                 stage_layers(s, n_layers, stages, repeats)) + ")"
    lw = max(len(label(s)) for s in range(stages))
    ticks = n_ticks(stages, microbatches, repeats)
    title = (f"{schedule} schedule: {stages} stages x {microbatches} micro-batches x {repeats} repeats;"
             f" {ticks} ticks forward + {ticks} backward; bubble (P-1)/(R*M+P-1) ="
             f" {bubble_fraction(stages, microbatches, repeats):.1%}")
    lines = [title]
    lines += [label(s).ljust(lw) + "  " + " ".join(c.rjust(width) for c in row) for s, row in enumerate(rows)]
    return "\n".join(lines)


def plot_schedule(stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe", *, path: str) -> str:
    """Write the schedule chart as a PNG (needs matplotlib); returns the path."""
    validate(n_layers=stages * repeats, batch=microbatches, stages=stages, microbatches=microbatches,
             repeats=repeats, schedule=schedule)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    ticks = n_ticks(stages, microbatches, repeats)
    if schedule == "1f1b":  # forward and backward share the ticks: each tick is an F column and a B column
        cells = [(s, x, kind, f"{kind}{m}", m) for s, x, kind, m in cells_1f1b(stages, microbatches)]
        ticks = ticks_1f1b(stages, microbatches)
    else:  # the backward pass is the forward ticks reversed, right of the line
        cells = [(s, x, kind, f"{kind}{c[0]}" + (f".{c[1]}" if repeats > 1 else ""), c[0])
                 for s, row in enumerate(schedule_table(stages, microbatches, repeats)) for t, c in enumerate(row)
                 if c is not None for x, kind in ((t, "F"), (2 * ticks - 1 - t, "B"))]
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * 2 * ticks), 0.6 * stages + 1.2))
    for s, x, kind, text, m in cells:
        ax.add_patch(plt.Rectangle((x, s), 1, 1, color=cmap(m % 20), alpha=1.0 if kind == "F" else 0.55, ec="white"))
        ax.text(x + 0.5, s + 0.5, text, ha="center", va="center", fontsize=7)
    if schedule != "1f1b":
        ax.axvline(ticks, color="black", lw=1)
    ax.set_xlim(0, 2 * ticks)
    ax.set_ylim(stages, 0)
    ax.set_yticks([s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("tick (forward F, backward B)" if schedule == "1f1b" else "tick (forward | backward)")
    ax.set_title(f"{schedule}: P={stages}, M={microbatches}, R={repeats}, bubble "
                 f"{bubble_fraction(stages, microbatches, repeats):.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def permute_bytes_theory(*, batch: int, seq: int, d_model: int, itemsize: int, stages: int, microbatches: int,
                         repeats: int = 1, batch_shards: int = 1) -> dict[str, int]:
    """Collective-permute bytes per device per train step (forward + backward).

    `useful`: activation bytes of the batch x R repeats x 2 directions (forward activations,
    backward gradients), the issue's figure; `sent`: what the program really moves, one micro-batch
    per tick including the P-1 bubble ticks (the roll is unconditional), which is what the
    compiled HLO shows."""
    if stages == 1:
        return {"useful": 0, "sent": 0}
    mb_bytes = (batch // microbatches // batch_shards) * seq * d_model * itemsize
    return {"useful": 2 * mb_bytes * microbatches * repeats,
            "sent": 2 * mb_bytes * n_ticks(stages, microbatches, repeats)}


# ------------------------------------------------------------------------------ 1F1B (models/pipeline_1f1b.py)

def ring_slots(stages: int, microbatches: int) -> int:
    """K: stage inputs each stage keeps; stage s holds at most 2(P-1-s) at once."""
    return max(1, min(microbatches, 2 * (stages - 1)))


def phases_1f1b(stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """[(name, first tick, tick count)]: warm-up (F only), steady (F and B), cool-down (B only)."""
    P, M = stages, microbatches
    return [("warm-up", 0, P - 1), ("steady", P - 1, M), ("cool-down", M + P - 1, P - 1)]


def ticks_1f1b(stages: int, microbatches: int) -> int:
    return microbatches + 2 * (stages - 1)


def forward_mb(t, stage, stages):
    """The micro-batch stage `stage` runs forward at tick t (valid when in [0, M)); ints or arrays."""
    return t - stage


def backward_mb(t, stage, stages):
    """The micro-batch whose backward stage `stage` runs at tick t (valid when in [0, M))."""
    return t - 2 * (stages - 1) + stage


def table_1f1b(stages: int, microbatches: int) -> list[list[tuple[int | None, int | None]]]:
    """[stage][tick] -> (micro-batch run forward or None, micro-batch run backward or None)."""
    ok = lambda m: m if 0 <= m < microbatches else None
    return [[(ok(forward_mb(t, s, stages)), ok(backward_mb(t, s, stages))) for t in range(ticks_1f1b(stages, microbatches))]
            for s in range(stages)]


def in_flight_1f1b(stages: int, microbatches: int) -> list[int]:
    """Per stage, the most micro-batches whose forward ran and whose backward had not (the saved
    stage inputs), counted after each tick's backward and before its forward."""
    most = []
    for row in table_1f1b(stages, microbatches):
        started = done = peak = 0
        for f, b in row:
            done += b is not None
            peak = max(peak, started - done + (f is not None))
            started += f is not None
        most.append(peak)
    return most


def chart_1f1b(stages: int, microbatches: int, n_layers: int | None = None) -> str:
    """Text chart: one row per stage, one column per tick: `F<m>` forward, `B<m>` backward,
    `F<m>B<n>` both, `.` idle."""
    P, M = stages, microbatches
    validate(n_layers=n_layers or P, batch=M, stages=P, microbatches=M, schedule="1f1b")
    cell = lambda f, b: ("" if f is None else f"F{f}") + ("" if b is None else f"B{b}") or "."
    rows = [[cell(f, b) for f, b in row] for row in table_1f1b(P, M)]
    width = max(len(c) for row in rows for c in row)
    label = lambda s: f"stage {s}" + ("" if not n_layers else " (layers {0.start}-{1})".format(
        r := stage_layers(s, n_layers, P)[0], r.stop - 1))
    lw = max(len(label(s)) for s in range(P))
    title = (f"1f1b schedule: {P} stages x {M} micro-batches; {ticks_1f1b(P, M)} ticks ({P - 1} forward-only,"
             f" {M} forward+backward, {P - 1} backward-only); at most {max(in_flight_1f1b(P, M))} micro-batches in"
             f" flight per stage; bubble (P-1)/(M+P-1) = {bubble_fraction(P, M):.1%}")
    return "\n".join([title] + [label(s).ljust(lw) + "  " + " ".join(c.rjust(width) for c in row)
                                for s, row in enumerate(rows)])


def cells_1f1b(stages: int, microbatches: int):
    """(stage, x, kind, micro-batch) per drawn cell: a tick is two columns, F then B."""
    return [(s, 2 * t + (kind == "B"), kind, m) for s, row in enumerate(table_1f1b(stages, microbatches))
            for t, fb in enumerate(row) for kind, m in zip("FB", fb) if m is not None]
