"""--train.spike_factor: a step whose loss exceeds the factor times the running median of the
recent losses is skipped (parameters and optimizer untouched, the data moves on), counted, and
after --train.max_bad_steps skips in a row the run goes back to its last checkpoint; the window
lives in the train state, so a checkpoint carries it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from errors import UserError
from train.core.config import build
from train.core.setup import abstract_batch, abstract_state, compile_step, create_state
from train.core.state import LOSS_WINDOW, SPIKE_WARMUP, LossWindow
from train.run import resume
from train.run.loop import Trainer
from train.run.startup import open_checkpoints

BASE = {
    "model.preset": "tiny",
    "model.dtype": "float32",
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.lr": 1e-2,
    "train.warmup_steps": 0,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.log_every": 1,
    "logging.progress": False,
    "logging.tensorboard": False,
    "train.spike_factor": 1.1,
}


def empty_window(factor=2.0) -> LossWindow:
    zero = jnp.zeros((), jnp.int32)
    return LossWindow(
        losses=jnp.zeros(LOSS_WINDOW, jnp.float32),
        seen=zero,
        in_a_row=zero,
        skipped=zero,
        factor=factor,
    )


def test_window_median_warm_up_and_counts():
    w, losses = empty_window(), np.linspace(5.0, 1.0, 40).astype(np.float32)
    for i, loss in enumerate(losses):
        # nothing is judged while warming up
        assert not bool(w.is_spike(jnp.float32(1e9))) or i >= SPIKE_WARMUP
        w = w.after(jnp.float32(loss), applied=jnp.bool_(True), spiked=jnp.bool_(False))
        held = losses[max(0, i + 1 - LOSS_WINDOW) : i + 1]  # the ring holds the last LOSS_WINDOW
        assert float(w.median()) == pytest.approx(float(np.median(held)), rel=1e-6)
    median = float(w.median())
    assert bool(w.is_spike(jnp.float32(2.01 * median))) and not bool(
        w.is_spike(jnp.float32(1.99 * median))
    )
    # a spike is counted, not pushed; a non-finite step (neither applied nor a
    # spike) changes nothing
    spiked = w.after(jnp.float32(50.0), applied=jnp.bool_(False), spiked=jnp.bool_(True))
    assert (int(spiked.in_a_row), int(spiked.skipped), float(spiked.median())) == (1, 1, median)
    nan = spiked.after(jnp.float32(jnp.nan), applied=jnp.bool_(False), spiked=jnp.bool_(False))
    assert (int(nan.in_a_row), int(nan.skipped), int(nan.seen)) == (1, 1, 40)
    applied = nan.after(jnp.float32(1.0), applied=jnp.bool_(True), spiked=jnp.bool_(False))
    assert (int(applied.in_a_row), int(applied.skipped)) == (0, 1)


def test_spike_factor_below_one_or_with_diloco_is_one_line():
    with pytest.raises(UserError, match=r"--train.spike_factor 0.5: must be 0 \(off\) or >= 1"):
        build({"train.spike_factor": 0.5})
    with pytest.raises(UserError, match=r"--train.spike_factor 2.0: not with --comm.sync_every 2"):
        Trainer(
            build(
                {
                    **BASE,
                    "train.spike_factor": 2.0,
                    "comm.sync_every": 2,
                    "parallelism.mesh": "data=8",
                }
            )
        )


def _batch(tr: Trainer, rng, corrupt=False) -> dict:
    """Tokens from a 16-id alphabet (learnt within a few steps); `corrupt`: every target the last
    id."""
    tokens = rng.integers(0, 16, size=(8, 33)).astype(np.int32)
    targets = (
        np.full((8, 32), tr.setup.model_cfg.vocab_size - 1, np.int32) if corrupt else tokens[:, 1:]
    )
    host = {"inputs": tokens[:, :-1], "targets": targets, "weights": np.ones((8, 32), np.float32)}
    return jax.device_put(host, tr.setup.batch_sharding)


def test_a_spike_is_skipped_and_the_run_then_matches_one_without_the_bad_batch(tmp_path):
    # the loop test's step
    tr = Trainer(build({**BASE, "train.steps": 16, "logging.run_dir": str(tmp_path)}))
    step_fn, rng = (
        compile_step(tr.setup, abstract_state(tr.setup), abstract_batch(tr.setup)),
        np.random.default_rng(0),
    )
    state = create_state(tr.setup)
    for _ in range(SPIKE_WARMUP + 2):
        state, m = step_fn(state, _batch(tr, rng))
    before = jax.device_get(state)  # the state is donated to the next step: keep a copy
    spiked, m = step_fn(state, _batch(tr, rng, corrupt=True))
    assert float(m["loss"]) > 1.1 * float(m["loss_running_median"]), m
    assert (int(m["spike_skipped_steps"]), int(m["spike_in_a_row"]), float(m["lr"])) == (1, 1, 0.0)
    assert int(m["skipped_steps"]) == 0  # not a non-finite step
    after = jax.device_get(spiked)
    for old, new in zip(
        jax.tree.leaves((before.params, before.opt_state)),
        jax.tree.leaves((after.params, after.opt_state)),
    ):
        # parameters and optimizer (its count too) untouched
        np.testing.assert_array_equal(old, new)
    assert int(after.step) == int(before.step) + 1
    good = _batch(tr, rng)
    with_spike, m1 = step_fn(spiked, good)
    without, m2 = step_fn(jax.device_put(before, tr.setup.state_shardings), good)
    assert float(m1["loss"]) == float(m2["loss"]) and int(m1["spike_in_a_row"]) == 0
    for a, b in zip(
        jax.tree.leaves(jax.device_get(with_spike.params)),
        jax.tree.leaves(jax.device_get(without.params)),
    ):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=0
        )


def test_spikes_in_the_loop_are_logged_counted_recovered_and_checkpointed(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("BRIGADE_INJECT_SPIKE_STEPS", "10,13,14")  # 10 alone; 13-14 two in a row
    cfg = {
        **BASE,
        "train.steps": 16,
        "train.max_bad_steps": 2,
        "checkpoint.every": 4,
        "logging.run_dir": str(tmp_path),
    }
    tr = Trainer(build(cfg))
    tr.fit()
    out = capsys.readouterr().out
    rec = {r["step"]: r for r in tr.history}
    assert [r["step"] for r in tr.history] == list(range(1, 17))
    assert (
        rec[9]["spike_skipped_steps"] == 0
        and rec[10]["spike_skipped_steps"] == 1
        and rec[10]["lr"] == 0.0
    )
    assert rec[11]["lr"] > 0 and rec[14]["spike_skipped_steps"] == 3
    assert "warning: step 10: 1 update(s) skipped since the last log as loss spikes" in out, out
    # 2 in a row hand over to the checkpoint
    assert "recovery:" in out and "weights of step 12" in out, out
    # the restored window is step 12's (one spike, at 10): the count rewinds with the weights
    assert rec[15]["spike_skipped_steps"] == 1 and rec[16]["spike_skipped_steps"] == 1
    saved, _ = resume.restore(
        tr.setup, abstract_state(tr.setup), open_checkpoints(tr.cfg), 16
    )  # what a resume reads back: the window with its count
    assert (int(saved.spike.skipped), int(saved.spike.seen)) == (
        1,
        11 + 2,
    )
    np.testing.assert_array_equal(np.asarray(saved.spike.losses), np.asarray(tr.state.spike.losses))


def test_resume_across_a_spike_factor_toggle(tmp_path, capsys):
    """A checkpoint saved without the guard resumes with it (an empty window), and the other way
    round (the window dropped): the setting may change between attempts."""

    def fit(steps: int, factor: float) -> dict:
        cfg = build(
            {
                **BASE,
                "train.steps": steps,
                "train.spike_factor": factor,
                "checkpoint.every": 2,
                "logging.run_dir": str(tmp_path / "run"),
            }
        )
        return Trainer(cfg).fit()

    fit(2, 0.0)
    assert fit(4, 1.1)["resumed_from"] == 2
    assert "the loss-spike window starts empty" in capsys.readouterr().out
    assert fit(6, 0.0)["resumed_from"] == 4
    assert "the loss-spike window dropped" in capsys.readouterr().out
