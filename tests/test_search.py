"""train/search.py: the mesh search enumerates only meshes a real run accepts, filters by memory,
ranks sensibly, and its predicted collective bytes are the ones `plan` compiles."""
import argparse
import math

import pytest

from mesh.errors import UserError
from models.config import preset
from train import hardware
from train import search as S
from train.config import build
from train.loop import Trainer
from train.plan import analyze, on_backend


def test_factorizations():
    f = S.factorizations(8)
    assert len(f) == 35 and len(set(f)) == 35  # 2^3 over 5 axes: C(3+4, 4)
    assert all(math.prod(x) == 8 and len(x) == 5 for x in f)
    assert len(S.factorizations(4096)) == math.comb(12 + 4, 4)


def test_every_mesh_found_is_accepted_by_a_real_run_and_the_rest_are_refused():
    """The search's divisibility logic is the trainer's: build a Trainer for every factorisation of 8."""
    tiny, hw = preset("tiny"), hardware.get("h100")
    found = {r["mesh"] for r in S.search(tiny, 8, hw, batch_size=16, seq_len=32)}
    assert found and "model=8" not in found  # 4 heads cannot split 8 ways
    for shape in S.factorizations(8):
        sizes = dict(zip(("pipeline", "data", "fsdp", "expert", "model"), shape))
        if sizes["pipeline"] > 1 or sizes["expert"] > 1:
            continue  # the layer stack is not split over stages yet; a dense model has no experts
        text = S.mesh_text(sizes)
        cfg = build({"model.preset": "tiny", "parallelism.mesh": text, "train.batch_size": 16, "train.seq_len": 32})
        try:
            Trainer(cfg)
            accepted = True
        except UserError:
            accepted = False
        assert accepted == (text in found), text


def test_70b_cannot_fit_on_8_devices_but_fits_sharded_on_512():
    m70 = preset("70b")
    for name in ("h100", "h200"):
        rows = S.search(m70, 8, hardware.get(name), batch_size=8, seq_len=4096)
        assert rows and not any(r["fits"] for r in rows)  # 70B x 16 bytes of state > 8 x 141 GB
    rows = S.search(m70, 512, hardware.get("h100"), batch_size=512, seq_len=4096)
    by_mesh = {r["mesh"]: r for r in rows}
    assert not by_mesh["data=512"]["fits"]  # a full replica per device
    assert by_mesh["data=512"]["memory"]["params"] == pytest.approx(4 * 70.55e9, rel=0.01)
    fit = [r for r in rows if r["fits"]]
    assert fit and all(r["memory"]["total"] <= 0.9 * hardware.get("h100").hbm_bytes for r in fit)
    assert [r["t_step_s"] for r in fit] == sorted(r["t_step_s"] for r in fit)


def test_7b_on_one_h100_node_prefers_sharding_over_pure_data_parallel():
    rows = S.search(preset("7b"), 8, hardware.get("h100"), batch_size=8, seq_len=4096)
    by_mesh = {r["mesh"]: r for r in rows}
    assert not by_mesh["data=8"]["fits"]  # 7B x (4 + 4 + 8) bytes = 108 GB > 80 GB
    best = rows[0]
    assert best["fits"] and (best["sizes"]["fsdp"] > 1 or best["sizes"]["model"] > 1)
    assert all(link == "intra" for link in best["placement"].values())  # one node: NVLink only
    assert 0.2 < best["mfu"] < 0.7


def test_tensor_parallel_across_nodes_ranks_below_inside_a_node():
    """MISSION.md's placement rule: the same model=8 sync costs more over InfiniBand than over NVLink."""
    m7, hw = preset("7b"), hardware.get("h100")
    inside = S.evaluate(m7, {"data": 4, "model": 8}, hw, 32, 2048)
    across = S.evaluate(m7, {"data": 4, "model": 8}, hw, 32, 2048, dcn={"model": 4})
    assert inside["placement"]["model"] == "intra" and across["placement"]["model"] == "inter"
    assert across["t_step_s"] > inside["t_step_s"]


def test_big_searches_run_in_seconds():
    rows = S.search(preset("70b"), 4096, hardware.get("h100"), batch_size=2048, seq_len=4096)
    assert len(rows) > 50 and rows[0]["fits"]
    assert {r["sizes"]["model"] for r in rows} <= {1, 2, 4, 8, 16, 32, 64}  # 64 heads, 8 kv heads allow model | 8
    assert all(r["sizes"]["model"] <= 8 for r in rows)
    rows = S.search(preset("default"), 8, hardware.get("cpu", 8), batch_size=16, seq_len=128)
    assert rows and all(r["fits"] for r in rows)


def test_evaluate_refuses_an_invalid_mesh_in_one_line():
    with pytest.raises(UserError, match=r"mesh model=8: model.n_heads=4|mesh model=8: .*heads"):
        S.evaluate(preset("tiny"), {"model": 8}, hardware.get("h100"), 16, 32)
    with pytest.raises(UserError, match="pipeline=3"):
        S.evaluate(preset("7b"), {"pipeline": 3}, hardware.get("h100"), 16, 32)


@pytest.fixture(scope="module")
def compiled():
    def get(mesh):
        cfg = build({"model.preset": "tiny", "model.dtype": "float32", "parallelism.mesh": mesh,
                     "train.batch_size": 16, "train.seq_len": 256})
        tr = Trainer(cfg)
        return tr, analyze(tr)
    return get


@pytest.mark.slow
@pytest.mark.parametrize("mesh,sizes", [("data=8", {"data": 8}), ("fsdp=8", {"fsdp": 8})])
def test_predicted_bytes_equal_compiled(compiled, mesh, sizes):
    tr, report = compiled(mesh)
    row = S.evaluate(preset("tiny"), sizes, hardware.get("cpu", 8), 16, 256, train_cfg=tr.cfg.train)
    assert row["theory"] == report["theory_detail"]  # the analytic search uses plan's own formulas
    for key, th in on_backend(row["theory"], "cpu", tr.mesh).items():
        kind, _, axes = key.partition("@")
        got = report["collectives_detail"][kind]["by_axes"][axes]["operand_bytes"]
        assert got == pytest.approx(th["operand_bytes"], rel=0.10), key  # and the compiler agrees
    assert row["memory"]["params"] == report["memory"]["params_bytes"]
    assert row["memory"]["optimizer"] == pytest.approx(report["memory"]["optimizer_bytes"], rel=1e-3)


def test_plan_cli_flags(capsys):
    """`plan --search N --hardware NAME` and `plan --devices N --hardware NAME`, without compiling."""
    parser = argparse.ArgumentParser()
    S.add_args(parser)
    cfg = build({"model.preset": "7b", "train.batch_size": 8, "train.seq_len": 4096})
    report, text = S.analytic(parser.parse_args(["--search", "8", "--hardware", "h100", "--top", "3"]), cfg)
    assert report["top"][0]["mesh"] in text and len(report["top"]) == 3 and "Young/Daly" in text
    cfg70 = build({"model.preset": "70b", "parallelism.mesh": "model=8,pipeline=4,data=32",
                   "train.batch_size": 1024, "train.seq_len": 4096, "train.micro_batches": 32})
    row, text = S.analytic(parser.parse_args(["--devices", "1024", "--hardware", "h200"]), cfg70)
    assert row["mesh"] == "pipeline=4,data=32,model=8" and row["bubble"] == pytest.approx(3 / 35)
    assert row["placement"] == {"model": "intra", "data": "inter", "pipeline": "inter"} and row["fits"]
    assert row["goodput"]["failures_per_day"] == pytest.approx(1.024)
    with pytest.raises(UserError, match="need --hardware NAME"):
        S.analytic(parser.parse_args(["--search", "8"]), cfg)
    with pytest.raises(UserError, match="--hardware: unknown hardware 'tpu'"):
        S.analytic(parser.parse_args(["--search", "8", "--hardware", "tpu"]), cfg)


@pytest.mark.parametrize("mesh", ["fsdp=2,expert=2,model=2", "data=2,fsdp=2,model=2"])
def test_analytic_theory_is_plans_theory_on_mixed_meshes(mesh):
    """The search's bytes for MoE tensor parallelism and DiLoCo come from plan's own theory."""
    from train.plan import theory
    over = {"model.preset": "moe-tiny", "model.dtype": "float32", "parallelism.mesh": mesh,
            "train.batch_size": 16, "train.seq_len": 64}
    if mesh.startswith("data"):
        over["comm.sync_every"] = 4
    tr = Trainer(build(over))
    sizes = {a: tr.mesh.shape[a] for a in tr.mesh.axis_names}
    row = S.evaluate(tr.model_cfg, sizes, hardware.get("cpu", 8), 16, 64, train_cfg=tr.cfg.train,
                     comm_cfg=tr.cfg.comm)
    assert row["theory"] == theory(tr, tr.abstract_state())
    assert "all-reduce@model" in row["theory"] and row["comm"]["all-reduce@model"]["wire_bytes"] > 0
    if "sync_every" in over:
        assert row["theory"]["all-reduce@data"]["sync_every"] == 4
        assert row["comm"]["all-reduce@data"]["sync_every"] == 4
