"""The grpo step on a mesh (train/core/grpo_loss.py through the real jitted step): at fixed
rollouts (the same sampled tokens and advantages fed to both), after the warm-up, loss, gradient
norm, KL and parameters equal the same step on one device, float32, on fsdp=2 and on data=2 with
two micro-batches, the KL to the frozen reference on; the step's objective equals numpy on the
model's own logits. Then fit() on prepared prompts, sampling in the step: the rollout figures are
logged, a resume from a checkpoint samples the same completions and ends where the uninterrupted
run did, and a reward that raises stops the run in one line. Fake CPU devices."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest
from equivalence import COMPARED, WARMUP, assert_runs_match, assert_trees_close, make_trainer
from test_lora_meshes import _save_base
from test_preference_meshes import run_pairs

from errors import UserError
from models import model
from train.core import grpo_loss, rewards
from train.core.config import build
from train.data import prepare

BASE = {"model.preset": "tiny", "model.remat": "none", "post.objective": "grpo", "train.lr": 1e-2}
G = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("sft"))
    return directory, _save_base(directory, "tiny", seed=3)


def rollout_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict:
    """Fixed rollouts: prompts of 3-8 tokens, completions of up to 10 with EOS at random places,
    advantages of groups of G rewards."""
    rng = np.random.default_rng(seed)
    eos = vocab - 1
    length = rng.integers(3, 9, rows)
    prompts = rng.integers(0, eos, (rows, 8))
    new = rng.integers(0, eos, (rows, 10))
    new[rng.uniform(size=(rows, 10)) < 0.1] = eos
    adv = grpo_loss.group_advantages(rng.integers(0, 2, (rows // G, G))).reshape(-1)
    return grpo_loss.rollout_rows(prompts, length, new, adv, seq, eos)


# mesh -> (prompts a step, overrides): B x G rows of rollouts
CASES = {"fsdp=2": (2, {}), "data=2": (4, {"train.micro_batches": 2})}


@pytest.mark.parametrize("mesh", list(CASES))
def test_grpo_step_on_a_mesh_matches_one_device(mesh, base, tmp_path):
    prompts, extra = CASES[mesh]
    over = {**BASE, "post.kl_beta": 0.1, "post.group_size": G, "checkpoint.init_from": base[0]}
    over.update({"train.batch_size": prompts, **extra})
    sharded = make_trainer(mesh, tmp_path / "mesh", **over)
    single = make_trainer("", tmp_path / "one", one_device=True, **over)
    # one batch of rollouts, stepped on five times
    rows = prompts * G
    batches = [rollout_batch(single.cfg.model.vocab_size, rows, 32)] * (WARMUP + COMPARED)
    want = run_pairs(single, batches, base[1], base[1])
    got = run_pairs(sharded, batches, base[1], base[1])
    assert_runs_match(got, want, f"--objective grpo on {mesh}")
    kls = [float(m["post/kl"]) for m in want["metrics"]]
    assert kls[0] == 0 and kls[-1] > 0, kls  # the policy starts as the reference, then leaves it
    np.testing.assert_allclose(float(got["metrics"][-1]["post/kl"]), kls[-1], rtol=1e-4)
    # with the ratio 1 the policy-gradient term is -A on every row: the loss is its mean plus the KL
    losses = np.array([float(m["loss"]) for m in want["metrics"]])
    pg = -float(batches[0]["advantages"][:, 0].mean())
    np.testing.assert_allclose(losses, pg + 0.1 * np.array(kls), rtol=1e-4, atol=1e-6)
    for run in (got, want):
        assert_trees_close(run["frozen"], base[1], "the reference", rtol=0, atol_frac=0)


def test_grpo_objective_is_numpy_on_the_models_logits(base):
    """One device: the objective of a batch of rollouts (kl on) equals numpy's on model.apply."""
    cfg = build(
        {**BASE, "model.dtype": "float32", "post.kl_beta": 0.2, "checkpoint.init_from": "x"}
    )
    params = model.init(cfg.model, jax.random.key(5))
    batch = rollout_batch(cfg.model.vocab_size, 8, 24, seed=1)
    objective, (loss_sum, n, sums) = jax.jit(
        lambda p, b, r: grpo_loss.grpo_terms(cfg.model, cfg.post, p, b, r)
    )(params, batch, base[1])

    def logp(p):
        logits = np.asarray(model.apply(cfg.model, p, batch["inputs"])[0], np.float64)
        top = logits.max(-1, keepdims=True)
        lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
        return np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0] - lse

    w, adv = batch["weights"], batch["advantages"][:, 0]
    lp, ref = logp(params), logp(base[1])
    kl = np.exp(ref - lp) - (ref - lp) - 1
    per_row = ((-adv[:, None] + 0.2 * kl) * w).sum(-1) / w.sum(-1)
    assert float(n) == 8
    np.testing.assert_allclose(float(loss_sum), per_row.sum(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(objective), per_row.sum(), rtol=1e-4, atol=1e-5)
    want_kl = ((kl * w).sum(-1) / w.sum(-1)).sum()
    np.testing.assert_allclose(float(sums["post/kl"]), want_kl, rtol=1e-4)


def _prompts_dataset(root) -> str:
    path = root / "prompts.jsonl"
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = str(root / "prompts")
    prepare.prepare([str(path)], out, input_format="prompts", progress=False)
    return out


def test_fit_samples_logs_and_resumes_exactly(tmp_path):
    """fit() sampling in the step on fsdp=2: the rollout figures in metrics.jsonl; a resume from
    step 2 samples what the uninterrupted run sampled (the same rewards) and ends with its
    parameters bit for bit."""
    over = {
        **BASE,
        "data.source": _prompts_dataset(tmp_path),
        "post.group_size": G,
        "post.max_new_tokens": 3,
        "post.reward": "format",
        "post.reward_pattern": r"(?s).*[0-9a-z].*",  # a random model: rewards vary
        "train.batch_size": 4,
        "train.steps": 4,
        "train.seq_len": 12,
        "train.lr": 1e-3,
        "checkpoint.every": 2,
        "checkpoint.async": False,
    }
    tr = make_trainer("fsdp=2", tmp_path / "run", **over)
    tr.fit()
    path = os.path.join(tr.cfg.logging.run_dir, "metrics.jsonl")
    logged = [r for r in map(json.loads, open(path)) if "loss" in r]
    keys = ("grpo/reward_mean", "grpo/reward_std", "grpo/rollout_tokens", "grpo/rollout_share")
    assert set(keys) <= set(logged[-1])
    assert logged[-1]["grpo/rollout_tokens"] == 4 * G * 3
    # "a+b=" prompts, 3 new tokens: at most 3 decode steps, fewer once every row has its EOS
    assert all(1 <= r["grpo/decode_steps"] <= 3 for r in logged)
    assert 0 < logged[-1]["grpo/rollout_share"] < 1
    assert logged[-1]["post/kl"] == 0.0  # no reference: no KL

    again = make_trainer(
        "fsdp=2",
        tmp_path / "again",
        **{**over, "checkpoint.resume": os.path.join(tr.cfg.logging.run_dir, "checkpoints", "2")},
    )
    again.fit()
    for key in ("grpo/reward_mean", "grpo/reward_std", "loss", "grad_norm"):
        assert again.history[-1][key] == tr.history[-1][key], key
    assert again.history[-1]["step"] == 4
    assert 0 < tr.history[-1]["grpo/reward_mean"] < 1  # the rewards vary: the update moves
    assert_trees_close(
        jax.device_get(again.state.params),
        jax.device_get(tr.state.params),
        "resumed policy",
        rtol=0,
        atol_frac=0,
    )


def test_a_reward_that_raises_stops_the_run_in_one_line(tmp_path):
    def broken(completion, *, answer, prompt):
        return {"7": 1.0}[completion]

    rewards.register("broken_test", broken)
    over = {
        **BASE,
        "data.source": _prompts_dataset(tmp_path),
        "post.reward": "broken_test",
        "post.max_new_tokens": 2,
        "train.batch_size": 2,
        "train.steps": 1,
        "train.seq_len": 12,
    }
    tr = make_trainer("", tmp_path / "run", one_device=True, **over)
    with pytest.raises(UserError, match=r"--post.reward broken_test: raised KeyError.* on record"):
        tr.fit()


def test_grpo_on_a_quantised_lora_base_samples_and_trains(base, tmp_path):
    """GRPO with QLoRA: the sampler and the step read the nf4 base with the adapters, the KL's
    reference is the base with the adapters off; the run logs finite rewards, KL and losses."""
    over = {
        **BASE,
        "checkpoint.init_from": base[0],
        "data.source": _prompts_dataset(tmp_path),
        "lora.rank": 4,
        "lora.alpha": 8.0,
        "lora.base_dtype": "nf4",
        "lora.block_size": 32,
        "post.group_size": G,
        "post.max_new_tokens": 3,
        "post.kl_beta": 0.05,
        "post.reward": "format",
        "post.reward_pattern": r"(?s).*[0-9a-z].*",
        "train.batch_size": 4,
        "train.steps": 3,
        "train.seq_len": 12,
        "checkpoint.every": 0,
    }
    tr = make_trainer("fsdp=2", tmp_path / "run", **over)
    tr.fit()
    assert tr.history and tr.history[-1]["step"] == 3
    for r in tr.history:
        assert all(math.isfinite(r[k]) for k in ("loss", "grpo/reward_mean", "post/kl")), r
