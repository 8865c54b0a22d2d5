"""Host offloading. Activations: `--model.remat dots_offload` (the projections' outputs that `dots`
saves, kept in pinned host memory between the forward and the backward pass; models/pieces.py
REMAT). Optimizer state: `--train.offload_optimizer true` (the state lives in pinned host memory
between steps; the step brings it to the device for the update and back; train/core/setup.py).

On CPU the device memory is the host's: XLA:CPU compiles the remat policy to the same program as
`dots` (no host copies), so what is tested there is that the run accepts it and computes the same
gradient, that devices without a host memory kind refuse it in one line, and `plan`'s accounting:
device and host bytes apart, and the copies priced on the host link. The optimizer state really is
placed in `pinned_host` arrays on CPU: the run equals the same run without offloading step by step,
and its checkpoint restores into host memory."""

import dataclasses
import types

import jax
import numpy as np
import pytest
from equivalence import (
    assert_runs_match,
    assert_trees_close,
    gradients,
    initial_params,
    make_trainer,
    run_steps,
    synthetic_batches,
)

from checkpoint.layout import make_meta
from checkpoint.manager import Checkpointer
from errors import UserError
from models.config import PipelineConfig
from models.presets import preset
from plan import cost, estimate, hardware, search
from train.core.config import build
from train.core.memory import check_host_offload
from train.core.setup import abstract_state
from train.run import resume


def test_offload_runs_and_equals_dots_on_cpu(tmp_path):
    """The train step's gradient with dots_offload equals dots' on fsdp=4,model=2 (float32)."""
    got = {}
    for remat in ("dots", "dots_offload"):
        tr = make_trainer(
            "fsdp=4,model=2", tmp_path / remat, **{"model.preset": "tiny", "model.remat": remat}
        )
        params = initial_params(tr)
        got[remat] = gradients(tr, params, synthetic_batches(264, 1)[0])
    np.testing.assert_allclose(got["dots_offload"][0], got["dots"][0], rtol=1e-6)
    assert_trees_close(got["dots_offload"][1], got["dots"][1], "dots_offload gradient")


def test_devices_without_host_memory_refuse_it():
    device = types.SimpleNamespace(
        platform="tpu", addressable_memories=lambda: [types.SimpleNamespace(kind="device")]
    )
    with pytest.raises(UserError) as e:
        check_host_offload(
            build({"model.remat": "dots_offload", "train.offload_optimizer": True}), [device]
        )
    assert str(e.value) == (
        "--model.remat dots_offload and --train.offload_optimizer true keeps arrays in"
        " 'pinned_host' memory, which these tpu devices do not have (theirs: device); valid"
        " here: --model.remat none|full|dots, --train.offload_optimizer false"
    )
    check_host_offload(build({"model.remat": "dots"}), [device])  # nothing to offload
    # the CPU backend has pinned_host
    check_host_offload(build({"model.remat": "dots_offload"}), jax.devices()[:1])
    with pytest.raises(
        UserError, match="--train.offload_optimizer true: not with --comm.sync_every 4 .DiLoCo."
    ):
        check_host_offload(
            build({"train.offload_optimizer": True, "comm.sync_every": 4}), jax.devices()[:1]
        )


@pytest.fixture(scope="module")
def optimizer_runs(tmp_path_factory):
    """The same 5 steps on fsdp=4,model=2 with the optimizer state on the device and in host
    memory."""
    out = {}
    for offload in (False, True):
        tr = make_trainer(
            "fsdp=4,model=2",
            tmp_path_factory.mktemp(f"offload{offload}"),
            **{"model.preset": "tiny", "train.offload_optimizer": offload},
        )
        params0 = initial_params(tr) if not out else out[False][2]
        out[offload] = (tr, run_steps(tr, synthetic_batches(264), params0), params0)
    return out


@pytest.mark.slow
def test_optimizer_in_host_memory_trains_the_same(optimizer_runs):
    (_, want, _), (_, got, _) = optimizer_runs[False], optimizer_runs[True]
    assert_runs_match(got, want, "offload_optimizer")
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves(got["state"].opt_state)}
    assert kinds == {"pinned_host"}, kinds
    assert {a.sharding.memory_kind for a in jax.tree.leaves(got["state"].params)} == {"device"}


@pytest.mark.slow
def test_optimizer_in_host_memory_restores_into_host_memory(optimizer_runs, tmp_path):
    tr, got, _ = optimizer_runs[True]
    state = got["state"]
    saver = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    saver.save(5, state, make_meta(5, tr.cfg.to_dict(), tr.setup.mesh, seed=0))
    restored, _ = resume.restore(tr.setup, abstract_state(tr.setup), saver, 5)
    saver.close()
    for a, b in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state)):
        assert a.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_plan_counts_host_and_device_bytes_apart(schedule):
    """7B on pipeline=2,fsdp=4 (H100): dots_offload moves dots' saved set to the host (the pipeline
    ring of 1F1B stays on the device), leaves the rest of device memory as it is, and adds the
    copies out and back as an overlappable host-link row priced at hw.host_bw."""
    cfg, hw = preset("7b"), hardware.get("h100")
    rows = {}
    for remat in ("dots", "dots_offload"):
        rows[remat] = estimate.evaluate(
            dataclasses.replace(cfg, remat=remat),
            {"pipeline": 2, "fsdp": 4},
            hw,
            32,
            4096,
            pipeline_cfg=PipelineConfig(microbatches=8, schedule=schedule),
        )
    dots, off = rows["dots"]["memory"], rows["dots_offload"]["memory"]
    assert dots["host_activations"] == 0 and off["host_activations"] > 0
    assert off["activations"] + off["host_activations"] == pytest.approx(dots["activations"])
    assert off["total"] == pytest.approx(dots["total"] - off["host_activations"])
    row = rows["dots_offload"]["comm"][cost.HOST_OFFLOAD]
    assert row["wire_bytes"] == pytest.approx(2 * off["host_activations"]) and row["overlappable"]
    assert row["time_s"] == pytest.approx(row["wire_bytes"] / hw.host_bw) and row["link"] == "host"
    assert cost.HOST_OFFLOAD not in rows["dots"]["comm"]


def test_plan_counts_the_optimizer_state_in_host_memory():
    """--train.offload_optimizer: the state's bytes move from the device total to the host line; the
    device keeps about one parameter's state (the update streams it leaf by leaf); the copies in
    and out are a host-link row."""
    cfg, hw = preset("7b"), hardware.get("h100")
    rows = {
        off: estimate.evaluate(
            cfg, {"fsdp": 8}, hw, 8, 4096, train_cfg=build({"train.offload_optimizer": off}).train
        )
        for off in (False, True)
    }
    on, off = rows[False]["memory"], rows[True]["memory"]
    assert off["host_optimizer"] == pytest.approx(on["optimizer"]) and on["host_optimizer"] == 0
    # the largest of 12 leaves (a stacked [L, ...] one)
    assert 0 < off["optimizer"] < on["optimizer"] / 4
    assert off["total"] == pytest.approx(on["total"] - on["optimizer"] + off["optimizer"])
    assert rows[True]["comm"][cost.HOST_OFFLOAD]["wire_bytes"] == pytest.approx(
        2 * off["host_optimizer"]
    )


def test_search_offloads_only_a_mesh_that_does_not_fit():
    """7B on one H100: its state (~100 GiB) does not fit in 80 GB; the search offers the layout with
    the optimizer state in host memory, and says so in its flags. On 8 H100s sharding fits
    without."""
    from plan.render import run_flags

    hw = hardware.get("h100")
    (row,) = search.search(preset("7b"), 1, hw, batch_size=1, seq_len=4096)
    assert row["fits"] and row["offload"] == {"--train.offload_optimizer": "true"}
    assert (
        run_flags(row).endswith("--train.offload_optimizer true")
        and row["memory"]["host_optimizer"] > 40 * 2**30
    )
    assert cost.HOST_OFFLOAD in row["comm"]
    best = search.search(preset("7b"), 8, hw, batch_size=8, seq_len=4096)[0]
    assert best["fits"] and "offload" not in best
