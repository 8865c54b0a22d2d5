"""The pipeline trainer against one device: the real train step of a float32 MoE model (aux and
z losses on) on pipeline=2 and 4 through every schedule (gpipe, circular, 1f1b, interleaved_1f1b,
zb_h1), combined with fsdp and model axes,
compared per step after the warm-up (loss, gradient norm, every parameter), plus the raw
gradient of the loss leaf by leaf.

The pipeline computes the MoE balance loss per micro-batch (each micro-batch is routed on its
own), and a mean of per-micro-batch Switch losses is not the whole batch's. The one-device
reference therefore accumulates gradients over the same micro-batches (train.micro_batches =
pipeline.microbatches): both split the batch into rows m, m+M, m+2M, ..., so the math is the
same. No mesh here has a `data` axis: the pipeline would split each micro-batch once more into
per-replica pieces, each routed on its own, a grouping one device does not reproduce."""

import numpy as np
import pytest
from equivalence import (
    WARMUP,
    assert_runs_match,
    assert_trees_close,
    gradients,
    initial_params,
    make_trainer,
    run_steps,
    synthetic_batches,
)

MICRO = 4
# 8 MoE layers: pipeline=4 with 2 circular repeats still has a whole layer per virtual stage
MOE = {
    "model.preset": "moe-tiny",
    "model.n_layers": 8,
    "model.aux_loss_coef": 0.1,
    "model.z_loss_coef": 0.001,
}
# (mesh, schedule, repeats, layers scanned in a stage, micro-batches): each compared through the
# whole step or through the raw gradient (each a compile of its own, seconds on 2 cores)
STEP_CASES = [
    ("pipeline=2,fsdp=2,model=2", "gpipe", 1, True, MICRO),  # M = 2P
    ("pipeline=4,model=2", "circular", 2, True, MICRO),  # P
    ("pipeline=4,model=2", "1f1b", 1, False, MICRO),  # P, unrolled
    ("pipeline=4,fsdp=2", "interleaved_1f1b", 2, True, MICRO),  # P
    ("pipeline=2,fsdp=2,model=2", "zb_h1", 1, True, MICRO),  # 2P
    ("pipeline=2,model=2", "1f1b", 1, True, 2 * MICRO),
]  # 4P
GRADIENT_CASES = [("pipeline=4,fsdp=2", "gpipe", 1, True, MICRO)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """M -> the one-device trainer (gradient accumulation over M micro-batches), its run and the
    initial parameters every mesh starts from (each M run once)."""
    runs = {}

    def get(micro: int):
        if micro not in runs:
            tr = make_trainer(
                "", tmp_path_factory.mktemp("ref"), True, **MOE, **{"train.micro_batches": micro}
            )
            params0 = initial_params(tr)
            runs[micro] = tr, run_steps(tr, synthetic_batches(264), params0), params0
        return runs[micro]

    return get


def pipeline_trainer(case, tmp_path):
    mesh, schedule, repeats, scan, micro = case
    return make_trainer(
        mesh,
        tmp_path,
        **MOE,
        **{
            "pipeline.microbatches": micro,
            "pipeline.schedule": schedule,
            "pipeline.repeats": repeats,
            "model.scan_layers": scan,
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    STEP_CASES,
    ids=[f"{m}-{s}-M{mb}" + ("" if scan else "-unrolled") for m, s, _, scan, mb in STEP_CASES],
)
def test_pipeline_step_matches_one_device(references, case, tmp_path):
    _, want, params0 = references(case[-1])
    tr = pipeline_trainer(case, tmp_path)
    got = run_steps(tr, synthetic_batches(264), params0)
    assert_runs_match(got, want, f"{case[0]} {case[1]}")
    for i in range(WARMUP, len(want["metrics"])):
        for key in ("moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean"):
            np.testing.assert_allclose(
                float(got["metrics"][i][key]),
                float(want["metrics"][i][key]),
                rtol=1e-5,
                err_msg=f"{case} step {i + 1} {key}",
            )
    # each pipeline device stores only its stages' layers
    w = got["state"].params["moe_blocks"]["moe"]["w_gate_EDF"]
    assert w.addressable_shards[0].data.shape[0] == w.shape[0] // tr.setup.mesh.shape["pipeline"]


@pytest.fixture(scope="module")
def reference_gradient(references):
    """The one-device gradient at trained parameters, on the first compared step's batch."""
    ref_tr, want, _ = references(MICRO)
    params, batch = want["params"][WARMUP - 1], synthetic_batches(264)[WARMUP]
    return params, batch, gradients(ref_tr, params, batch)


@pytest.mark.slow
@pytest.mark.parametrize("case", GRADIENT_CASES, ids=[f"{m}-{s}" for m, s, *_ in GRADIENT_CASES])
def test_pipeline_gradient_matches_one_device(reference_gradient, case, tmp_path):
    """The gradient pytree of the step's loss through the pipeline schedule and through gradient
    accumulation on one device, leaf by leaf."""
    params, batch, (want_loss, want_g) = reference_gradient
    got_loss, got_g = gradients(pipeline_trainer(case, tmp_path), params, batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close(got_g, want_g, f"{case} gradient")
