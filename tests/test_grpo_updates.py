"""GRPO with several updates per rollout (--post.updates_per_rollout N): the second update on a
rollout (ratio != 1, the clip active) has the loss, the clip figures and the gradient of numpy's
objective on the model's own log-probabilities; the step with pi_old's log-probabilities on
fsdp=2 and on data=2 with two micro-batches equals one device over five updates of one rollout;
fit() with N = 2 samples once per rollout, logs the clip figures and the held-out reward eval,
and resumes exactly from a checkpoint; the prompt pipeline serves one batch per rollout; the
config's refusals. Fake CPU devices."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from equivalence import COMPARED, WARMUP, assert_runs_match, assert_trees_close, make_trainer
from test_grpo_meshes import BASE, G, _prompts_dataset, rollout_batch
from test_lora_meshes import _save_base
from test_preference_meshes import run_pairs

from errors import UserError
from mesh.rules import axis_rules
from models import model
from train.core import grpo_loss, rewards
from train.core.config import build
from train.core.step import grads_loss_stats
from train.data.prompts import make_prompt_pipeline
from train.run import rollouts
from train.run.rollouts import Rollouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIP = 0.2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("sft"))
    return directory, _save_base(directory, "tiny", seed=3)


def old_logps(tr, params, batch) -> np.ndarray:
    """pi_old's log-probabilities of a batch, as the rollout computes them (its jitted function)."""
    s = tr.setup
    fn = jax.jit(lambda p, b: grpo_loss.token_logps(s.model_cfg, s.cfg.train.micro_batches, p, b))
    with jax.set_mesh(s.mesh), axis_rules(s.rules):
        return np.asarray(jax.device_get(fn(params, jax.device_put(batch, s.batch_sharding))))


def np_logp(cfg, params, batch) -> np.ndarray:
    logits = np.asarray(model.apply(cfg, params, batch["inputs"])[0], np.float64)
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    return np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0] - lse


def test_second_update_is_numpys_clipped_objective(base, tmp_path):
    """Two updates on one rollout, one device, float32: on the second the ratio pi / pi_old
    differs from 1 and is clipped on some tokens; the step's loss, clip fraction and ratio mean
    equal numpy's, and its gradient is the backward of the model's log-probabilities with numpy's
    cotangent d loss / d logp = -A ratio [not clipped] w / |o| / R."""
    over = {**BASE, "post.group_size": G, "post.updates_per_rollout": 2, "train.batch_size": 2}
    over.update({"train.lr": 5e-2, "train.warmup_steps": 0, "train.steps": 2})
    tr = make_trainer("", tmp_path, one_device=True, **over)
    cfg = tr.cfg
    batch = rollout_batch(cfg.model.vocab_size, 2 * G, 24, seed=2)
    batch["old_logp"] = old_logps(tr, base[1], batch)
    np.testing.assert_allclose(batch["old_logp"], np_logp(cfg.model, base[1], batch), atol=1e-4)
    run = run_pairs(tr, [batch, batch], base[1], base[1])
    first, second = run["metrics"]
    assert abs(float(first["post/ratio_mean"]) - 1) < 1e-5  # the sampling policy's own update
    params1 = run["params"][0]

    w, adv = batch["weights"], batch["advantages"][:, 0]
    ratio = np.exp(np_logp(cfg.model, params1, batch) - batch["old_logp"])
    a = adv[:, None]
    pg = -np.minimum(ratio * a, np.clip(ratio, 1 - CLIP, 1 + CLIP) * a)
    clipped = ((ratio > 1 + CLIP) & (a > 0)) | ((ratio < 1 - CLIP) & (a < 0))
    n_o, rows = w.sum(-1), len(w)
    row_mean = lambda x: ((x * w).sum(-1) / n_o).mean()  # noqa: E731
    assert 0.05 < row_mean(clipped) < 0.95, row_mean(clipped)  # the clip binds
    np.testing.assert_allclose(float(second["loss"]), row_mean(pg), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(second["post/clip_fraction"]), row_mean(clipped), atol=1e-6)
    np.testing.assert_allclose(float(second["post/ratio_mean"]), row_mean(ratio), rtol=1e-4)

    # the gradient of the second update: the step's objective vs numpy's cotangent through the
    # model's log-probabilities
    cot = (-a * ratio * ~clipped * w / n_o[:, None] / rows).astype(np.float32)
    terms = lambda p, mb: grpo_loss.grpo_terms(cfg.model, cfg.post, p, mb)  # noqa: E731
    _, got, _ = jax.jit(lambda p, b: grads_loss_stats(cfg.model, p, b, 1, terms_fn=terms))(
        params1, batch
    )

    def logp(p):
        logp_RT, _, _ = grpo_loss.sequence_logps_per_token(cfg.model, p, batch)
        return logp_RT

    _, vjp = jax.vjp(logp, params1)
    (want,) = vjp(cot)
    assert_trees_close(jax.device_get(got), jax.device_get(want), "second update's gradient")
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(jax.device_get(want))))
    np.testing.assert_allclose(float(second["grad_norm"]), norm, rtol=1e-4)


# mesh -> (prompts a step, overrides): B x G rows, one rollout stepped on five times
CASES = {"fsdp=2": (2, {}), "data=2": (4, {"train.micro_batches": 2})}


@pytest.mark.parametrize("mesh", list(CASES))
def test_updates_on_one_rollout_on_a_mesh_match_one_device(mesh, base, tmp_path):
    """pi_old fixed at the starting parameters, five updates: from the second on the ratio moves
    and clips; loss, gradient norm, KL, clip figures and parameters equal one device's."""
    prompts, extra = CASES[mesh]
    over = {**BASE, "post.kl_beta": 0.1, "post.group_size": G, "checkpoint.init_from": base[0]}
    over.update({"train.batch_size": prompts, "post.updates_per_rollout": 5, **extra})
    sharded = make_trainer(mesh, tmp_path / "mesh", **over)
    single = make_trainer("", tmp_path / "one", one_device=True, **over)
    batch = rollout_batch(single.cfg.model.vocab_size, prompts * G, 32)
    batch["old_logp"] = old_logps(single, base[1], batch)
    np.testing.assert_allclose(old_logps(sharded, base[1], batch), batch["old_logp"], atol=1e-5)
    batches = [batch] * (WARMUP + COMPARED)
    want = run_pairs(single, batches, base[1], base[1])
    got = run_pairs(sharded, batches, base[1], base[1])
    assert_runs_match(got, want, f"--objective grpo, 5 updates a rollout, on {mesh}")
    clips = [float(m["post/clip_fraction"]) for m in want["metrics"]]
    assert clips[0] == 0 and clips[-1] > 0, clips
    for key in ("post/kl", "post/clip_fraction", "post/ratio_mean"):
        np.testing.assert_allclose(
            float(got["metrics"][-1][key]), float(want["metrics"][-1][key]), rtol=1e-4, atol=1e-6
        )


def test_fit_two_updates_a_rollout_logs_evals_and_resumes_exactly(tmp_path):
    """fit() with N = 2 on fsdp=2: a rollout at steps 0 and 2 (steps 2 and 4 reuse theirs: no
    tokens sampled, the ratio moved); the held-out reward eval at steps 2 and 4; a resume from
    step 2 logs what the uninterrupted run logged (its eval too) and ends with its parameters."""
    over = {
        **BASE,
        "data.source": _prompts_dataset(tmp_path),
        "data.eval_fraction": 0.1,
        "post.group_size": G,
        "post.max_new_tokens": 3,
        "post.updates_per_rollout": 2,
        "post.reward": "format",
        "post.reward_pattern": r"(?s).*[0-9a-e].*",  # a random model: rewards vary
        "train.batch_size": 4,
        "train.steps": 4,
        "train.seq_len": 12,
        "train.lr": 1e-2,
        "train.eval_every": 2,
        "logging.log_every": 1,
        "checkpoint.every": 2,
        "checkpoint.async": False,
    }
    tr = make_trainer("fsdp=2", tmp_path / "run", **over)
    tr.fit()
    h = tr.history
    assert [r["grpo/rollout_tokens"] for r in h] == [4 * G * 3, 0, 4 * G * 3, 0]
    assert h[0]["grpo/reward_mean"] == h[1]["grpo/reward_mean"]  # the same rollout
    assert h[0]["grpo/ratio_mean"] == pytest.approx(1, abs=1e-5) and h[0]["grpo/clip_fraction"] == 0
    assert h[1]["grpo/ratio_mean"] != pytest.approx(1, abs=1e-4)
    evals = tr.eval_history
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert 0 <= e["eval/pass_rate"] <= 1 and 0 <= e["eval/reward_mean"] <= 1, e
        assert "eval_loss" not in e
    path = os.path.join(tr.cfg.logging.run_dir, "metrics.jsonl")
    logged = [json.loads(line) for line in open(path)]
    assert any("eval/reward_mean" in r for r in logged)
    assert any("grpo/clip_fraction" in r for r in logged)

    again = make_trainer(
        "fsdp=2",
        tmp_path / "again",
        **{**over, "checkpoint.resume": os.path.join(tr.cfg.logging.run_dir, "checkpoints", "2")},
    )
    again.fit()
    assert [r["step"] for r in again.history] == [3, 4]
    for key in ("grpo/reward_mean", "loss", "grad_norm", "grpo/clip_fraction", "grpo/ratio_mean"):
        assert again.history[-1][key] == h[-1][key], key
    # the held-out eval: greedy, so the same parameters give the same figures
    assert again.eval_history[-1] == {**evals[-1]}, (again.eval_history, evals)
    assert_trees_close(
        jax.device_get(again.state.params),
        jax.device_get(tr.state.params),
        "resumed policy",
        rtol=0,
        atol_frac=0,
    )


def test_a_stop_signal_mid_rollout_finishes_the_rollout_first(tmp_path):
    """SIGTERM arriving after step 2 of a run at N = 2: step 3 starts a rollout, so the run stops
    after step 4, its last update, and saves there (a checkpoint never holds half a rollout)."""

    def on_log(record):
        if record.get("step") == 2 and "loss" in record:
            os.kill(os.getpid(), signal.SIGTERM)

    over = {
        **BASE,
        "data.source": _prompts_dataset(tmp_path),
        "post.group_size": G,
        "post.max_new_tokens": 2,
        "post.updates_per_rollout": 2,
        "train.batch_size": 2,
        "train.steps": 8,
        "train.seq_len": 12,
        "logging.log_every": 1,
        "checkpoint.every": 0,
        "checkpoint.async": False,
    }
    tr = make_trainer("", tmp_path / "run", one_device=True, **over)
    tr.on_log = on_log
    out = tr.fit()
    assert out["stopped_by"] == "SIGTERM" and out["steps"] == 4, out
    assert out["checkpoint"].endswith(os.path.join("checkpoints", "4")), out


def test_the_prompt_pipeline_serves_one_batch_a_rollout(tmp_path):
    """N = 3: steps 3k .. 3k + 2 read the same prompts; the rollouts cover every training prompt
    once an epoch; the held-out prompts are never trained on and come back the same."""
    cfg = build({"data.source": _prompts_dataset(tmp_path), "data.eval_fraction": 0.2})
    make = lambda n: make_prompt_pipeline(  # noqa: E731
        cfg.data, batch_size=4, seq_len=12, max_new=3, seed=0, per_rollout=n
    )
    pipe, plain = make(3), make(1)
    held = {int(d) for b in pipe.eval_batches(100) for d in b["record"]}
    assert 10 <= len(held) <= 30 and len(held) + pipe.n == 100
    seen = []
    for rollout in range(pipe.n // 4):
        records = [pipe.device_batch(3 * rollout + i)["record"].tolist() for i in range(3)]
        assert records[0] == records[1] == records[2]
        assert records[0] == plain.device_batch(rollout)["record"].tolist()
        seen += records[0]
    assert len(set(seen)) == len(seen) == pipe.n // 4 * 4 and not held & set(seen)
    assert pipe.state(6)["offset"] == plain.state(2)["offset"] == 8
    again = [b["record"].tolist() for b in make(3).eval_batches(2)]
    assert again == [b["record"].tolist() for b in pipe.eval_batches(2)]


def test_refusals():
    grpo = {"post.objective": "grpo"}
    with pytest.raises(UserError, match="updates_per_rollout.*>= 1"):
        build({**grpo, "post.updates_per_rollout": 0})
    with pytest.raises(UserError, match="--checkpoint.every 5 with --post.updates_per_rollout 2"):
        build({**grpo, "post.updates_per_rollout": 2, "checkpoint.every": 5, "train.steps": 10})
    with pytest.raises(UserError, match="--train.steps 7 with --post.updates_per_rollout 2"):
        build({**grpo, "post.updates_per_rollout": 2, "checkpoint.every": 2, "train.steps": 7})
    assert build({**grpo, "post.updates_per_rollout": 2, "checkpoint.every": 4, "train.steps": 8})
    # lm runs do not read it
    assert build({"post.updates_per_rollout": 3, "train.steps": 7})


def test_cli_refuses_zero_updates_in_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "train", "--objective", "grpo", "--post.updates_per_rollout", "0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "updates_per_rollout" in out.stderr


def _scorer(reward: str):
    """A Rollouts holding only what `scores` reads: completions of letters, rewards by name."""
    r = object.__new__(Rollouts)
    cfg = build({"post.objective": "grpo", "post.reward": reward})
    r.s, r.reward = SimpleNamespace(cfg=cfg), rewards.resolve(reward, "")
    r.data, r._texts = SimpleNamespace(eos=9, name="d"), {0: ("p", "a"), 1: ("p", "b")}
    r.tokenizer = SimpleNamespace(decode=lambda t: "".join(chr(97 + int(x)) for x in t))
    return r


def test_scores_split_over_processes_and_gathered_exactly(monkeypatch):
    """Two processes simulated (the gather stubbed): each scores its contiguous share and the
    rewards assembled from both shares' int32 words equal one process's float64 rewards exactly;
    a reward that fails in the other process's share stops this one too, naming that process.
    (tests/test_grpo_processes.py runs the real gather.)"""
    rewards.register("thirds_test", lambda c, *, answer, prompt: len(c) / 3)
    rewards.register("fails_on_d_test", lambda c, *, answer, prompt: {"d": None}.get(c[:1], 1.0))
    new_RN = np.array([[1, 2, 9], [1, 9, 9], [4, 5, 6], [3, 9, 9], [2, 2, 2]])
    records_B = np.array([0, 1, 0, 1, 0])
    r = _scorer("thirds_test")
    want = r.scores(records_B, new_RN, group=1)  # one process
    np.testing.assert_array_equal(want.reshape(-1), [2 / 3, 1 / 3, 1, 1 / 3, 1])
    sent = {}

    def as_process(i, gather):
        monkeypatch.setattr(rollouts.jax, "process_count", lambda: 2)
        monkeypatch.setattr(rollouts.jax, "process_index", lambda: i)
        monkeypatch.setattr(rollouts.multihost_utils, "process_allgather", gather)

    as_process(1, lambda words: sent.setdefault(1, words)[None].repeat(2, 0))
    r.scores(records_B, new_RN, group=1)
    as_process(0, lambda words: np.stack([words, sent[1]]))
    np.testing.assert_array_equal(r.scores(records_B, new_RN, group=1), want)

    bad = _scorer("fails_on_d_test")  # row 3 ("d...") is process 1's
    as_process(1, lambda words: sent.update({1: words}) or np.stack([words, words]))
    with pytest.raises(UserError, match="fails_on_d_test: returned"):
        bad.scores(records_B, new_RN, group=1)
    as_process(0, lambda words: np.stack([words, sent[1]]))
    with pytest.raises(UserError, match="--post.reward fails_on_d_test: failed on process 1"):
        bad.scores(records_B, new_RN, group=1)
