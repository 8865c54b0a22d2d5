"""The one-line check of a pipeline setting against the model, the batch and the mesh, made before
anything compiles: by the engines, by the run (train/core/shapes.py) and by `plan --search`.

Letters as in models/pipeline/__init__.py.
"""

from __future__ import annotations

from errors import UserError
from models.pipeline.timetables import CHUNKED, SCHEDULES, TIMETABLES


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
    _check_chunks(TIMETABLES[schedule], P, M, R)
    if n_layers % (P * R):
        pipes = [p for p in _divisors(n_layers) if (n_layers // p) % R == 0]
        reps = [r for r in _divisors(n_layers) if (n_layers // r) % P == 0]
        raise UserError(
            f"model.n_layers={n_layers} is not divisible by --mesh pipeline={P} x"
            f" --pipeline.repeats={R} = {P * R}; with repeats={R} valid pipeline sizes are"
            f" {pipes}, with pipeline={P} valid repeats are {reps or 'none'}"
        )
    chunked = schedule in CHUNKED
    if batch % M:
        ok = [m for m in _divisors(batch) if m >= P and (not chunked or m % P == 0)]
        raise UserError(
            f"batch size {batch} (train.batch_size per forward pass) is not divisible by"
            f" --pipeline.microbatches={M}; valid microbatches: {ok}"
        )
    if (batch // M) % batch_shards:
        ok = [
            m
            for m in _divisors(batch)
            if m >= P and (batch // m) % batch_shards == 0 and (not chunked or m % P == 0)
        ]
        raise UserError(
            f"micro-batch size {batch}/{M} = {batch // M} (train.batch_size /"
            f" --pipeline.microbatches) is not divisible by the {batch_shards} batch shards (mesh"
            f" data x fsdp x expert); valid microbatches: {ok}"
        )


def _check_chunks(tt, P: int, M: int, R: int) -> None:
    """The stage count, the chunks per device and the micro-batch count against the timetable."""
    if R < 1:
        raise UserError(f"--pipeline.repeats={R} must be >= 1")
    if not tt.chunked and R != 1:
        raise UserError(
            f"--pipeline.repeats={R} needs --pipeline.schedule {' or '.join(CHUNKED)}"
            f" ({tt.name} runs each stage's layers once)"
        )
    if R < tt.min_repeats:
        also = f"; with repeats={R} it is {tt.unchunked}" if tt.unchunked else ""
        raise UserError(
            f"--pipeline.schedule {tt.name} needs --pipeline.repeats >= {tt.min_repeats} (layer"
            f" chunks per device){also}"
        )
    if P < 1:
        raise UserError(f"--mesh pipeline={P} must be >= 1")
    if M < P:
        raise UserError(
            f"--pipeline.microbatches={M} is less than the {P} stages of --mesh pipeline={P};"
            f" use microbatches >= {P} (more shrinks the bubble)"
        )
    if tt.chunked and M % P:
        raise UserError(
            f"--pipeline.microbatches={M} must be a multiple of --mesh pipeline={P} for the"
            f" {tt.name} schedule; valid: {', '.join(str(P * i) for i in range(1, 5))}, ..."
        )
