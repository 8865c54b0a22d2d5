"""`plan` and `plan --search` across pipeline schedules (plan/search.py): the activation estimate
per schedule (1F1B flat in the micro-batch count, GPipe linear), the bubble counted in each
schedule's timetable against its formula, the 70B example placed on a layout that fits, and the
per-schedule table of `plan --devices`."""

import argparse
import dataclasses

import pytest

from mesh.rules import make_rules
from mesh.spec import AXES
from models.config import PipelineConfig
from models.pipeline import timetables
from models.presets import preset
from plan import cli, estimate, hardware, schedules, search
from train.core.config import build

MESH_70B = {"model": 8, "pipeline": 4, "data": 32}


@pytest.mark.parametrize(
    "schedule, R", [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2)]
)
@pytest.mark.parametrize("P, M", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (3, 9)])
def test_bubble_counted_in_the_timetable_is_the_formula(schedule, R, P, M):
    if R > 1 and M % P:
        pytest.skip("chunked schedules need M a multiple of P")
    assert timetables.bubble_counted(schedule, P, M, R) == pytest.approx(
        timetables.bubble_fraction(P, M, R), abs=1e-12
    )


def test_1f1b_activations_are_flat_in_microbatches_and_gpipe_linear():
    """P = 4, micro-batches of a fixed size (4 sequences), M = 4, 8, 16: the estimate for 1F1B
    stays within 20% (the ring holds min(M, 2(P-1)) stage inputs), GPipe's grows with M."""
    cfg, hw = preset("7b"), hardware.get("h100")

    def act(schedule, M):
        pc = PipelineConfig(microbatches=M, schedule=schedule)
        row = estimate.evaluate(
            cfg, {"pipeline": 4, "fsdp": 2}, hw, 4 * 2 * M, 2048, pipeline_cfg=pc
        )
        return row["memory"]["activations"]

    one_f = {M: act("1f1b", M) for M in (4, 8, 16)}
    gpipe = {M: act("gpipe", M) for M in (4, 8, 16)}
    assert max(one_f.values()) <= 1.2 * min(one_f.values()), one_f
    assert gpipe[16] / gpipe[4] > 3.5 and gpipe[8] / gpipe[4] > 1.8, gpipe
    assert one_f[16] < gpipe[16] / 4


def test_70b_example_fits_with_1f1b_where_gpipe_does_not():
    """The README's 70B layout on 1,024 H100s: GPipe keeps all 32 micro-batches' activations and
    does not fit; 1f1b and interleaved_1f1b keep a bounded ring and do, at the same bubble
    (or less)."""
    rows = schedules.compare_schedules(
        preset("70b"),
        MESH_70B,
        hardware.get("h100"),
        1024,
        4096,
        pipeline_cfg=PipelineConfig(microbatches=32),
    )
    by = {(r["schedule"], r["repeats"]): r for r in rows}
    assert (
        not by["gpipe", 1]["fits"] and by["1f1b", 1]["fits"] and by["interleaved_1f1b", 2]["fits"]
    )
    assert by["1f1b", 1]["bubble_formula"] == by["gpipe", 1]["bubble_formula"]
    assert by["interleaved_1f1b", 2]["bubble_formula"] < by["1f1b", 1]["bubble_formula"]
    assert by["1f1b", 1]["in_flight"] == 2 * (4 - 1) and by["gpipe", 1]["in_flight"] == 32
    # zb_h1: a smaller bubble for the weight gradients' inputs of up to P micro-batches
    zb = by["zb_h1", 1]
    assert (
        zb["bubble_formula"] < by["1f1b", 1]["bubble_formula"]
        and zb["t_step_s"] < by["1f1b", 1]["t_step_s"]
    )
    assert zb["activations"] > 4 * by["1f1b", 1]["activations"]
    for r in rows:
        assert r["bubble_counted"] == pytest.approx(r["bubble_formula"])


def test_search_ranks_schedules_and_places_70b_on_a_layout_that_fits():
    """On the 70B example's device count and batch, the search offers that mesh on a layout that
    fits (GPipe alone, as the run's own settings price it, does not)."""
    m70, hw = preset("70b"), hardware.get("h100")
    rows = search.search(
        m70, 1024, hw, batch_size=1024, seq_len=4096, pipeline_cfg=PipelineConfig(microbatches=32)
    )
    piped = [r for r in rows if r["sizes"]["pipeline"] > 1 and r["fits"]]
    assert piped and {r["pipeline"]["schedule"] for r in piped} <= {
        "gpipe",
        "circular",
        "1f1b",
        "zb_h1",
        "interleaved_1f1b",
    }
    mesh = next(r for r in rows if r["sizes"] == {**dict.fromkeys(r["sizes"], 1), **MESH_70B})
    # it fits on a schedule that bounds the in-flight activations, or with sequence parallelism
    assert mesh["fits"] and (
        mesh["pipeline"]["schedule"] in ("1f1b", "interleaved_1f1b") or mesh["sequence_parallel"]
    )
    gpipe = estimate.evaluate(
        m70, MESH_70B, hw, 1024, 4096, pipeline_cfg=PipelineConfig(microbatches=32)
    )
    assert not gpipe["fits"]


def test_plan_devices_prints_the_schedule_table():
    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    cfg = build(
        {
            "model.preset": "70b",
            "parallelism.mesh": "model=8,pipeline=4,data=32",
            "train.batch_size": 1024,
            "train.seq_len": 4096,
            "pipeline.microbatches": 32,
        }
    )
    row, out = cli.analytic(parser.parse_args(["--devices", "1024", "--hardware", "h100"]), cfg)
    table = out[out.index("pipeline schedules at this micro-batch count") :].splitlines()
    names = [line.split()[0] for line in table[2:]]
    assert names == [
        "gpipe",
        "1f1b",
        "zb_h1",
        "circular",
        "circular",
        "interleaved_1f1b",
        "interleaved_1f1b",
    ]
    assert " no " in table[2] and "yes" in table[3] and len(row["schedules"]) == 7


def test_schedule_choices_follow_the_runs_checks():
    """Chunk counts that do not divide the layers are not offered; MoE models get every schedule
    (XLA:CPU's thread pool is checked by a run on CPU, not by a plan, which prices other
    hardware)."""
    t = estimate.with_batch(None, 64, 128, 1)
    choices = schedules.schedule_choices(
        dataclasses.replace(preset("7b"), n_layers=8),
        {**dict.fromkeys(AXES, 1), "pipeline": 4},
        t,
        PipelineConfig(microbatches=8),
        make_rules(),
    )
    assert {(c.schedule, c.repeats) for c in choices} == {
        ("1f1b", 1),
        ("zb_h1", 1),
        ("circular", 2),
        ("interleaved_1f1b", 2),
    }
    moe = schedules.schedule_choices(
        preset("moe-tiny"),
        {**dict.fromkeys(AXES, 1), "pipeline": 2},
        t,
        PipelineConfig(microbatches=2),
        make_rules(),
    )
    assert {"1f1b", "zb_h1"} <= {c.schedule for c in moe}


def test_explicit_schedules_price_the_stage_recompute():
    """1f1b's backward recomputes the stage forward from its saved input: one more forward of every
    layer than GPipe, in the FLOPs the cost model times (BENCHMARKS.md measures ~1.4x on CPU)."""
    from plan import cost

    cfg = preset("7b")
    gpipe, one_f = (cost.hardware_flops_per_step(cfg, 8, 4096, s) for s in ("gpipe", "1f1b"))
    blocks_fwd = 2 * (cost.matmul_param_count(cfg) - cfg.vocab_size * cfg.d_model)
    attn_fwd = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 4096
    assert one_f - gpipe == (blocks_fwd + attn_fwd) * 8 * 4096
    rows = {
        r["schedule"]: r
        for r in schedules.compare_schedules(
            preset("70b"),
            MESH_70B,
            hardware.get("h100"),
            1024,
            4096,
            pipeline_cfg=PipelineConfig(microbatches=32),
        )
    }
    assert rows["1f1b"]["t_step_s"] > rows["gpipe"]["t_step_s"]
