"""Pipeline schedules (models/pipeline: timetables.py, charts.py, checks.py) without a mesh: the
stage order, the bubble fraction, the order in which a schedule visits the layer chunks, the chart
and its plot, and every bad schedule setting in one line."""

import jax.numpy as jnp
import pytest

from errors import UserError
from models import pipeline as pipeline_lib

# ------------------------------------------------------------------ schedule arithmetic and chart


def test_stage_order_round_trip():
    a = jnp.arange(12)
    assert pipeline_lib.to_stage_order(a, 2, 3).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert (
        pipeline_lib.to_model_order(pipeline_lib.to_stage_order(a, 2, 3), 2, 3).tolist()
        == a.tolist()
    )
    assert pipeline_lib.to_stage_order(a, 4, 1).tolist() == a.tolist()


def test_bubble_fraction():
    assert pipeline_lib.bubble_fraction(1, 4) == 0
    assert pipeline_lib.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert pipeline_lib.bubble_fraction(4, 16) == pytest.approx(3 / 19)
    assert pipeline_lib.bubble_fraction(4, 4, repeats=2) == pytest.approx(3 / 11)
    assert pipeline_lib.n_ticks(4, 8, 2) == 19


def test_schedule_visits_every_layer_chunk_in_order():
    """Each micro-batch runs virtual stages 0..R*P-1 in order, one per tick, never two at once on a
    device."""
    for P, M, R in [(2, 2, 1), (4, 6, 1), (2, 4, 3), (4, 8, 2)]:
        table = pipeline_lib.schedule_table(P, M, R)
        seen = {}
        for s, row in enumerate(table):
            assert sum(c is not None for c in row) == R * M  # busy R*M ticks, idle P-1
            for t, c in enumerate(row):
                if c is not None:
                    m, r = c
                    seen[(m, r * P + s)] = t
        for m in range(M):
            ticks = [seen[(m, v)] for v in range(R * P)]
            assert ticks == sorted(set(ticks)), (P, M, R, m, ticks)


def test_schedule_chart_gpipe():
    chart = pipeline_lib.schedule_chart(2, 3, n_layers=4)
    lines = chart.splitlines()
    assert "bubble (P-1)/(R*M+P-1) = 25.0%" in lines[0]
    assert lines[1].split() == [
        "stage",
        "0",
        "(layers",
        "0-1)",
        "F0",
        "F1",
        "F2",
        ".",
        "|",
        ".",
        "B2",
        "B1",
        "B0",
    ]
    assert lines[2].split() == [
        "stage",
        "1",
        "(layers",
        "2-3)",
        ".",
        "F0",
        "F1",
        "F2",
        "|",
        "B2",
        "B1",
        "B0",
        ".",
    ]


def test_schedule_chart_circular_labels_repeats():
    chart = pipeline_lib.schedule_chart(2, 2, repeats=2, schedule="circular", n_layers=8)
    row0 = chart.splitlines()[1]
    assert "(layers 0-1, 4-5)" in row0
    assert row0.split()[5:10] == ["F0.0", "F1.0", "F0.1", "F1.1", "."]


def test_plot_schedule_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = pipeline_lib.plot_schedule(4, 8, 2, "circular", path=str(tmp_path / "s.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kw, culprit",
    [
        ({"microbatches": 2, "stages": 4}, "--pipeline.microbatches=2 is less than the 4 stages"),
        ({"n_layers": 6, "stages": 4}, "model.n_layers=6 is not divisible by --mesh pipeline=4"),
        (
            {"n_layers": 8, "stages": 2, "repeats": 3, "schedule": "circular"},
            "valid repeats are [1, 2, 4]",
        ),
        (
            {"batch": 12, "microbatches": 8},
            "not divisible by --pipeline.microbatches=8; valid microbatches: [4, 6, 12]",
        ),
        ({"batch": 16, "microbatches": 8, "batch_shards": 4}, "micro-batch size 16/8 = 2"),
        ({"repeats": 2}, "--pipeline.repeats=2 needs --pipeline.schedule circular"),
        ({"microbatches": 6, "schedule": "circular"}, "must be a multiple of --mesh pipeline=4"),
        (
            {"schedule": "pipedream"},
            "--pipeline.schedule 'pipedream' is not one of gpipe, circular, 1f1b",
        ),
    ],
)
def test_bad_config_is_one_line(kw, culprit):
    args = {
        "n_layers": 8,
        "batch": 16,
        "stages": 4,
        "microbatches": 4,
        "repeats": 1,
        "schedule": "gpipe",
        **kw,
    }
    with pytest.raises(UserError) as e:
        pipeline_lib.validate(**args)
    assert culprit in str(e.value) and "\n" not in str(e.value)
