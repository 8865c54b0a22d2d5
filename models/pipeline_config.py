"""The `pipeline` config section (PipelineConfig): microbatches, repeats, the schedule and its
options. Plain Python, imported while flags are parsed; models/config.py re-exports it."""

from __future__ import annotations

import dataclasses

from errors import UserError
from models.fields import check_ranges, option, ranged
from models.pipeline.timetables import SCHEDULES, TIMETABLES


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The `pipeline` config section (`--pipeline.microbatches` ...); the stage count is the mesh's
    pipeline axis (`--mesh pipeline=P`)."""

    microbatches: int = ranged(
        0,
        ">=0",
        help="microbatches per step; 0 = as many as stages; more shrinks the"
        " bubble (P-1)/(R*M+P-1)",
    )
    repeats: int = ranged(
        1,
        ">=1",
        help="circular and interleaved_1f1b: layer chunks per device (virtual stages per device)",
    )
    schedule: str = option(
        "gpipe",
        f"pipeline schedule: {' | '.join(SCHEDULES)}"
        f" ({'; '.join(f'{t.name}: {t.about}' for t in TIMETABLES.values() if t.about)})",
    )
    remat_stage: bool = option(
        False, "also recompute each stage in the backward pass (less memory)"
    )
    gather_once: bool = option(
        False, "fsdp: all-gather each stage's weights once per step, not every tick"
    )

    def validate(self) -> PipelineConfig:
        """The declared ranges and the schedule's name; what needs the mesh (stages, layer and batch
        divisibility) the Trainer checks."""
        check_ranges(self, lambda name: f"--pipeline.{name}")
        if self.schedule not in SCHEDULES:
            raise UserError(
                f"--pipeline.schedule '{self.schedule}' is not one of {', '.join(SCHEDULES)}"
            )
        return self

    @property
    def replica_axes(self) -> tuple[str, ...]:
        return ("data", "fsdp") if self.gather_once else ("data",)

    def microbatches_for(self, stages: int) -> int:
        return self.microbatches or stages
