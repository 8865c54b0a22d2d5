"""Activation offloading (`--model.remat dots_offload`: the projections' outputs that `dots` saves,
kept in pinned host memory between the forward and the backward pass; models/transformer.py REMAT).

On CPU the device memory is the host's: XLA:CPU compiles the policy to the same program as `dots`
(no host copies), so what is tested here is that the run accepts it and computes the same
gradient, that devices without a host memory kind refuse it in one line, and `plan`'s accounting:
device and host bytes apart, and the copies priced on the host link."""
import dataclasses
import types

import jax
import numpy as np
import pytest

from equivalence import assert_trees_close, gradients, initial_params, make_trainer, synthetic_batches
from errors import UserError
from models.config import PipelineConfig, preset
from plan import cost, hardware, search
from train.memory import check_host_offload


def test_offload_runs_and_equals_dots_on_cpu(tmp_path):
    """The train step's gradient with dots_offload equals dots' on fsdp=4,model=2 (float32)."""
    got = {}
    for remat in ("dots", "dots_offload"):
        tr = make_trainer("fsdp=4,model=2", tmp_path / remat, **{"model.preset": "tiny", "model.remat": remat})
        params = initial_params(tr)
        got[remat] = gradients(tr, params, synthetic_batches(264, 1)[0])
    np.testing.assert_allclose(got["dots_offload"][0], got["dots"][0], rtol=1e-6)
    assert_trees_close(got["dots_offload"][1], got["dots"][1], "dots_offload gradient")


def test_devices_without_host_memory_refuse_it():
    device = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    with pytest.raises(UserError) as e:
        check_host_offload("dots_offload", [device])
    assert str(e.value) == ("--model.remat dots_offload keeps saved activations in 'pinned_host' memory, which these"
                            " tpu devices do not have (theirs: device); valid here: none, full, dots")
    check_host_offload("dots", [device])  # nothing to offload
    check_host_offload("dots_offload", jax.devices()[:1])  # the CPU backend has pinned_host


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_plan_counts_host_and_device_bytes_apart(schedule):
    """7B on pipeline=2,fsdp=4 (H100): dots_offload moves dots' saved set to the host (the pipeline
    ring of 1F1B stays on the device), leaves the rest of device memory as it is, and adds the
    copies out and back as an overlappable host-link row priced at hw.host_bw."""
    cfg, hw = preset("7b"), hardware.get("h100")
    rows = {}
    for remat in ("dots", "dots_offload"):
        rows[remat] = search.evaluate(dataclasses.replace(cfg, remat=remat), {"pipeline": 2, "fsdp": 4}, hw, 32, 4096,
                                      pipeline_cfg=PipelineConfig(microbatches=8, schedule=schedule))
    dots, off = rows["dots"]["memory"], rows["dots_offload"]["memory"]
    assert dots["host_activations"] == 0 and off["host_activations"] > 0
    assert off["activations"] + off["host_activations"] == pytest.approx(dots["activations"])
    assert off["total"] == pytest.approx(dots["total"] - off["host_activations"])
    row = rows["dots_offload"]["comm"][cost.HOST_OFFLOAD]
    assert row["wire_bytes"] == pytest.approx(2 * off["host_activations"]) and row["overlappable"]
    assert row["time_s"] == pytest.approx(row["wire_bytes"] / hw.host_bw) and row["link"] == "host"
    assert cost.HOST_OFFLOAD not in rows["dots"]["comm"]

