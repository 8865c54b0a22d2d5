"""DeepSeek-V3's and Qwen3-MoE's parts against one device: the real train step of float32 models
with latent attention (and its query latent), group-limited sigmoid routing with bias balancing,
shared experts, a dense first layer and a multi-token prediction module (`deepseek-tiny`), and
with Qwen3-MoE's (q/k norms, a free head width, softmax routing without renormalisation, a dense
first layer), on expert x fsdp x model, pipeline (a forward-scan and an explicit schedule, and
DeepSeek's under zb_h1's split backward and interleaved_1f1b's virtual stages; Qwen3-MoE's with an
expert axis) and context (ring and all_gather) meshes, compared per step after the warm-up (loss,
gradient norm, every parameter).

As in tests/test_equivalence_pipeline.py, the one-device reference of a pipeline run accumulates
gradients over the same micro-batches: the balance losses and loads are per micro-batch there."""

import pytest
from equivalence import (
    assert_runs_match,
    initial_params,
    make_trainer,
    run_steps,
    synthetic_batches,
)

# the MTP loss weighted 1 so that a wrong MTP gradient cannot hide under the main loss's
DEEPSEEK = {"model.preset": "deepseek-tiny", "model.mtp_loss_weight": 1.0}
QWEN3_MOE = {
    "model.preset": "moe-tiny",
    "model.n_layers": 3,
    "model.first_dense_layers": 1,
    "model.qk_norm": True,
    "model.attn_head_dim": 32,
    "model.router_renorm": False,
    "model.aux_loss_coef": 0.1,
}
# 5 layers: the dense first one and 4 MoE groups, a group a virtual stage at pipeline 2 x repeats 2
DEEPSEEK_5 = {**DEEPSEEK, "model.n_layers": 5}
MODELS = {"deepseek": DEEPSEEK, "deepseek_5": DEEPSEEK_5, "qwen3_moe": QWEN3_MOE}
# (model, mesh, overrides, micro-batches)
CASES = [
    ("deepseek", "expert=2,fsdp=2,model=2", {}, 1),
    ("deepseek", "pipeline=2,fsdp=2", {"pipeline.schedule": "gpipe"}, 2),
    ("deepseek", "pipeline=2,model=2", {"pipeline.schedule": "1f1b"}, 2),
    ("deepseek", "context=4", {"parallelism.context_strategy": "ring"}, 1),
    ("deepseek", "context=2,fsdp=2", {"parallelism.context_strategy": "all_gather"}, 1),
    ("deepseek", "pipeline=2,fsdp=2", {"pipeline.schedule": "zb_h1"}, 2),
    (
        "deepseek_5",
        "pipeline=2,fsdp=2",
        {"pipeline.schedule": "interleaved_1f1b", "pipeline.repeats": 2},
        2,
    ),
    ("qwen3_moe", "expert=2,fsdp=2,model=2", {}, 1),
    ("qwen3_moe", "pipeline=2,expert=2", {"pipeline.schedule": "gpipe"}, 2),
    ("qwen3_moe", "pipeline=2,model=2", {"pipeline.schedule": "1f1b"}, 2),
    ("qwen3_moe", "context=2,expert=2", {"parallelism.context_strategy": "ring"}, 1),
    ("qwen3_moe", "context=2,fsdp=2", {"parallelism.context_strategy": "all_gather"}, 1),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(model, micro-batches) -> (its one-device run, the initial parameters), each run once."""
    runs = {}

    def get(name: str, micro: int):
        if (name, micro) not in runs:
            tr = make_trainer(
                "",
                tmp_path_factory.mktemp("ref"),
                True,
                **MODELS[name],
                **{"train.micro_batches": micro},
            )
            params0 = initial_params(tr)
            runs[name, micro] = run_steps(tr, synthetic_batches(264), params0), params0
        return runs[name, micro]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh,over,micro", CASES)
def test_family_step_matches_one_device(references, tmp_path, name, mesh, over, micro):
    want, params0 = references(name, micro)
    if micro > 1:
        over = {**over, "pipeline.microbatches": micro}
    tr = make_trainer(mesh, tmp_path, **MODELS[name], **over)
    got = run_steps(tr, synthetic_batches(264), params0)
    assert_runs_match(got, want, f"{name} {mesh} {over}")
