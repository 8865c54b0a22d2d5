"""plan/report.py and plan/theory.py: the collectives measured in the compiled train step agree
with the ring-formula theory, and memory per device follows the sharding. Compile only; nothing is
trained."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from cpu_env import cpu_env

from plan.hlo import KINDS
from plan.report import analyze, memory_traffic
from train.core.config import build
from train.core.setup import abstract_state
from train.run.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg(mesh, **over):
    # batch 16 x seq 256: large enough that XLA:CPU gathers the FSDP embedding table
    # instead of moving activations with all-to-all (at batch 8 it chooses the latter and
    # theory no longer applies)
    d = {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "parallelism.mesh": mesh,
        "train.batch_size": 16,
        "train.seq_len": 256,
    }
    d.update(over)
    return build(d)


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def get(mesh, micro=1, batch=16):
        key = (mesh, micro, batch)
        if key not in cache:
            cache[key] = analyze(
                Trainer(
                    cfg(mesh, **{"train.micro_batches": micro, "train.batch_size": batch})
                ).setup
            )
        return cache[key]

    return get


def measured(r, kind, axes):
    return r["collectives_detail"][kind]["by_axes"][axes]["operand_bytes"]


def test_report_shape(reports):
    r = reports("data=8")
    assert (
        r["mesh"] == "data=8"
        and r["devices"] == 8
        and r["backend"] == "cpu"
        and r["params"] == 132416
    )
    assert set(r) >= {
        "memory",
        "flops_per_step",
        "collectives",
        "theory",
        "theory_on_backend",
        "notes",
        "sharding",
    }
    assert r["flops_per_step"] == (6 * 115200 + 12 * 2 * 4 * 16 * 256) * 16 * 256
    assert r["flops_per_step_per_device_compiled"] > 0
    assert len(r["sharding"]) == 12


def test_pure_dp_all_reduce_matches_theory(reports):
    r = reports("data=8")
    th = r["theory_on_backend_detail"]
    assert set(th) == {"all-reduce@data"}
    assert th["all-reduce@data"]["operand_bytes"] == 132416 * 4  # every gradient, once
    got = measured(r, "all-reduce", "data")
    assert got == pytest.approx(th["all-reduce@data"]["operand_bytes"], rel=0.10)
    # pure DP: no gathers, and nothing over other axes
    assert r["collectives_detail"]["all-gather"]["count"] == 0
    assert set(r["collectives_detail"]["all-reduce"]["by_axes"]) == {"data"}


def test_fsdp_collectives_match_theory(reports):
    r = reports("fsdp=8")
    th = r["theory_on_backend_detail"]
    assert set(th) == {"all-gather@fsdp", "all-reduce@fsdp"}
    # CPU lowers it as all-reduce + dynamic-slice
    assert "reduce-scatter@fsdp" in r["theory_detail"]
    ag, ar = measured(r, "all-gather", "fsdp"), measured(r, "all-reduce", "fsdp")
    assert ag == pytest.approx(th["all-gather@fsdp"]["operand_bytes"], rel=0.10)
    assert ar == pytest.approx(th["all-reduce@fsdp"]["operand_bytes"], rel=0.10)
    # theory by hand: layer weights gathered twice (forward + remat), embed/head once, shards of 1/8
    layer_w, other_w = 2 * 12288 + 2 * 36864, 2 * 264 * 64
    assert th["all-gather@fsdp"]["operand_bytes"] == (2 * layer_w + other_w) * 4 / 8
    assert any("reduce-scatter" in n for n in r["notes"])


def test_tensor_parallel_all_reduce_matches_theory(reports):
    """Under tensor parallelism q/k/v and gate/up each come from one einsum (models.attention
    fused_qkv, models.layers.fused_mlp), so each group's input gradient is all-reduced once, as
    the theory counts; two gate/up einsums would add a [B, T, D] all-reduce a layer (+17% here)."""
    r = reports("data=4,model=2")
    th = r["theory_on_backend_detail"]["all-reduce@model"]["operand_bytes"]
    assert measured(r, "all-reduce", "model") == pytest.approx(th, rel=0.05)


def test_fsdp_micro_batches_scale_all_gather(reports):
    one = reports("fsdp=8", 1, 16)
    two = reports("fsdp=8", 2, 32)  # same 16 rows per micro-batch
    th = two["theory_on_backend_detail"]["all-gather@fsdp"]["operand_bytes"]
    assert th == 2 * one["theory_on_backend_detail"]["all-gather@fsdp"]["operand_bytes"]
    got = measured(two, "all-gather", "fsdp")
    assert got == pytest.approx(th, rel=0.10)
    assert 1.8 < got / measured(one, "all-gather", "fsdp") < 2.2


def test_dp_micro_batches_all_reduce_once(reports):
    r = reports("data=8", 2, 32)
    th = r["theory_on_backend_detail"]["all-reduce@data"]["operand_bytes"]
    assert measured(r, "all-reduce", "data") == pytest.approx(th, rel=0.10)


def test_memory_scales_with_fsdp(reports):
    dp, fs = reports("data=8")["memory"], reports("fsdp=8")["memory"]
    assert dp["params_bytes"] == 132416 * 4
    assert fs["params_bytes"] == pytest.approx(dp["params_bytes"] / 8, rel=0.05)
    assert fs["optimizer_bytes"] == pytest.approx(dp["optimizer_bytes"] / 8, rel=0.05)
    # mu + nu (+ counts)
    assert dp["optimizer_bytes"] == pytest.approx(2 * dp["params_bytes"], rel=1e-3)
    assert fs["argument_bytes"] < dp["argument_bytes"] / 4


@pytest.mark.slow
def test_plan_cli_json():
    # batch 16, seq 256: the same shapes as the in-process fsdp report
    env = cpu_env(8)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "plan",
            "--model",
            "tiny",
            "--mesh",
            "fsdp=8",
            "--json",
            "--batch-size",
            "16",
            "--seq-len",
            "256",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    assert {"memory", "flops_per_step", "collectives", "theory"} <= set(r)
    assert "sharding" not in r  # only with --show-sharding
    assert r["mesh"] == "fsdp=8" and r["memory"]["params_bytes"] == pytest.approx(
        132416 * 4 / 8, rel=0.05
    )
    assert r["collectives_detail"]["all-gather"]["by_axes"]["fsdp"]["operand_bytes"] > 0
    assert "all-gather@fsdp" in r["theory_detail"]
    # the headline keys map each collective kind to bytes per device per step
    assert (
        set(r["collectives"])
        == set(r["theory"])
        == set(KINDS)
        >= {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
    )
    assert r["collectives"]["all-gather"] == r["collectives_detail"]["all-gather"]["operand_bytes"]
    # CPU chose all-reduce
    assert r["theory"]["reduce-scatter"] > 0 and r["collectives"]["reduce-scatter"] == 0


def test_moe_all_to_all_matches_theory():
    r = analyze(Trainer(cfg("expert=8", **{"model.preset": "moe-tiny", "train.seq_len": 64})).setup)
    th = r["theory_detail"]["all-to-all@expert"]
    assert measured(r, "all-to-all", "expert") == pytest.approx(th["operand_bytes"], rel=0.02)
    # by hand: 16/8 x 64 = 128 tokens per device, each sending min(k=2, 1 expert per device) row to
    # each of 8 devices: 1024 rows of 64 floats; there and back in the forward, the backward and the
    # remat recompute, plus the int32 expert ids (forward and recompute); 2 MoE layers. Plus the
    # embedding lookup: the table is sharded on D over 'expert' (FSDP outside the experts), and each
    # of the 128 tokens gets its row of 64 floats by all-to-all, forward and backward.
    rows, lookup = 8 * 128, 2 * 128 * 64 * 4
    assert th["operand_bytes"] == 2 * (2 * 3 * rows * 64 * 4 + 2 * rows * 4) + lookup
    assert th["ideal_bytes"] == 2 * 2 * 3 * 128 * 2 * 64 * 4 + lookup
    assert r["active_params"] < r["params"]
    # expert weights are neither gathered nor reduced over the expert axis; the other weights are
    # (the expert axis is an FSDP axis outside the experts)
    assert measured(r, "all-gather", "expert") == pytest.approx(
        r["theory_detail"]["all-gather@expert"]["operand_bytes"], rel=0.02
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh,dispatch", [("fsdp=2,expert=2,model=2", "dropless"), ("expert=4,model=2", "capacity")]
)
def test_moe_tensor_parallel_matches_theory(mesh, dispatch):
    """Experts split over 'model' psum their partial outputs (fwd); the backward sums the tokens'
    gradient once, [U,D], whatever the dispatch buffer's size. 512 tokens per device, more than the
    264 vocabulary rows: the partitioner gathers the embedding table rather than exchanging the
    looked-up rows by all-to-all, whose backward jax 0.12's partitioner lowers differently from
    0.10's (theory._lookup_bytes), so the all-to-alls here are the MoE's alone."""
    seq = 128
    r = analyze(
        Trainer(
            cfg(
                mesh,
                **{"model.preset": "moe-tiny", "train.seq_len": seq, "model.dispatch": dispatch},
            )
        ).setup
    )
    th = r["theory_on_backend_detail"]
    assert measured(r, "all-reduce", "model") == pytest.approx(
        th["all-reduce@model"]["operand_bytes"], rel=0.10
    )
    assert measured(r, "all-to-all", "expert") == pytest.approx(
        th["all-to-all@expert"]["operand_bytes"], rel=0.02
    )
    n = 16 // 4 * seq  # tokens per device: the batch is split 4 ways in both meshes
    act = n * 64 * 4
    # per layer: attention out + its remat + the fused q/k/v input grad, expert psum, the tokens'
    # [U,D] gradient (one psum: models/moe_dispatch.py marks them varying over 'model' before
    # dispatch), gate grads
    layer = 3 * act + act + act + 2 * n * 4
    assert th["all-reduce@model"]["operand_bytes"] == 2 * layer + 2 * act + 3 * n * 4
    # expert weights: gathered inside shard_map, so their gradients leave by a real
    if "fsdp" in mesh:
        # reduce-scatter even on CPU (3 per layer), while the rest become all-reduce + slice
        rs = th["reduce-scatter@fsdp"]["operand_bytes"]
        assert rs == 2 * 3 * 8 * 64 * 64 * 4 / 2 / 2  # full [X=4, D, F/2] per weight
        assert measured(r, "reduce-scatter", "fsdp") == pytest.approx(rs, rel=0.02)


@pytest.mark.slow
def test_whole_experts_over_fsdp_match_theory():
    """--parallelism.experts_over_fsdp on: the expert weights never move (no gather and no
    reduce-scatter over fsdp alone), the tokens cross all 8 devices; theory follows the rules."""
    over = {"model.preset": "moe-tiny", "train.seq_len": 128}
    whole = analyze(
        Trainer(cfg("fsdp=4,expert=2", **over, **{"parallelism.experts_over_fsdp": "on"})).setup
    )
    sliced = analyze(
        Trainer(cfg("fsdp=4,expert=2", **over, **{"parallelism.experts_over_fsdp": "off"})).setup
    )
    th = whole["theory_on_backend_detail"]
    assert measured(whole, "all-to-all", "fsdp,expert") == pytest.approx(
        th["all-to-all@fsdp,expert"]["operand_bytes"], rel=0.02
    )
    for kind in ("all-gather", "reduce-scatter"):
        assert "fsdp" not in whole["collectives_detail"][kind]["by_axes"]
        assert f"{kind}@fsdp" not in th
        assert measured(sliced, kind, "fsdp") > 0  # the sliced layout's expert weights move
    # the sliced layout's tokens cross `expert` alone, as its theory says
    assert measured(sliced, "all-to-all", "expert") == pytest.approx(
        sliced["theory_on_backend_detail"]["all-to-all@expert"]["operand_bytes"], rel=0.02
    )


@pytest.mark.slow
def test_local_sgd_reports_bytes_per_sync_and_per_step():
    """DiLoCo: the outer all-reduce sits in a lax.cond branch run every H-th step; the HLO holds it
    once."""
    from plan import compiled_cost, hardware

    r = analyze(Trainer(cfg("data=4,fsdp=2", **{"comm.sync_every": 4, "train.seq_len": 64})).setup)
    th = r["theory_detail"]["all-reduce@data"]
    assert th["sync_every"] == 4 and r["sync_every"] == 4
    assert th["operand_bytes"] == th["per_sync_operand_bytes"] / 4
    assert measured(r, "all-reduce", "data") == pytest.approx(
        th["per_sync_operand_bytes"], rel=0.10
    )
    sync = analyze(Trainer(cfg("data=4,fsdp=2", **{"train.seq_len": 64})).setup)["theory_detail"][
        "all-reduce@data"
    ]
    assert th["per_sync_operand_bytes"] == sync["operand_bytes"] and "sync_every" not in sync
    # the cost model charges the amortised bytes of the measured HLO every step
    hw = dataclasses.replace(hardware.get("h100"), platform="cpu", overlap=False)
    c = build(
        {
            "model.preset": "tiny",
            "model.dtype": "float32",
            "train.batch_size": 16,
            "train.seq_len": 64,
        }
    )
    pred = compiled_cost.from_plan(r, hw, c.model, 16, 64, 1, {"data": 4, "fsdp": 2})
    got = pred["comm"]["all-reduce@data"]
    hlo = r["collectives_detail"]["all-reduce"]["by_axes"]["data"]["wire_bytes"]
    assert got["wire_bytes"] == pytest.approx(hlo / 4) and got["per_sync_wire_bytes"] == hlo


@pytest.mark.slow
def test_memory_traffic_counts_every_layer():
    """XLA's cost analysis counts a scanned layer once; plan's memory term counts all of them."""
    tr = Trainer(cfg("data=8", **{"model.n_layers": 4}))
    r = analyze(tr.setup)
    t = memory_traffic(tr.setup, r)
    assert t["bytes_accessed"] > 1.3 * r["bytes_accessed_per_device_compiled"] > 0
    assert t["flops"] > 2 * r["flops_per_step_per_device_compiled"]  # 4 layers, not 1


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2)])
def test_cost_prices_the_pipeline_bubble_that_plan_prints_and_the_run_has(schedule, repeats):
    """--micro-batches (gradient accumulation) repeats the whole pipeline; the bubble comes from
    the schedule the run validates and plan prints: (P-1)/(R*M+P-1), M = --pipeline.microbatches."""
    from plan import compiled_cost, hardware
    from plan.render import render_cost
    from plan.report import pipeline_report
    from plan.run_spec import run_spec
    from plan.theory import theory

    P, M, G, R = 2, 4, 2, repeats
    c = cfg(
        "pipeline=2,data=2,model=2",
        **{
            "model.n_layers": 4,
            "train.seq_len": 32,
            "train.micro_batches": G,
            "pipeline.microbatches": M,
            "pipeline.schedule": schedule,
            "pipeline.repeats": R,
        },
    )
    tr = Trainer(c)  # accepts the schedule: its passes of 16 / G rows are cut into M micro-batches
    # plan's pipeline section
    printed = pipeline_report(tr.setup, {"collective-permute": {"by_axes": {}}})
    report = {
        "backend": "cpu",
        "flops_per_step": 1.0,
        "pipeline": printed,
        "theory_detail": theory(run_spec(tr.setup), abstract_state(tr.setup).params),
    }
    priced = compiled_cost.from_plan(
        report, hardware.get("h100"), c.model, 16, 32, G, dict(tr.setup.mesh.shape)
    )
    assert printed["microbatches"] == M and printed["repeats"] == R
    assert printed["bubble"] == priced["bubble"] == pytest.approx((P - 1) / (R * M + P - 1))
    assert priced["bubble"] != pytest.approx((P - 1) / (G + P - 1))  # not the accumulation count
    assert f"= {printed['bubble']:.1%}" in printed["chart"]
    assert f"pipeline bubble {100 * priced['bubble']:.1f}%" in render_cost(priced)
    # a GPU/TPU target prices the stage-to-stage sends plan counts (bubble ticks included)
    assert (
        priced["comm"]["collective-permute@pipeline"]["wire_bytes"]
        == printed["permute_bytes_theory"]
    )


def test_vocab_parallel_head_matches_theory():
    """Few tokens per FSDP group (8 x 16 = 128 < 264 rows): `auto` shards the head on the
    vocabulary, so its weights never move; the head's input, the lookup and the loss's reductions
    do."""
    r = analyze(Trainer(cfg("fsdp=8", **{"train.batch_size": 8, "train.seq_len": 16})).setup)
    th = r["theory_on_backend_detail"]
    head = next(row for row in r["sharding"] if row["name"] == "lm_head_DV")
    assert head["local_shape"] == [64, 264 // 8]  # sharded on the vocabulary, not on d_model
    for kind in ("all-gather", "all-reduce"):
        assert measured(r, kind, "fsdp") == pytest.approx(
            th[f"{kind}@fsdp"]["operand_bytes"], rel=0.10
        ), kind
    # by hand: layer weights gathered twice (forward + remat), embedding and head never; the head's
    # input [128 tokens, 64] twice and the targets once, each device sending its 16 tokens' share
    layer_w = 2 * 12288 + 2 * 36864
    assert th["all-gather@fsdp"]["operand_bytes"] == 2 * layer_w * 4 / 8 + 2 * 16 * 64 * 4 + 16 * 4
