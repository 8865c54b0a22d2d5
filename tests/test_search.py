"""plan/search.py: the mesh search enumerates only meshes a real run accepts, filters by memory,
ranks sensibly, and its predicted collective bytes are the ones `plan` compiles."""

import argparse
import dataclasses
import math

import pytest

from errors import UserError
from mesh.rules import make_rules
from mesh.spec import AXES, mesh_text
from models.config import PipelineConfig
from models.presets import preset
from plan import cli, estimate, hardware, search
from plan.render import run_flags
from plan.report import analyze
from plan.run_spec import run_spec
from plan.theory import on_backend, theory
from train.core.config import TrainConfig, build
from train.core.setup import abstract_state
from train.run.loop import Trainer


def test_factorizations():
    f = search.factorizations(8)
    assert len(f) == 56 and len(set(f)) == 56  # 2^3 over 6 axes: C(3+5, 5)
    assert all(math.prod(x) == 8 and len(x) == 6 for x in f)
    assert len(search.factorizations(4096)) == math.comb(12 + 5, 5)


def test_every_mesh_found_is_accepted_by_a_real_run_and_the_rest_are_refused():
    """The search's divisibility logic is the trainer's: build a Trainer for every factorisation of
    8."""
    tiny, hw = preset("tiny"), hardware.get("h100")
    two = PipelineConfig(microbatches=2)
    found = {
        r["mesh"] for r in search.search(tiny, 8, hw, batch_size=16, seq_len=32, pipeline_cfg=two)
    }
    assert found and "model=8" not in found  # 4 heads cannot split 8 ways
    # 2 layers; M=2 < 4 stages
    assert "pipeline=2,data=4" in found and "pipeline=4,data=2" not in found
    for shape in search.factorizations(8):
        sizes = dict(zip(("pipeline", "data", "fsdp", "expert", "model"), shape))
        if sizes["expert"] > 1:
            continue  # a dense model has no experts
        text = mesh_text(sizes)
        cfg = build(
            {
                "model.preset": "tiny",
                "parallelism.mesh": text,
                "train.batch_size": 16,
                "train.seq_len": 32,
                "pipeline.microbatches": 2,
            }
        )
        try:
            Trainer(cfg)
            accepted = True
        except UserError:
            accepted = False
        assert accepted == (text in found), text


def test_moe_pipeline_stages_hold_whole_layer_groups():
    """An MoE model pipelines groups of moe_every layers: n_layers % pipeline == 0 is not enough,
    a run needs (n_layers / moe_every) % (pipeline x repeats) == 0, and the search asks the same."""
    # 2 groups
    moe, hw = (
        dataclasses.replace(preset("moe-tiny"), n_layers=4, moe_every=2),
        hardware.get("h100"),
    )
    gpipe, circular = PipelineConfig(), PipelineConfig(schedule="circular", repeats=2)
    t = TrainConfig(batch_size=16, seq_len=32)
    four = {**dict.fromkeys(AXES, 1), "pipeline": 4, "data": 2}
    two = {**dict.fromkeys(AXES, 1), "pipeline": 2, "data": 4}
    # 4 layers % 4 == 0, 2 groups % 4 != 0
    assert "pipeline=4" in estimate.check(moe, four, t, gpipe, make_rules())
    # 2 groups % (2 x 2) != 0
    assert "--pipeline.repeats=2" in estimate.check(moe, two, t, circular, make_rules())
    assert estimate.check(moe, two, t, gpipe, make_rules()) is None
    # 4 groups
    assert (
        estimate.check(dataclasses.replace(moe, n_layers=8), two, t, circular, make_rules()) is None
    )
    found = {r["mesh"] for r in search.search(moe, 8, hw, batch_size=16, seq_len=32)}
    assert "pipeline=2,data=4" in found and not any(m.startswith("pipeline=4") for m in found)
    with pytest.raises(UserError, match="pipeline=4"):  # and the run refuses it too
        Trainer(
            build(
                {
                    "model.preset": "moe-tiny",
                    "model.n_layers": 4,
                    "model.moe_every": 2,
                    "parallelism.mesh": "pipeline=4,data=2",
                    "train.batch_size": 16,
                    "train.seq_len": 32,
                }
            )
        )


def test_search_splits_the_batch_as_the_rules_say():
    """--parallelism.rules batch=data: the batch is split over data only, so 4 rows run on fsdp=8
    (every device holds all 4) but not on data=8."""
    tiny, hw, by_data = preset("tiny"), hardware.get("h100"), make_rules("batch=data")
    found = {
        r["mesh"]: r for r in search.search(tiny, 8, hw, batch_size=4, seq_len=32, rules=by_data)
    }
    assert "fsdp=8" in found and "data=8" not in found
    assert "fsdp=8" not in {
        r["mesh"] for r in search.search(tiny, 8, hw, batch_size=4, seq_len=32)
    }  # default split
    # the run agrees
    Trainer(
        build(
            {
                "model.preset": "tiny",
                "parallelism.mesh": "fsdp=8",
                "parallelism.rules": "batch=data",
                "train.batch_size": 4,
                "train.seq_len": 32,
            }
        )
    )
    # 4 rows per device: the activations of fsdp=8 with 32 rows under the default split over fsdp
    default_32 = estimate.evaluate(tiny, {"fsdp": 8}, hw, 32, 32)
    assert found["fsdp=8"]["memory"]["activations"] == default_32["memory"]["activations"]


def test_pipeline_fsdp_gathers_the_stage_weights_every_tick():
    """On a pipeline mesh every tick (bubble ticks too) gathers its layers' FSDP-sharded weights:
    (M + P-1) ticks a pass, once with --pipeline.gather_once; the embedding and head once."""
    tiny, hw = preset("tiny"), hardware.get("h100")

    def gathered(pc):
        row = estimate.evaluate(tiny, {"pipeline": 2, "fsdp": 4}, hw, 16, 32, pipeline_cfg=pc)
        return row["theory"]["all-gather@fsdp"]["operand_bytes"]

    once = gathered(PipelineConfig(microbatches=4, gather_once=True))
    three, five = gathered(PipelineConfig(microbatches=2)), gathered(PipelineConfig(microbatches=4))
    # (5-1) / (3-1) extra passes
    assert three > once and (five - once) == pytest.approx(2 * (three - once))


def test_70b_cannot_fit_on_8_devices_but_fits_sharded_on_512():
    m70 = preset("70b")
    for name in ("h100", "h200"):
        rows = search.search(m70, 8, hardware.get(name), batch_size=8, seq_len=4096)
        # 70B x 16 bytes of state > 8 x 141 GB: only with the optimizer state in host memory
        assert rows and all("offload" in r for r in rows if r["fits"])
    rows = search.search(m70, 512, hardware.get("h100"), batch_size=512, seq_len=4096)
    by_mesh = {r["mesh"]: r for r in rows}
    assert not by_mesh["data=512"]["fits"]  # a full replica per device
    assert by_mesh["data=512"]["memory"]["params"] == pytest.approx(4 * 70.55e9, rel=0.01)
    fit = [r for r in rows if r["fits"]]
    assert fit and all(r["memory"]["total"] <= 0.9 * hardware.get("h100").hbm_bytes for r in fit)
    assert [r["t_step_s"] for r in fit] == sorted(r["t_step_s"] for r in fit)


def test_7b_on_one_h100_node_prefers_sharding_over_pure_data_parallel():
    rows = search.search(preset("7b"), 8, hardware.get("h100"), batch_size=8, seq_len=4096)
    by_mesh = {r["mesh"]: r for r in rows}
    # 7B x (4 + 4 + 8) bytes = 108 GB > 80 GB: fits only offloaded
    assert "offload" in by_mesh["data=8"]
    best = rows[0]
    assert best["fits"] and (best["sizes"]["fsdp"] > 1 or best["sizes"]["model"] > 1)
    assert all(link == "intra" for link in best["placement"].values())  # one node: NVLink only
    assert 0.2 < best["mfu"] < 0.7


def test_tensor_parallel_across_nodes_ranks_below_inside_a_node():
    """The placement rule: the same model=8 sync costs more over InfiniBand than over NVLink."""
    m7, hw = preset("7b"), hardware.get("h100")
    inside = estimate.evaluate(m7, {"data": 4, "model": 8}, hw, 32, 2048)
    across = estimate.evaluate(m7, {"data": 4, "model": 8}, hw, 32, 2048, dcn={"model": 4})
    assert inside["placement"]["model"] == "intra" and across["placement"]["model"] == "inter"
    assert across["t_step_s"] > inside["t_step_s"]


def test_big_searches_run_in_seconds():
    rows = search.search(preset("70b"), 4096, hardware.get("h100"), batch_size=2048, seq_len=4096)
    assert len(rows) > 50 and rows[0]["fits"]
    assert {r["sizes"]["model"] for r in rows} <= {
        1,
        2,
        4,
        8,
        16,
        32,
        64,
    }  # 64 heads, 8 kv heads allow model | 8
    assert all(r["sizes"]["model"] <= 8 for r in rows)
    rows = search.search(preset("default"), 8, hardware.get("cpu", 8), batch_size=16, seq_len=128)
    assert rows and all(r["fits"] for r in rows)


def test_evaluate_refuses_an_invalid_mesh_in_one_line():
    with pytest.raises(UserError, match=r"mesh model=8: model.n_heads=4|mesh model=8: .*heads"):
        estimate.evaluate(preset("tiny"), {"model": 8}, hardware.get("h100"), 16, 32)
    with pytest.raises(UserError, match="pipeline=3"):
        estimate.evaluate(preset("7b"), {"pipeline": 3}, hardware.get("h100"), 16, 32)


@pytest.fixture(scope="module")
def compiled():
    def get(mesh):
        cfg = build(
            {
                "model.preset": "tiny",
                "model.dtype": "float32",
                "parallelism.mesh": mesh,
                "train.batch_size": 16,
                "train.seq_len": 256,
            }
        )
        tr = Trainer(cfg)
        return tr, analyze(tr.setup)

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mesh,sizes", [("data=8", {"data": 8}), ("fsdp=8", {"fsdp": 8})])
def test_predicted_bytes_equal_compiled(compiled, mesh, sizes):
    tr, report = compiled(mesh)
    row = estimate.evaluate(
        preset("tiny"), sizes, hardware.get("cpu", 8), 16, 256, train_cfg=tr.cfg.train
    )
    assert row["theory"] == report["theory_detail"]  # the analytic search uses plan's own formulas
    for key, th in on_backend(row["theory"], "cpu", tr.setup.mesh.shape).items():
        kind, _, axes = key.partition("@")
        got = report["collectives_detail"][kind]["by_axes"][axes]["operand_bytes"]
        assert got == pytest.approx(th["operand_bytes"], rel=0.10), key  # and the compiler agrees
    assert row["memory"]["params"] == report["memory"]["params_bytes"]
    assert row["memory"]["optimizer"] == pytest.approx(
        report["memory"]["optimizer_bytes"], rel=1e-3
    )


def test_plan_cli_flags(capsys):
    """`plan --search N --hardware NAME` and `plan --devices N --hardware NAME`, without
    compiling."""
    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    cfg = build({"model.preset": "7b", "train.batch_size": 8, "train.seq_len": 4096})
    report, text = cli.analytic(
        parser.parse_args(["--search", "8", "--hardware", "h100", "--top", "3"]), cfg
    )
    assert report["top"][0]["mesh"] in text and len(report["top"]) == 3 and "Young/Daly" in text
    seeds70 = {
        "model.preset": "70b",
        "parallelism.mesh": "model=8,pipeline=4,data=32",
        "train.batch_size": 1024,
        "train.seq_len": 4096,
    }
    cfg70 = build({**seeds70, "pipeline.microbatches": 32})
    row, text = cli.analytic(parser.parse_args(["--devices", "1024", "--hardware", "h200"]), cfg70)
    assert row["mesh"] == "pipeline=4,data=32,model=8" and row["bubble"] == pytest.approx(3 / 35)
    assert "--pipeline.microbatches 32" in text and "pipeline bubble 8.6%" in text
    assert (
        row["placement"] == {"model": "intra", "data": "inter", "pipeline": "inter"} and row["fits"]
    )
    assert row["goodput"]["failures_per_day"] == pytest.approx(1.024)
    # gradient accumulation is not the pipeline's micro-batching: 32 passes of 32 rows, each
    # cut into M = 4 pipeline micro-batches of 8 rows, cannot split over data=32, and the
    # run would refuse it too
    with pytest.raises(
        UserError, match=r"micro-batch size 32/4 = 8 .* not divisible by the 32 batch shards"
    ):
        cli.analytic(
            parser.parse_args(["--devices", "1024", "--hardware", "h200"]),
            build({**seeds70, "train.micro_batches": 32}),
        )
    with pytest.raises(UserError, match="need --hardware NAME"):
        cli.analytic(parser.parse_args(["--search", "8"]), cfg)
    with pytest.raises(UserError, match="--hardware: unknown hardware 'tpu'"):
        cli.analytic(parser.parse_args(["--search", "8", "--hardware", "tpu"]), cfg)


@pytest.mark.parametrize("mesh", ["fsdp=2,expert=2,model=2", "data=2,fsdp=2,model=2"])
def test_analytic_theory_is_plans_theory_on_mixed_meshes(mesh):
    """The search's bytes for MoE tensor parallelism and DiLoCo come from plan's own theory."""
    over = {
        "model.preset": "moe-tiny",
        "model.dtype": "float32",
        "parallelism.mesh": mesh,
        "train.batch_size": 16,
        "train.seq_len": 64,
    }
    if mesh.startswith("data"):
        over["comm.sync_every"] = 4
    tr = Trainer(build(over))
    sizes = {a: tr.setup.mesh.shape[a] for a in tr.setup.mesh.axis_names}
    row = estimate.evaluate(
        tr.setup.model_cfg,
        sizes,
        hardware.get("cpu", 8),
        16,
        64,
        train_cfg=tr.cfg.train,
        comm_cfg=tr.cfg.comm,
    )
    assert row["theory"] == theory(run_spec(tr.setup), abstract_state(tr.setup).params)
    assert "all-reduce@model" in row["theory"] and row["comm"]["all-reduce@model"]["wire_bytes"] > 0
    if "sync_every" in over:
        assert row["theory"]["all-reduce@data"]["sync_every"] == 4
        assert row["comm"]["all-reduce@data"]["sync_every"] == 4


def test_sequence_parallelism_saves_activations_and_moves_the_same_bytes():
    """70B on fsdp=8,model=8,data=2 at 8k tokens: the residual stream's [D] terms split by model
    (full remat keeps only each layer's input, so most of the saved set), and the wire bytes are
    Megatron's: a reduce-scatter plus an all-gather per all-reduce."""
    m70, hw, sizes = preset("70b"), hardware.get("h100"), {"fsdp": 8, "model": 8, "data": 2}
    plain = estimate.evaluate(m70, sizes, hw, 16, 8192)
    sp = estimate.evaluate(m70, sizes, hw, 16, 8192, sequence_parallel=True)
    assert sp["sequence_parallel"] and not plain["sequence_parallel"]
    assert sp["memory"]["activations"] < plain["memory"]["activations"] / 4
    assert sp["t_comm_s"] == pytest.approx(plain["t_comm_s"])
    assert "--parallelism.sequence_parallel true" in run_flags(sp) and "sequence" not in run_flags(
        plain
    )


def test_context_axis_is_priced_as_a_token_axis():
    """context=4 at 1 x 32k tokens against fsdp=4 at 4 x 8k: the same tokens per device and the same
    weight sharding, so the same parameter memory and weight traffic; context adds the K/V
    all-gather and, while a layer runs, the other shards' K/V."""
    m7, hw = preset("7b"), hardware.get("h100")
    ctx = estimate.evaluate(m7, {"context": 4, "model": 2}, hw, 1, 32768)
    fsdp = estimate.evaluate(m7, {"fsdp": 4, "model": 2}, hw, 4, 8192)
    assert ctx["memory"]["params"] == pytest.approx(fsdp["memory"]["params"])
    assert (
        ctx["theory"]["all-gather@context"]["operand_bytes"]
        > fsdp["theory"]["all-gather@fsdp"]["operand_bytes"]
    )
    assert (
        fsdp["memory"]["activations"]
        < ctx["memory"]["activations"]
        < 2 * fsdp["memory"]["activations"]
    )


def test_search_prices_meshes_with_the_runs_experts_layout():
    """--parallelism.experts_over_fsdp reaches every mesh the search prices: an MoE run's
    fsdp=4,expert=2 row is evaluate()'s with that layout, and whole experts (on) move other bytes
    than experts sliced over fsdp (off)."""
    moe, hw = preset("moe-tiny"), hardware.get("h100")
    rows = {}
    for mode in ("on", "off"):
        found = search.search(moe, 8, hw, batch_size=16, seq_len=32, experts_over_fsdp=mode)
        rows[mode] = next(r for r in found if r["mesh"] == "fsdp=4,expert=2")
        want = estimate.evaluate(moe, {"fsdp": 4, "expert": 2}, hw, 16, 32, experts_over_fsdp=mode)
        assert rows[mode]["comm"] == want["comm"], mode
    assert rows["on"]["comm"] != rows["off"]["comm"]
