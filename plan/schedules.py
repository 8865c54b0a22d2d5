"""The pipeline settings a mesh can run and their prices side by side: the micro-batch counts the
run accepts, the other schedules at that count, and each schedule's bubble, memory and step time
(`plan --devices N` on a pipeline mesh).
"""

from __future__ import annotations

import dataclasses

from errors import UserError
from mesh.rules import make_rules
from mesh.spec import AXES
from models.config import PipelineConfig
from models.pipeline import TIMETABLES, bubble_counted, schedule_bubble, timetable
from plan.estimate import check, evaluate, with_batch
from plan.hardware import Hardware
from plan.run_spec import abstract_mesh, rows_per_shard
from train.core.config import TrainConfig
from train.core.shapes import batch_shards, validate_batch


def pipeline_choices(
    cfg, sizes: dict[str, int], train_cfg: TrainConfig, pipeline_cfg: PipelineConfig, rules
) -> list[PipelineConfig]:
    """The pipeline settings to price on this mesh: the run's own; with pipeline > 1 and
    --pipeline.microbatches unset (0), every micro-batch count the run would accept (validate_batch
    decides; only divisors of the rows per batch shard can split them evenly), so that the search
    can report the count that makes its best time."""
    p = sizes["pipeline"]
    if p == 1 or pipeline_cfg.microbatches:
        return [pipeline_cfg]
    mesh, t = abstract_mesh(sizes), train_cfg
    rows = rows_per_shard(t.batch_size, t.micro_batches, batch_shards(mesh, rules))
    out = []
    for m in range(p, rows + 1):
        if rows % m:
            continue
        pc = dataclasses.replace(pipeline_cfg, microbatches=m)
        try:
            validate_batch(mesh, rules, cfg, t, pc)
        except UserError:
            continue
        out.append(pc)
    return out


def schedule_choices(
    cfg, sizes: dict[str, int], train_cfg: TrainConfig, pipeline_cfg: PipelineConfig, rules
) -> list[PipelineConfig]:
    """`pipeline_cfg` under every other schedule the run accepts at its micro-batch count: those
    that run each stage's layers once (gpipe, 1f1b, zb_h1), then those with chunks (circular and
    interleaved_1f1b) at 2 and 4 chunks per device where the layers divide, in the order of
    models/pipeline/timetables.py. Their bubbles and activation memory differ, the rest of the step
    does not."""
    out = []
    once = [(t.name, 1) for t in TIMETABLES.values() if not t.chunked]
    chunked = [(t.name, r) for t in TIMETABLES.values() if t.chunked for r in (2, 4)]
    for schedule, repeats in once + chunked:
        pc = dataclasses.replace(pipeline_cfg, schedule=schedule, repeats=repeats)
        if pc != pipeline_cfg and not check(cfg, sizes, train_cfg, pc, rules):
            out.append(pc)
    return out


def compare_schedules(
    cfg,
    sizes: dict[str, int],
    hw: Hardware,
    batch_size: int,
    seq_len: int,
    micro_batches: int = 1,
    **kw,
) -> list[dict]:
    """The run's pipeline settings under each schedule the run accepts at its micro-batch count
    (schedule_choices): per device, activations, total memory, fit, predicted step time, and the
    bubble by its formula and counted in the schedule's timetable. `kw`: evaluate's."""
    pc, P = kw.get("pipeline_cfg") or PipelineConfig(), sizes.get("pipeline", 1)
    pc = dataclasses.replace(pc, microbatches=pc.microbatches_for(P))
    rules, t = (
        kw.get("rules") or make_rules(),
        with_batch(kw.get("train_cfg"), batch_size, seq_len, micro_batches),
    )
    out = []
    for choice in [pc] + schedule_choices(cfg, {a: sizes.get(a, 1) for a in AXES}, t, pc, rules):
        row = evaluate(
            cfg, sizes, hw, batch_size, seq_len, micro_batches, **{**kw, "pipeline_cfg": choice}
        )
        M, R = choice.microbatches, choice.repeats
        out.append(
            {
                "schedule": choice.schedule,
                "repeats": R,
                "microbatches": M,
                "bubble_formula": schedule_bubble(choice.schedule, P, M, R),
                "bubble_counted": bubble_counted(choice.schedule, P, M, R),
                "in_flight": timetable(choice.schedule).in_flight(P, M, R),
                "activations": row["memory"]["activations"],
                "total": row["memory"]["total"],
                "fits": row["fits"],
                "t_step_s": row["t_step_s"],
            }
        )
    return out
