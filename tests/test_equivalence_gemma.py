"""A per-layer attention pattern and Gemma's math against one device through the Trainer's real
train step, float32, compared per step after the warm-up (loss, gradient norm, every parameter;
tests/equivalence.py): the gemma-tiny preset with every Gemma option on (local/global layers with
their own windows and RoPE, soft-capped scores and logits, sandwich and (1 + w) norms, GeGLU, q/k
norms, scaled tied embeddings) at 9 layers, so an LG pattern is 4 groups and a tail layer. On
fsdp x model (layers unrolled), context (all_gather with dense attention, ring with blockwise: both
soft-capping paths) and the pipeline under gpipe (the forward-scan engine) and 1f1b (the explicit
schedules' engine; the tail runs on the last stage), and zb_h1 (its split backward), circular
and interleaved_1f1b (two virtual stages a device): every schedule."""

import pytest
from equivalence import (
    assert_runs_match,
    initial_params,
    make_trainer,
    run_steps,
    synthetic_batches,
)

GEMMA = {"model.preset": "gemma-tiny", "model.n_layers": 9}
# (mesh, overrides): one compile each
CASES = [
    ("fsdp=2,model=2", {"model.scan_layers": False}),
    ("context=2,fsdp=2", {}),
    (
        "context=4,model=2",
        {"parallelism.context_strategy": "ring", "model.attention": "blockwise"},
    ),
    ("pipeline=2,fsdp=2", {"pipeline.schedule": "gpipe"}),
    ("pipeline=2,fsdp=2", {"pipeline.schedule": "1f1b"}),
    # the schedules that run the same two engines differently: the split backward, and 2 virtual
    # stages a device (4 groups: one a virtual stage)
    ("pipeline=2,fsdp=2", {"pipeline.schedule": "zb_h1"}),
    ("pipeline=2,fsdp=2", {"pipeline.schedule": "circular", "pipeline.repeats": 2}),
    ("pipeline=2,model=2", {"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2}),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tr = make_trainer("", tmp_path_factory.mktemp("ref"), True, **GEMMA)
    params0 = initial_params(tr)
    return run_steps(tr, synthetic_batches(tr.setup.model_cfg.vocab_size), params0), params0


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, over", CASES, ids=[f"{m}-{o.get('pipeline.schedule', '')}" for m, o in CASES]
)
def test_gemma_step_matches_one_device(reference, tmp_path, mesh, over):
    want, params0 = reference
    tr = make_trainer(mesh, tmp_path, **GEMMA, **over)
    got = run_steps(tr, synthetic_batches(tr.setup.model_cfg.vocab_size), params0)
    assert_runs_match(got, want, f"{mesh} {over}")
    if "pipeline" in mesh:  # the groups split over the stages, the tail whole on each
        blocks, tail = (
            got["state"].params[k]["mlp"]["w_gate_DF"] for k in ("blocks", "tail_blocks")
        )
        assert blocks.addressable_shards[0].data.shape[0] == blocks.shape[0] // 2
        assert tail.addressable_shards[0].data.shape[0] == tail.shape[0] == 1
