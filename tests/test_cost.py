"""plan/cost.py and plan/hardware.py: the cost model's arithmetic on hand-computed examples, and the
mesh layout deciding NVLink vs InfiniBand."""

import dataclasses
import math

import pytest

from errors import UserError
from models.presets import preset
from plan import cost, hardware
from plan.hardware import Hardware

# A made-up machine with round numbers, so every expected value below is done by hand.
TOY = Hardware(
    "toy",
    {"bfloat16": 100.0, "float32": 50.0},
    hbm_bytes=80e9,
    hbm_bw=1e12,
    intra_bw=100e9,
    inter_bw=10e9,
    devices_per_node=4,
    intra_latency_s=0.0,
    inter_latency_s=0.0,
    compute_efficiency=0.5,
    link_efficiency=1.0,
    host_bw=1e9,
    ckpt_write_bw=1e8,
)


def sizes(**kw):
    return {a: kw.get(a, 1) for a in ("pipeline", "data", "fsdp", "expert", "model")}


def test_layout_decides_intra_vs_inter_node():
    h100 = hardware.get("h100")
    # a 70B layout: tensor parallel inside the 8-GPU node, pipeline and data across nodes
    assert cost.placement(sizes(model=8, pipeline=4, data=32), h100) == {
        "model": "intra",
        "data": "inter",
        "pipeline": "inter",
    }
    # fsdp=4 outside model=4 spans 16 devices: two nodes
    assert cost.placement(sizes(fsdp=4, model=4), h100) == {"model": "intra", "fsdp": "inter"}
    assert cost.placement(sizes(data=2, fsdp=4), h100) == {"fsdp": "intra", "data": "intra"}
    # --mesh-dcn says explicitly which axes cross hosts, whatever their order
    assert cost.placement(sizes(fsdp=8, data=4), h100, dcn={"data": 4}) == {
        "data": "inter",
        "fsdp": "intra",
    }
    assert cost.placement(sizes(fsdp=32), h100, dcn={"fsdp": 4}) == {"fsdp": "inter"}


def test_comm_time_ring_arithmetic():
    where = cost.placement(sizes(data=2, model=4), TOY)
    assert where == {"model": "intra", "data": "inter"}
    t, link = cost.comm_time("all-reduce", ("data",), 10e9, 0, sizes(data=2, model=4), where, TOY)
    assert (t, link) == (pytest.approx(1.0), "inter")  # 10 GB at 10 GB/s
    t, link = cost.comm_time("all-gather", ("model",), 50e9, 0, sizes(data=2, model=4), where, TOY)
    assert (t, link) == (pytest.approx(0.5), "intra")
    # latency: count x ring steps x per-step latency (all-reduce on 4 devices: 2(n-1) = 6 steps)
    lat = dataclasses.replace(TOY, intra_latency_s=1e-3)
    t, _ = cost.comm_time("all-reduce", ("model",), 0.0, 10, sizes(data=2, model=4), where, lat)
    assert t == pytest.approx(10 * 6 * 1e-3)


def test_7b_gradient_all_reduce_over_200gbps_takes_over_a_second():
    """7B fp16 gradients (M = 14 GB) all-reduced over 200 Gb/s (25 GB/s) take over a second."""
    a100 = hardware.get("a100")
    n = 64
    wire = 2 * (n - 1) / n * 14e9  # ring all-reduce: each device sends ~2M
    s = sizes(data=n)
    t, link = cost.comm_time("all-reduce", ("data",), wire, 0, s, cost.placement(s, a100), a100)
    assert link == "inter" and t == pytest.approx(wire / (25e9 * a100.link_efficiency)) and t > 1.0


def test_predict_step_time_with_and_without_overlap():
    comm = {
        "all-reduce@data": {"wire_bytes": 10e9},  # gradients: inter-node, overlappable, 1 s
        "all-reduce@model": {"wire_bytes": 50e9},
    }  # tensor-parallel activations: intra, exposed, 0.5 s
    p = cost.predict(
        model_flops=6e14,
        device_flops=1e14,
        comm=comm,
        sizes=sizes(data=2, model=4),
        hw=TOY,
        dtype="bfloat16",
        tokens_per_step=8000,
    )
    assert p["t_compute_s"] == pytest.approx(2.0)  # 1e14 / (100 TFLOP/s x 0.5)
    assert (
        p["comm"]["all-reduce@data"]["overlappable"]
        and not p["comm"]["all-reduce@model"]["overlappable"]
    )
    assert p["t_step_serial_s"] == pytest.approx(3.5)
    assert p["t_step_overlap_s"] == pytest.approx(2.5)  # max(2, 1) + 0.5
    assert p["t_step_s"] == p["t_step_overlap_s"]
    assert p["mfu"] == pytest.approx(6e14 / (8 * 100e12 * 2.5))
    assert p["mfu_serial"] == pytest.approx(6e14 / (8 * 100e12 * 3.5))
    assert p["tokens_per_s_per_device"] == pytest.approx(8000 / 2.5 / 8)
    # a backend without async collectives (XLA:CPU) pays the sum
    serial = cost.predict(
        model_flops=6e14,
        device_flops=1e14,
        comm=comm,
        sizes=sizes(data=2, model=4),
        hw=dataclasses.replace(TOY, overlap=False),
        dtype="bfloat16",
    )
    assert serial["t_step_s"] == pytest.approx(3.5)


def test_pipeline_bubble():
    """The bubble comes from the pipeline's own micro-batch count M and repeats R,
    (P-1)/(R M + P-1)."""
    kw = dict(
        model_flops=1.0,
        device_flops=1e14,
        comm={},
        sizes=sizes(pipeline=4, data=2),
        hw=TOY,
        dtype="bfloat16",
    )
    p = cost.predict(pipeline_microbatches=12, **kw)
    assert p["bubble"] == pytest.approx(3 / 15)  # (P-1)/(M+P-1)
    assert p["t_compute_with_bubble_s"] == pytest.approx(2.0 / (1 - 0.2))
    assert cost.predict(pipeline_microbatches=12, repeats=2, **kw)["bubble"] == pytest.approx(
        3 / 27
    )  # circular
    assert cost.predict(**kw)["bubble"] == pytest.approx(
        3 / 7
    )  # unset: as many micro-batches as stages
    # 2 passes of gradient accumulation, each a 3-tick pipeline (M=2, P=2) of [b=1, T=32, D=64]
    # float32 micro-batches (16 rows / 2 passes / M=2 / 4 batch shards), one send each way per tick
    pc = cost.pipeline_comm(
        preset("tiny"),
        sizes(pipeline=2, data=4),
        batch_size=16,
        seq_len=32,
        micro_batches=2,
        act_bytes=4,
        pipeline_microbatches=2,
        batch_shards=4,
    )
    msg = 16 // 2 // 2 // 4 * 32 * 64 * 4
    assert pc == {
        "collective-permute@pipeline": {
            "operand_bytes": 2 * 2 * 3 * msg,
            "wire_bytes": 2 * 2 * 3 * msg,
            "count": 2 * 2 * 3,
        }
    }


def test_accelerators_use_the_ragged_all_to_all_bytes():
    fixed = {
        "all-to-all@expert": {"operand_bytes": 800.0, "wire_bytes": 700.0, "ideal_bytes": 200.0},
        "all-reduce@data": {"operand_bytes": 10.0, "wire_bytes": 15.0},
    }
    assert (
        cost.ragged_all_to_all(fixed, "cpu") == fixed
    )  # XLA:CPU has no ragged all-to-all: fixed buffers
    gpu = cost.ragged_all_to_all(fixed, "gpu")
    assert (
        gpu["all-to-all@expert"]["wire_bytes"] == 175.0
        and gpu["all-reduce@data"] == fixed["all-reduce@data"]
    )
    assert fixed["all-to-all@expert"]["wire_bytes"] == 700.0  # the input is not modified


def test_hardware_flops_count_remat_recompute():
    tiny = preset("tiny")  # 115,200 matmul params of which the LM head is 264 x 64
    tokens, t = 16 * 256, 256
    model = cost.model_flops_per_step(tiny, 16, t)
    assert model == (6 * 115200 + 12 * 2 * 4 * 16 * t) * tokens
    blocks_fwd = 2 * (115200 - 264 * 64)
    attn_fwd = 4 * 2 * 4 * 16 * t
    assert (
        cost.hardware_flops_per_step(tiny, 16, t) == model + (blocks_fwd + attn_fwd) * tokens
    )  # full remat
    assert (
        cost.hardware_flops_per_step(dataclasses.replace(tiny, remat="dots"), 16, t)
        == model + attn_fwd * tokens
    )
    assert cost.hardware_flops_per_step(dataclasses.replace(tiny, remat="none"), 16, t) == model


def test_goodput_hand_computed():
    # 1 s steps, 1 GB of state per device, save every 100 steps, 10,000 devices at 0.1%/day
    g = cost.goodput(
        1.0,
        1e9,
        10_000,
        TOY,
        ckpt_every=100,
        async_save=True,
        fail_rate=0.001,
        restart_s=300.0,
        steps=10_000,
    )
    assert g["failures_per_day"] == pytest.approx(
        10.0
    )  # 0.1%/day on 10,000 devices: 10 failures a day
    assert g["mtbf_s"] == pytest.approx(8640.0)
    c = g["checkpoint"]
    assert c["t_save_s"] == pytest.approx(
        1.0
    )  # async: the 1 GB device-to-host copy; the 10 s write hides in 100 s
    assert c["t_recover_s"] == pytest.approx(
        300 + 10 + 50
    )  # restart + read back + half an interval lost
    assert c["goodput"] == pytest.approx((1 - 360 / 8640) / (1 + 1 / 100))
    assert g["young_daly"]["interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * 8640))
    r = g["run"]  # T_total = T_train + N_ckpt T_save + N_fail T_recover
    assert r["t_total_s"] == pytest.approx(
        r["t_train_s"] + r["n_ckpt"] * c["t_save_s"] + r["n_fail"] * c["t_recover_s"]
    )
    # a synchronous save blocks for the whole write; an interval shorter than the write blocks too
    assert cost.goodput(1.0, 1e9, 1, TOY, ckpt_every=100, async_save=False)["checkpoint"][
        "t_save_s"
    ] == pytest.approx(10.0)
    assert cost.goodput(1.0, 1e9, 1, TOY, ckpt_every=4)["checkpoint"]["t_save_s"] == pytest.approx(
        1.0 + 6.0
    )
    # more devices, more failures, less goodput
    assert (
        cost.goodput(1.0, 1e9, 100_000, TOY, ckpt_every=100)["checkpoint"]["goodput"] < c["goodput"]
    )


def test_hardware_profiles_and_errors():
    h100, h200 = hardware.get("H100-SXM"), hardware.get("h200")
    assert (
        h100.peak_flops("bfloat16") == 989e12 and h100.intra_bw == 450e9 and h100.inter_bw == 50e9
    )
    assert h200.hbm_bytes > h100.hbm_bytes and h200.devices_per_node == 8
    assert hardware.get("tpu-v5p").peak_flops("bfloat16") == 459e12
    cpu = hardware.get("cpu", 8)
    assert cpu.peak_flops("float32") > 0 and cpu.devices_per_node == 8 and not cpu.overlap
    with pytest.raises(
        UserError,
        match=r"--hardware: unknown hardware 'b200'; valid: h100, h200, a100, tpu-v5p, cpu",
    ):
        hardware.get("b200")


def test_roofline_memory_term():
    """T_compute = max(T_flops, T_memory) where memory traffic hides under math, the sum where
    not."""
    kw = dict(model_flops=1.0, device_flops=1e14, comm={}, sizes=sizes(data=2), dtype="bfloat16")
    p = cost.predict(hw=TOY, device_bytes=4e12, **kw)
    assert p["t_flops_s"] == pytest.approx(2.0)  # 1e14 / (100 TFLOP/s x 0.5)
    assert p["t_memory_s"] == pytest.approx(5.0)  # 4 TB / (1 TB/s x 0.8)
    assert p["t_compute_s"] == pytest.approx(5.0) and p["t_step_s"] == pytest.approx(5.0)
    serial = cost.predict(
        hw=dataclasses.replace(TOY, memory_overlap=False), device_bytes=4e12, **kw
    )
    assert serial["t_compute_s"] == pytest.approx(7.0)
    assert cost.predict(hw=TOY, **kw)["t_compute_s"] == pytest.approx(
        2.0
    )  # no bytes known: FLOPs only
    cpu = hardware.get("cpu", 8)
    assert cpu.hbm_bw > 0 and not cpu.memory_overlap and cpu.memory_efficiency == 1.0
