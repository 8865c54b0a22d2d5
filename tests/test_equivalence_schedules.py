"""The explicit pipeline schedules (1f1b, interleaved_1f1b, zb_h1; models/pipeline/explicit.py)
against one device through the Trainer's real train step: a float32 dense model of 8 layers,
compared per step after the warm-up (loss, gradient norm, every parameter; tests/equivalence.py),
on pipeline=2 and 4 with data, fsdp and model axes, M = P, 2P and 4P, the layers scanned and
unrolled in a stage.

A dense model's loss is a mean over the batch's tokens whatever the micro-batching, so the
one-device reference needs no gradient accumulation (the MoE comparison in
test_equivalence_pipeline.py does, for MoE through every schedule). zb_h1 also runs with gradient
accumulation (train.micro_batches)."""

import pytest
from equivalence import (
    assert_runs_match,
    initial_params,
    make_trainer,
    run_steps,
    synthetic_batches,
)

DENSE = {"model.preset": "tiny", "model.n_layers": 8}
# (mesh, schedule, repeats, M, overrides): one compile each, ~20-40 s on 2 cores
CASES = [
    ("pipeline=2,data=2,fsdp=2", "1f1b", 1, 2, {}),  # M = P
    ("pipeline=4,model=2", "1f1b", 1, 8, {"model.scan_layers": False}),  # 2P, unrolled
    ("pipeline=2,fsdp=2,model=2", "interleaved_1f1b", 2, 4, {}),  # 2P
    ("pipeline=4,data=2", "interleaved_1f1b", 2, 4, {}),  # P, one layer per chunk
    ("pipeline=2,model=2", "interleaved_1f1b", 4, 8, {"model.scan_layers": False}),  # 4P, unrolled
    ("pipeline=2,data=2,fsdp=2", "zb_h1", 1, 2, {}),  # P
    ("pipeline=4,model=2", "zb_h1", 1, 8, {"model.scan_layers": False}),  # 2P, unrolled
    ("pipeline=2,model=2", "zb_h1", 1, 8, {}),  # 4P
    ("pipeline=2,model=2", "zb_h1", 1, 2, {"train.micro_batches": 2}),  # P, accumulating
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tr = make_trainer("", tmp_path_factory.mktemp("ref"), True, **DENSE)
    params0 = initial_params(tr)
    return run_steps(tr, synthetic_batches(264), params0), params0


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, schedule, repeats, M, over", CASES, ids=[f"{c[0]}-{c[1]}-R{c[2]}-M{c[3]}" for c in CASES]
)
def test_schedule_step_matches_one_device(reference, tmp_path, mesh, schedule, repeats, M, over):
    want, params0 = reference
    tr = make_trainer(
        mesh,
        tmp_path,
        **DENSE,
        **over,
        **{"pipeline.schedule": schedule, "pipeline.repeats": repeats, "pipeline.microbatches": M},
    )
    got = run_steps(tr, synthetic_batches(264), params0)
    assert_runs_match(got, want, f"{mesh} {schedule} R={repeats} M={M}")
    # each pipeline device stores only its own layers (the rule layers -> pipeline)
    w = got["state"].params["blocks"]["mlp"]["w_gate_DF"]
    assert w.addressable_shards[0].data.shape[0] == w.shape[0] // tr.setup.mesh.shape["pipeline"]
