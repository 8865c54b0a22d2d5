"""What `plan` shows of a schedule: the text chart of its timetable, the same as a PNG, and the
collective-permute bytes the engines send between stages.

Letters as in models/pipeline/__init__.py.
"""

from __future__ import annotations

from errors import UserError
from models.pipeline.checks import validate
from models.pipeline.timetables import FORWARD_SCAN, n_ticks, stage_layers, timetable

SLOT_NAMES = {"F": "forward", "B": "backward", "W": "weight-gradient"}


def schedule_chart(
    stages: int,
    microbatches: int,
    repeats: int = 1,
    schedule: str = "gpipe",
    n_layers: int | None = None,
) -> str:
    """Text chart: one row per stage, one column per tick. Forward-scan schedules: forward (F<m>)
    then backward (B<m>), the backward pass being the reverse scan of the forward ticks; explicit
    ones: `F<m>` forward, `B<m>` backward, `F<m>B<n>` both, `W<m>` weight gradients where the
    backward is split; `.` = idle; with repeats `F<m>.<r>`."""
    P, M, R = stages, microbatches, repeats
    validate(
        n_layers=n_layers or P * R, batch=M, stages=P, microbatches=M, repeats=R, schedule=schedule
    )
    tt = timetable(schedule)

    def mark(kind: str, c) -> str:
        """A cell's label: its kind and micro-batch (and chunk with R > 1); '' for an empty one."""
        return "" if c is None else _cell_text(kind, c, R)

    table = tt.table(P, M, R)
    if tt.engine == FORWARD_SCAN:
        rows = [
            [mark("F", c) or "." for c in row]
            + ["|"]
            + [mark("B", c) or "." for c in reversed(row)]
            for row in table
        ]
        ticks = n_ticks(P, M, R)
        title = (
            f"{schedule} schedule: {P} stages x {M} micro-batches x {R} repeats; {ticks} ticks"
            f" forward + {ticks} backward; bubble {tt.formula(R)} = {tt.bubble(P, M, R):.1%}"
        )
    else:
        rows = [
            [mark("F", f) + mark("B", b) + mark("W", w) or "." for f, b, w in row] for row in table
        ]
        title = _program_title(tt, P, M, R)
    width = max(len(c) for row in rows for c in row)
    labels = [_label(s, n_layers, P, R) for s in range(P)]
    lw = max(len(label) for label in labels)
    lines = [
        label.ljust(lw) + "  " + " ".join(c.rjust(width) for c in row)
        for label, row in zip(labels, rows)
    ]
    return "\n".join([title, *lines])


def _label(s: int, n_layers: int | None, P: int, R: int) -> str:
    if not n_layers:
        return f"stage {s}"
    layers = ", ".join(f"{r.start}-{r.stop - 1}" for r in stage_layers(s, n_layers, P, R))
    return f"stage {s} (layers {layers})"


def _cell_text(kind: str, c, R: int) -> str:
    """A cell's text: its kind and micro-batch, and its chunk where there are several (R > 1)."""
    return f"{kind}{c[0]}" + (f".{c[1]}" if R > 1 else "")


def _program_title(tt, P: int, M: int, R: int) -> str:
    """An explicit schedule's chart title: its runs of ticks, the inputs it keeps, its bubble."""

    def kinds(slots) -> list[str]:
        return [SLOT_NAMES[k] for k in slots if k != "H"]

    runs = ", ".join(
        f"{count} {'+'.join(kinds(slots))}{'-only' if len(kinds(slots)) == 1 else ''}"
        for _, _, count, slots in tt.slots(P, M, R)
    )
    kept = f"at most {tt.in_flight(P, M, R)} stage inputs in flight per device"
    if tt.splits_backward:
        kept += f", {tt.w_inputs(P, M, R)} W inputs"
    return (
        f"{tt.name} schedule: {P} stages x {M} micro-batches"
        + (f" x {R} chunks" if R > 1 else "")
        + f"; {tt.ticks(P, M, R)} ticks ({runs}); {kept}; bubble {tt.formula(R)} ="
        f" {tt.bubble(P, M, R):.1%}"
    )


def _cells(tt, P: int, M: int, R: int) -> tuple[list, int, int]:
    """-> ([(stage, x, kind, text, micro-batch)] per drawn cell, ticks, columns per tick)."""
    table = tt.table(P, M, R)
    # the backward pass is the forward ticks reversed, right of the line
    if tt.engine == FORWARD_SCAN:
        ticks = n_ticks(P, M, R)
        cells = [
            (s, x, kind, _cell_text(kind, c, R), c[0])
            for s, row in enumerate(table)
            for t, c in enumerate(row)
            if c is not None
            for x, kind in ((t, "F"), (2 * ticks - 1 - t, "B"))
        ]
        return cells, ticks, 2
    # forward and backward share the ticks: each tick is an F column and a B (and W) column
    kinds = "FBW" if tt.splits_backward else "FB"
    cells = [
        (s, len(kinds) * t + kinds.index(kind), kind, _cell_text(kind, c, R), c[0])
        for s, row in enumerate(table)
        for t, cs in enumerate(row)
        for kind, c in zip(kinds, cs)
        if c is not None
    ]
    return cells, tt.ticks(P, M, R), len(kinds)


def plot_schedule(
    stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe", *, path: str
) -> str:
    """Write the schedule chart as a PNG (needs matplotlib); returns the path."""
    P, M, R = stages, microbatches, repeats
    validate(n_layers=P * R, batch=M, stages=P, microbatches=M, repeats=R, schedule=schedule)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    tt = timetable(schedule)
    cells, ticks, columns = _cells(tt, P, M, R)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * columns * ticks), 0.6 * P + 1.2))
    for s, x, kind, text, m in cells:
        alpha = {"F": 1.0, "B": 0.55, "W": 0.3}[kind]
        ax.add_patch(plt.Rectangle((x, s), 1, 1, color=cmap(m % 20), alpha=alpha, ec="white"))
        ax.text(x + 0.5, s + 0.5, text, ha="center", va="center", fontsize=7)
    if tt.engine == FORWARD_SCAN:
        ax.axvline(ticks, color="black", lw=1)
        ax.set_xlabel("tick (forward | backward)")
    elif tt.splits_backward:
        ax.set_xlabel("tick (forward F, input gradient B, weight gradients W)")
    else:
        ax.set_xlabel("tick (forward F, backward B)")
    ax.set_xlim(0, columns * ticks)
    ax.set_ylim(P, 0)
    ax.set_yticks([s + 0.5 for s in range(P)], [f"stage {s}" for s in range(P)])
    ax.set_title(f"{schedule}: P={P}, M={M}, R={R}, bubble {tt.bubble(P, M, R):.1%}")
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
    backward gradients); `sent`: what the program really moves, one micro-batch per tick
    including the P-1 bubble ticks (the roll is unconditional), which is what the compiled HLO
    shows."""
    if stages == 1:
        return {"useful": 0, "sent": 0}
    mb_bytes = (batch // microbatches // batch_shards) * seq * d_model * itemsize
    return {
        "useful": 2 * mb_bytes * microbatches * repeats,
        "sent": 2 * mb_bytes * n_ticks(stages, microbatches, repeats),
    }
