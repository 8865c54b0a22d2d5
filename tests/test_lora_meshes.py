"""LoRA on the pipeline and expert meshes: a LoRA run of the tiny model on pipeline=2,fsdp=2,model=2
(GPipe and 1F1B) and of moe-tiny (attention adapters) on expert=2,fsdp=2,model=2 each equal the same
run on one device after the warm-up (loss, gradient norm, adapters), and the frozen base comes
back bit-identical; `plan` of a LoRA run counts optimizer state and gradients for the adapters
only and the frozen base apart. Float32, 8 fake CPU devices; the helpers are
tests/test_lora.py's."""

from __future__ import annotations

import jax
import pytest
from equivalence import (
    COMPARED,
    WARMUP,
    assert_runs_match,
    assert_trees_close,
    make_trainer,
    synthetic_batches,
)
from test_lora import LORA, _run_steps

from checkpoint.layout import params_only_meta
from checkpoint.manager import Checkpointer
from mesh.build import make_mesh
from models import model
from plan.render import render
from plan.report import analyze
from train.core import lora
from train.core.config import build
from train.core.setup import create_state, setup

MICRO = 4  # pipeline micro-batches: 2 rows each of the 8-row batch, split over fsdp=2
# name -> (mesh, overrides): every case a LoRA run against its own one-device twin
CASES = {
    "gpipe": (
        "pipeline=2,fsdp=2,model=2",
        {"pipeline.microbatches": MICRO, "pipeline.schedule": "gpipe"},
    ),
    "1f1b": (
        "pipeline=2,fsdp=2,model=2",
        {"pipeline.microbatches": MICRO, "pipeline.schedule": "1f1b"},
    ),
    # MoE experts get no adapters (train/core/lora.py), so the attention projections do
    "moe": ("expert=2,fsdp=2,model=2", {"model.preset": "moe-tiny", "lora.targets": "q,k,v,o"}),
}


def _save_base(directory: str, preset: str, seed: int) -> dict:
    """A params-only float32 checkpoint of `preset` at a random init (what an HF import writes) ->
    its params on the host."""
    cfg = build({"model.preset": preset, "model.dtype": "float32"})
    params = jax.device_get(jax.jit(lambda k: model.init(cfg.model, k))(jax.random.key(seed)))
    ck = Checkpointer(directory, keep=0, async_save=False)
    ck.save(0, {"params": params}, params_only_meta(0, {"model": cfg.to_dict()["model"]}))
    ck.close()
    return params


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """preset -> (checkpoint directory, host params), each saved once."""
    cache = {}

    def get(preset: str):
        if preset not in cache:
            directory = str(tmp_path_factory.mktemp(preset))
            cache[preset] = directory, _save_base(directory, preset, seed=7)
        return cache[preset]

    return get


def _trainer(tmp_path, bases, mesh: str, over: dict, one_device: bool = False):
    preset = over.get("model.preset", LORA["model.preset"])
    return make_trainer(
        mesh, tmp_path, one_device, **{**LORA, **over, "checkpoint.init_from": bases(preset)[0]}
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_lora_mesh_matches_one_device_and_keeps_the_base(case, bases, tmp_path):
    """Five steps on one batch from the same adapters: the mesh equals one device after the warm-up,
    the loss falls, and neither run changes a bit of the base."""
    mesh, over = CASES[case]
    sharded = _trainer(tmp_path / "mesh", bases, mesh, over)
    # one device sees the whole batch at once: for a mean loss the pipeline's micro-batches only
    # change the summation order
    single = _trainer(
        tmp_path / "one",
        bases,
        "",
        {k: v for k, v in over.items() if not k.startswith("pipeline.")},
        one_device=True,
    )
    base_params = bases(over.get("model.preset", LORA["model.preset"]))[1]
    batches = synthetic_batches(264, n=1) * (WARMUP + COMPARED)
    adapters0 = jax.device_get(create_state(single.setup).params)
    want = _run_steps(single, batches, adapters0, base_params)
    got = _run_steps(sharded, batches, adapters0, base_params)
    assert_runs_match(got, want, f"LoRA {case} on {mesh}")
    losses = [float(m["loss"]) for m in got["metrics"]]
    assert losses[-1] < losses[0] - 0.05, losses
    for run in (got, want):
        assert_trees_close(run["base"], base_params, "the frozen base", rtol=0, atol_frac=0)
    # the mesh really splits the work: the adapters' layer stack over stages (as the base's), or the
    # base's experts over expert
    if "pipeline" in mesh:
        w = got["state"].params["blocks"]["attn"]["wq_DNH"]["lora_a"]
        assert w.addressable_shards[0].data.shape[0] == w.shape[0] // 2
    else:
        assert sharded.setup.base_shardings["moe_blocks"]["moe"]["w_gate_EDF"].spec[1] == "expert"


@pytest.mark.slow
def test_plan_counts_optimizer_state_for_the_adapters_only(tmp_path):
    """plan of a LoRA run: optimizer state and gradients of the adapters alone (AdamW: two moments
    each), the frozen base counted apart at the full fine-tune's parameter bytes."""
    over = {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "parallelism.mesh": "fsdp=4,model=2",
        "train.batch_size": 8,
        "train.seq_len": 32,
        "logging.run_dir": str(tmp_path),
    }
    mesh = make_mesh("fsdp=4,model=2")
    full = analyze(setup(build(over), mesh))["memory"]
    cfg = build({**over, "lora.rank": 4, "lora.allow_random_base": True})
    got = analyze(setup(cfg, mesh))
    mem = got["memory"]
    adapters = lora.abstract_adapters(cfg.model, cfg.lora)
    adapter_count = sum(x.size for x in jax.tree.leaves(adapters))
    assert adapter_count < 0.2 * sum(
        x.size for x in jax.tree.leaves(model.abstract_params(cfg.model))
    )
    # the adapters are sharded like their weights' dims, so their bytes per device
    # are at most the whole
    assert 0 < mem["params_bytes"] <= adapter_count * 4
    assert mem["gradient_bytes"] == mem["params_bytes"]
    # mu + nu (+ counts)
    assert mem["optimizer_bytes"] == pytest.approx(2 * mem["params_bytes"], rel=1e-3)
    # the base is held as a full fine-tune holds its parameters, and is what dominates the memory
    assert mem["base_bytes"] == full["params_bytes"] and full["base_bytes"] == 0
    # per device the adapters' rank dim is whole, so their share is above the global 0.2 (0.24 here)
    assert mem["optimizer_bytes"] < 0.5 * full["optimizer_bytes"]
    assert mem["argument_bytes"] >= mem["base_bytes"] + mem["params_bytes"] + mem["optimizer_bytes"]
    assert "frozen base" in render(got, show_sharding=False)
