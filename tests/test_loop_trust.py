"""The loop never writes what a reader cannot trust: no checkpoint of a non-finite state, no NaN
in metrics.jsonl, a resume that names every changed model setting and converts per-replica
state onto another data-parallel size, a memory check before anything is allocated, and MFU
over the mesh's own devices."""

import json
import math

import jax
import numpy as np
import pytest

from errors import UserError
from mesh.devices import peak_flops
from train.core.config import build
from train.core.setup import abstract_state
from train.run import loop, resume
from train.run.loop import Trainer
from train.run.resilience import Diverged
from train.run.startup import open_checkpoints

BASE = {
    "model.preset": "tiny",
    "model.dtype": "float32",
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.warmup_steps": 0,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.log_every": 1,
    "logging.progress": False,
    "logging.tensorboard": False,
    "checkpoint.every": 2,
}


def trainer(run_dir, devices=None, **over) -> Trainer:
    return Trainer(build({**BASE, "logging.run_dir": str(run_dir), **over}), devices=devices)


def strict_records(run_dir) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (NaN/Infinity are not JSON)."""

    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(ln, parse_constant=refuse) for ln in f]


def test_a_non_finite_state_is_never_committed_and_metrics_stay_json(tmp_path):
    # lr 1e39 is inf in float32: the first update makes the parameters non-finite
    tr = trainer(tmp_path, **{"train.steps": 3, "train.lr": 1e39, "checkpoint.every": 0})
    with pytest.raises(
        Diverged, match=r"step 3: the parameters or optimizer state are not finite .* no checkpoint"
    ):
        tr.fit()
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    recs = strict_records(tmp_path)
    diverged = [r for r in recs if r.get("loss", 0.0) is None]
    assert diverged and all("loss" in r["nonfinite"] for r in diverged), recs


def test_a_non_finite_loss_with_finite_gradients_is_divergence(tmp_path):
    """A custom loss that is NaN while its gradient is finite (zero): every update is skipped as
    non-finite, and --train.max_bad_steps of them with no checkpoint is Diverged (exit status 3),
    not a run that ends with `loss nan` and exit status 0."""
    import jax.numpy as jnp

    def nan_loss(logits_BTV, batch):
        return 0.0 * logits_BTV[..., 0] + jnp.float32(jnp.nan)

    tr = Trainer(
        build(
            {
                **BASE,
                "logging.run_dir": str(tmp_path),
                "train.steps": 4,
                "train.max_bad_steps": 2,
                "checkpoint.every": 0,
            }
        ),
        loss=nan_loss,
    )
    with pytest.raises(Diverged, match="2 skipped steps in a row .* at step 2 and no checkpoint"):
        tr.fit()
    assert [(r["step"], r["skipped_steps"]) for r in strict_records(tmp_path)] == [(1, 1), (2, 2)]


def test_resume_tolerates_a_damaged_metrics_log_and_names_changed_model_settings(tmp_path, capsys):
    trainer(tmp_path, **{"train.steps": 2}).fit()
    with open(tmp_path / "metrics.jsonl", "a") as f:  # lines a kill or an editor left behind
        f.write('[]\n{"step": "x"}\n5\nnot json\n{"step": 1, "loss": 1.0')
    out = trainer(
        tmp_path, **{"train.steps": 4, "model.rope_theta": 500.0, "model.init_std": 0.01}
    ).fit()
    assert out["steps"] == 4
    text = capsys.readouterr().out
    assert "model.rope_theta 10000.0 -> 500.0" in text and "model.init_std 0.02 -> 0.01" in text, (
        text
    )
    assert [r["step"] for r in strict_records(tmp_path) if "loss" in r] == [1, 2, 3, 4]


def test_error_feedback_residuals_are_averaged_onto_another_data_parallel_size(tmp_path, capsys):
    comm = {"comm.compression": "int8", "train.steps": 2}
    first = trainer(tmp_path, jax.devices()[:4], **{"parallelism.mesh": "data=4", **comm})
    first.fit()
    saved = jax.tree.map(np.asarray, first.state.residual)
    second = trainer(
        tmp_path, jax.devices()[:2], **{"parallelism.mesh": "data=2", **comm, "train.steps": 3}
    )
    abstract = abstract_state(second.setup)
    point = resume.resume_point(second.setup, abstract, open_checkpoints(second.cfg))
    state, meta = resume.restore(second.setup, abstract, point.src, point.step)
    assert "averaged onto this mesh's 2" in meta["converted"]
    for r_old, r_new in zip(jax.tree.leaves(saved), jax.tree.leaves(state.residual)):
        np.testing.assert_allclose(
            np.asarray(r_new), np.broadcast_to(r_old.mean(0), r_new.shape), rtol=1e-6
        )
    assert second.fit()["steps"] == 3


def test_diloco_state_onto_another_data_parallel_size_is_refused_naming_why(tmp_path):
    diloco = {"comm.sync_every": 2, "train.steps": 2}
    trainer(tmp_path, jax.devices()[:4], **{"parallelism.mesh": "data=4", **diloco}).fit()
    second = trainer(
        tmp_path, jax.devices()[:2], **{"parallelism.mesh": "data=2", **diloco, "train.steps": 4}
    )
    with pytest.raises(
        UserError, match="4 data-parallel replicas.* does not convert to this mesh's 2"
    ):
        second.fit()


def test_a_step_too_large_for_the_machine_is_refused_before_allocating(tmp_path, monkeypatch):
    import train.core.memory

    monkeypatch.setattr(train.core.memory, "_host_available", lambda: 64 * 1024)
    tr = trainer(tmp_path, **{"train.steps": 1})
    with (
        monkeypatch.context() as m,
        pytest.raises(
            UserError,
            match=r"the step needs ~[\d.]+ MiB per device .*--mesh fsdp=N.*skip_memory_check",
        ),
    ):
        m.setattr(loop, "create_state", lambda s: pytest.fail("allocated before the memory check"))
        tr.fit()
    assert (
        trainer(tmp_path / "b", **{"train.steps": 1, "train.skip_memory_check": True}).fit()[
            "steps"
        ]
        == 1
    )


def test_mfu_peak_counts_the_mesh_devices_only():
    peak, text = peak_flops("float32", 1.0, jax.devices()[:2])
    assert math.isclose(peak, 2e12) and "x 2" in text
    assert math.isclose(peak_flops("float32", 1.0)[0], 1e12 * len(jax.devices()))
