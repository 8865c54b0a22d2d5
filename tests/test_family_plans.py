"""`plan` on the published family presets at a mesh a user would run them on: each is priced
(formulas, no compile), fits the device, and holds its parameters once across the devices but for
what the run replicates: parameters per device x devices / data = the model's count, plus, on a
pipeline mesh, (pipeline - 1) x what every stage keeps whole (the embedding, the head, the dense
first layers, the multi-token prediction modules: mesh/rules.py's `outer_layers`), within 1% (the
norms and router biases, replicated over every axis, are the rest: DeepSeek-V3 683.2B held against
682.6B on expert=64,fsdp=8,data=4; 698.4B against 682.6B + 15.2B on the pipeline mesh). On
small pipeline meshes plan's parameter bytes per device are exactly the run's own shardings'."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import pytest

from mesh.rules import make_rules
from mesh.shard import is_axis_names
from models import flops
from models import model as model_lib
from models.presets import preset as build_preset
from plan import hardware, search
from plan.activation_memory import activation_bytes
from plan.cli import main as plan_main
from plan.estimate import evaluate
from plan.run_spec import abstract_mesh
from train.core import optim
from train.core import state as state_lib
from train.core.config import TrainConfig

# preset, mesh, devices, global batch, sequence
CASES = [
    ("gemma3-4b", "fsdp=8", 8, 32, 4096),
    ("gemma3-27b", "fsdp=8,model=8", 64, 64, 4096),
    ("qwen3-30b-a3b", "fsdp=8,expert=8", 64, 64, 4096),
    ("deepseek-v3", "expert=64,fsdp=8,data=4", 2048, 2048, 4096),
    ("deepseek-v3", "expert=64,pipeline=2,fsdp=8,data=2", 2048, 2048, 4096),
]


def every_stage_keeps(cfg) -> int:
    """Parameters outside the pipelined layer groups (no `layers` dim): each stage holds them."""
    params, axes = model_lib.abstract_params(cfg), model_lib.param_axes(cfg)
    sizes = jax.tree.map(
        lambda x, names: 0 if "layers" in names else math.prod(x.shape),
        params,
        axes,
        is_leaf=is_axis_names,
    )
    return sum(jax.tree.leaves(sizes))


@pytest.mark.parametrize("preset,mesh,devices,batch,seq", CASES)
def test_plan_prices_each_family_preset(capsys, preset, mesh, devices, batch, seq):
    argv = ["--model", preset, "--mesh", mesh, "--devices", str(devices), "--hardware", "h100"]
    argv += ["--batch-size", str(batch), "--seq-len", str(seq), "--json"]
    assert plan_main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["fits"] and r["devices"] == devices, r["memory"]
    assert r["t_flops_s"] > 0
    # `data` replicates the parameters, and `pipeline` what lies outside the layer groups; every
    # other axis of these meshes shards them
    sizes, cfg = r["sizes"], build_preset(preset)
    held = r["memory"]["params"] * devices / sizes["data"] / 4  # float32 parameters
    want = flops.param_count(cfg) + (sizes["pipeline"] - 1) * every_stage_keeps(cfg)
    assert held == pytest.approx(want, rel=0.01), (held, want)


def test_search_finds_pipeline_meshes_past_the_dense_first_layers():
    """The search splits the layer groups over `pipeline`, as the run does: deepseek-tiny's 3
    layers are 1 dense first layer and 2 MoE groups, so pipeline=2 is a mesh to price (the search
    once pruned it because 3 layers do not halve)."""
    cfg = build_preset("deepseek-tiny")
    rows = search.search(cfg, 4, hardware.get("h100"), batch_size=8, seq_len=64)
    piped = [r for r in rows if r["sizes"]["pipeline"] == 2]
    assert piped and all(r["fits"] for r in piped), [r["mesh"] for r in rows]


@pytest.mark.parametrize(
    "preset,fields",
    [
        ("deepseek-tiny", {}),  # a dense first layer, 2 MoE groups, an MTP module
        ("deepseek-tiny", {"n_layers": 5}),  # 4 groups
        ("gemma-tiny", {"n_layers": 9}),  # LG: 4 groups and a tail layer
    ],
)
def test_plan_holds_what_the_runs_shardings_hold(preset, fields):
    """`plan`'s parameter bytes per device on a pipeline mesh are those of the run's own state
    shardings (train/core/state.py abstract) on that mesh, summed over one device's shards."""
    cfg = dataclasses.replace(build_preset(preset), **fields).validate()
    sizes = {"pipeline": 2, "fsdp": 2, "data": 2}
    r = evaluate(cfg, sizes, hardware.get("h100"), batch_size=8, seq_len=64)
    tx = optim.make(TrainConfig())
    run = state_lib.abstract(cfg, tx, abstract_mesh(r["sizes"]), make_rules()).params
    per_device = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(run)
    )
    assert r["memory"]["params"] == per_device


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_activations_count_the_layers_a_stage_holds(schedule):
    """The forward-scan engine's saved set covers what a stage runs: its share of the layer groups
    and, whole, the dense first layers (deepseek-tiny at 5 layers: 1 dense + 4 groups holds 5, 3
    and 2 layers at 1, 2 and 4 stages), so the savings from 1 to 2 and 1 to 4 stages are 2:3 of
    a layer's saved set (n_layers / p gave 5, 2, 1: 3:4)."""
    cfg = dataclasses.replace(build_preset("deepseek-tiny"), n_layers=5).validate()

    def device_bytes(p):
        sizes = {a: 1 for a in ("data", "fsdp", "model", "expert", "context")} | {"pipeline": p}
        args = dict(batch_size=8, seq_len=64, micro_batches=1, act_bytes=4, attention="dense")
        return activation_bytes(cfg, sizes, **args, shards=1, schedule=schedule)[0]

    one = device_bytes(1)
    assert (one - device_bytes(2)) / (one - device_bytes(4)) == pytest.approx(2 / 3)
