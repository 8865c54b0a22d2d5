"""Pipeline parallelism over the `pipeline` mesh axis: every schedule runs a model's pieces (its
embedding, repeating layer group and head: models/pieces.py), with no copy of the model.

The public entry is `objective(pieces, params, batch, pipeline=...)` (the train step's objective,
its loss and stats, for any schedule) and `stack_forward` (the layer stack's training forward);
both pick the engine from the schedule's timetable. The files, by concern:

  engine.py          the entry: which engine runs, the objective, the stack's forward
  timetables.py      one timetable per schedule (gpipe, circular, 1f1b, interleaved_1f1b, zb_h1):
                     ticks, bubble formula and count, stage inputs kept; the registry
  checks.py          the one-line check of a pipeline setting
  charts.py          the text chart, the PNG, the permute bytes `plan` reports
  gpipe.py           the forward-scan engine (gpipe, circular): autodiff of a scan of ticks
  explicit.py        the explicit engine (1f1b, interleaved_1f1b, zb_h1): the backward written
                     out, behind a custom_vjp; program.py (a stage's work on one piece) and
                     ticks.py (the tick body)
  split_backward.py  a backward split into input and weight gradients (zb_h1)
  layout.py          where the pipeline's arrays live (stage and replica dims, micro-batches)

Adding a schedule: a `Timetable` registered in timetables.TIMETABLES; the engine named there runs
it, and the config, checks, charts and `plan` read it from there (docs/pipeline.md).

Letters: L layers (for the decoder: layer groups), P stages, R repeats (layer chunks per device),
J layers per stage chunk, M micro-batches, b micro-batch size, A data replicas, B batch, T
sequence, D model, K ring slots (stage inputs an explicit schedule keeps per stage).
"""

from __future__ import annotations

import importlib

from models.pipeline.charts import permute_bytes_theory, plot_schedule, schedule_chart
from models.pipeline.checks import validate
from models.pipeline.timetables import (
    CHUNKED,
    EXPLICIT,
    SCHEDULES,
    TIMETABLES,
    Timetable,
    bubble_counted,
    bubble_fraction,
    iteration,
    n_ticks,
    schedule_bubble,
    schedule_table,
    stage_layers,
    timetable,
)

# The engines import JAX; the timetables, checks and charts do not, and models/config.py reads the
# schedule names from the timetables while flags are parsed, which must not import JAX. So the
# engines' names are loaded on first use.
_ENGINES = {
    "objective": "models.pipeline.engine",
    "stack_forward": "models.pipeline.engine",
    "engine_for": "models.pipeline.engine",
    "with_stat_terms": "models.pipeline.engine",
    "pipeline_apply": "models.pipeline.gpipe",
    "to_stage_order": "models.pipeline.gpipe",
    "to_model_order": "models.pipeline.gpipe",
    "FULL_REMAT": "models.pipeline.gpipe",
}


def __getattr__(name: str):
    if name in _ENGINES:
        return getattr(importlib.import_module(_ENGINES[name]), name)
    raise AttributeError(f"module 'models.pipeline' has no attribute '{name}'")


__all__ = [
    "CHUNKED",
    "EXPLICIT",
    "SCHEDULES",
    "TIMETABLES",
    "Timetable",
    "bubble_counted",
    "bubble_fraction",
    "iteration",
    "n_ticks",
    "permute_bytes_theory",
    "plot_schedule",
    "schedule_bubble",
    "schedule_chart",
    "schedule_table",
    "stage_layers",
    "timetable",
    "validate",
    *_ENGINES,
]
