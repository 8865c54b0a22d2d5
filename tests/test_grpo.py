"""GRPO's pieces: the group-relative advantages and the clipped token objective with the k3 KL
against plain numpy (train/core/grpo_loss.py), the step's batch built from rollouts, the rewards
and their one-line refusals (train/core/rewards.py), `prepare --format prompts` and its pipeline
(train/data/prompts.py), and the config's refusals (G = 1, an unknown reward, KL without a
reference)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from test_data_chat import model_dir  # noqa: F401  (a pytest fixture: a tiny HF chat model dir)

from errors import UserError
from train.core import grpo_loss, rewards
from train.core.config import build
from train.data import prepare
from train.data.prompts import make_prompt_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------ advantages and loss vs numpy


def test_group_advantages_are_numpy_per_group():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 3, (4, 5)).astype(np.float64)
    r[2] = 1.0  # a group that agrees: advantage 0
    got = grpo_loss.group_advantages(r)
    for b in range(4):
        mean = sum(r[b]) / 5
        std = math.sqrt(sum((x - mean) ** 2 for x in r[b]) / 5)
        for g in range(5):
            assert abs(got[b, g] - (r[b, g] - mean) / (std + grpo_loss.ADV_EPS)) < 1e-5
    assert np.all(got[2] == 0)


def _np_objective(logp, old, ref, adv, mask, clip, beta):
    """Shao et al. 2024 eq. 3 (negated) per token in float64, then 1/|o_i| sum_t, then the mean."""
    ratio = np.exp(logp - old)
    a = adv[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - clip, 1 + clip) * a)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    per_token = per_token + beta * kl
    per_row = (per_token * mask).sum(-1) / mask.sum(-1)
    return per_row.mean(), ((kl * mask).sum(-1) / mask.sum(-1)).mean()


def test_token_objective_is_the_papers_formula():
    """With old != new (ratios both inside and outside the clip range) and the KL on."""
    rng = np.random.default_rng(1)
    r, t = 6, 7
    logp = -rng.uniform(0.1, 3, (r, t))
    old = logp + rng.normal(0, 0.4, (r, t))
    ref = logp + rng.normal(0, 0.5, (r, t))
    adv = rng.normal(0, 1, r)
    mask = (rng.uniform(size=(r, t)) < 0.7).astype(np.float64)
    mask[:, 0] = 1
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss_RT, kl_RT = grpo_loss.token_objective(
        f32(logp), f32(old), f32(ref), f32(adv), clip=0.2, kl_beta=0.05
    )
    got = float(jnp.mean(grpo_loss.sequence_means(loss_RT, f32(mask))))
    got_kl = float(jnp.mean(grpo_loss.sequence_means(kl_RT, f32(mask))))
    want, want_kl = _np_objective(logp, old, ref, adv, mask, 0.2, 0.05)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_kl, want_kl, rtol=1e-5)
    # one update per rollout: old = logp, the ratio is 1 and the loss -A on every row
    loss_RT, _ = grpo_loss.token_objective(
        f32(logp), f32(logp), None, f32(adv), clip=0.2, kl_beta=0
    )
    np.testing.assert_allclose(
        np.asarray(grpo_loss.sequence_means(loss_RT, f32(mask))), -adv, rtol=1e-6
    )


def test_rollout_rows_mask_the_completion_to_its_eos():
    eos = 9
    prompts = np.array([[1, 2, 3], [4, 5, eos]])
    new = np.array([[6, eos, 7, 7], [8, 8, 8, 8]])
    rows = grpo_loss.rollout_rows(prompts, np.array([3, 2]), new, np.array([0.5, -1.0]), 8, eos)
    assert rows["inputs"][0].tolist() == [1, 2, 3, 6, eos, eos, eos, eos]
    assert rows["targets"][0].tolist() == [2, 3, 6, eos, eos, eos, eos, eos]
    # the targets 6 and eos (positions 2, 3) of row 0; the four 8s of row 1 (no EOS: all kept)
    assert rows["weights"][0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert rows["weights"][1].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert rows["inputs"][1].tolist()[:6] == [4, 5, 8, 8, 8, 8]
    assert np.all(rows["advantages"][1] == -1.0)


# ------------------------------------------------------------------ rewards


def test_builtin_rewards():
    assert rewards.exact_match(" 7\n", answer="7") == 1.0
    assert rewards.exact_match("so 3+4 is #### 7", answer=" 7 ") == 1.0
    assert rewards.exact_match("8", answer="7") == 0.0
    fmt = rewards.resolve("format", r"\d+")
    assert fmt(" 42 ", answer="") == 1.0 and fmt("4 2", answer="") == 0.0
    default = rewards.resolve("format", build({}).post.reward_pattern)
    assert default("<think>3+4</think> <answer>7</answer>", answer="") == 1.0
    assert default("7", answer="") == 0.0


def test_registered_reward_and_refusals():
    rewards.register("length_test", lambda c, *, answer, prompt: float(len(c)))
    fn = rewards.resolve("length_test", "")
    assert rewards.score("length_test", fn, "abc", "", "p", "record 1") == 3.0
    with pytest.raises(UserError, match="'nope': valid: .*exact_match.*format"):
        rewards.resolve("nope", "")
    with pytest.raises(UserError, match="built-in"):
        rewards.register("format", fn)

    def boom(c, *, answer, prompt):
        raise KeyError("x")

    with pytest.raises(
        UserError, match=r"--post.reward boom: raised KeyError.* on record 3 .*'2\+2='"
    ):
        rewards.score("boom", boom, "4", "4", "2+2=", "record 3")
    for bad in (float("nan"), "1", None, float("inf")):
        with pytest.raises(
            UserError, match=r"--post.reward bad: returned .*not a finite number.*record 5"
        ):
            rewards.score("bad", lambda c, **k: bad, "4", "4", "2+2=", "record 5")  # noqa: B023


def test_config_refusals():
    with pytest.raises(UserError, match="group_size.*no group baseline"):
        build({"post.objective": "grpo", "post.group_size": 1})
    with pytest.raises(UserError, match="--post.reward 'nope'"):
        build({"post.objective": "grpo", "post.reward": "nope"})
    with pytest.raises(UserError, match="without --init-from.*--post.kl_beta 0"):
        build({"post.objective": "grpo", "post.kl_beta": 0.1})
    assert build({"post.objective": "grpo", "post.kl_beta": 0.1, "checkpoint.init_from": "x"})


# ------------------------------------------------------------------ prepare --format prompts


def _prompts(tmp_path, records) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_prepare_prompts_and_the_pipeline(tmp_path):
    records = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(12)]
    records.append({"prompt": "no answer here"})
    out = str(tmp_path / "data")
    index = prepare.prepare(
        [_prompts(tmp_path, records)], out, input_format="prompts", progress=False
    )
    assert index["input_format"] == "prompts" and index["n_documents"] == 13
    cfg = build({"data.source": out})
    pipe = make_prompt_pipeline(cfg.data, batch_size=4, seq_len=24, max_new=8, seed=0)
    assert pipe.n == 13 and pipe.P == len("no answer here")
    seen = []
    for step in range(3):  # one epoch of 13 prompts over 3 steps of 4 (12 of them)
        batch = pipe.host_rows(step, 0, 4)
        for d, row, n in zip(batch["record"], batch["prompt"], batch["length"]):
            text = bytes(row[:n].tolist()).decode()
            assert text == (records[d]["prompt"])
            assert bytes(pipe.answer_ids(d).tolist()).decode() == records[d].get("answer", "")
            seen.append(int(d))
    assert len(set(seen)) == 12
    np.testing.assert_array_equal(pipe.host_rows(2, 0, 4)["record"], batch["record"])  # pure

    with pytest.raises(
        UserError,
        match=r"record 13: its prompt is 14 tokens, longer than --seq-len 16 -"
        r" --post.max_new_tokens 8 = 8",
    ):
        make_prompt_pipeline(cfg.data, batch_size=4, seq_len=16, max_new=8, seed=0)


def test_prepare_prompts_renders_messages_with_the_generation_prompt(tmp_path, model_dir):  # noqa: F811
    """A chat prompt: the template's text with the assistant's turn opened, then the answer."""
    messages = [{"role": "user", "content": "what is two plus two"}]
    path = _prompts(tmp_path, [{"prompt": messages, "answer": "4"}] * 3)
    out = str(tmp_path / "data")
    prepare.prepare([path], out, str(model_dir), input_format="prompts", progress=False)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    pipe = make_prompt_pipeline(
        build({"data.source": out}).data, batch_size=2, seq_len=64, max_new=4, seed=0
    )
    batch = pipe.host_rows(0, 0, 2)
    n = int(batch["length"][0])
    text = tok.decode(batch["prompt"][0][:n].tolist(), skip_special_tokens=False)
    assert "what is two plus two" in text and text.rstrip().endswith("assistant"), text
    assert tok.decode(pipe.answer_ids(int(batch["record"][0])).tolist()) == "4"


@pytest.mark.parametrize(
    "record, message",
    [
        ({"answer": "1"}, "no field 'prompt'"),
        ({"prompt": "", "answer": "1"}, "'prompt' is empty"),
        ({"prompt": "1+1=", "answer": 2}, "field 'answer' is int, not a string"),
        (
            {"prompt": [{"role": "user", "content": "hi"}]},
            "message lists need --tokenizer HF_MODEL_DIR",
        ),
    ],
)
def test_prepare_prompts_refusals(tmp_path, record, message):
    path = _prompts(tmp_path, [{"prompt": "ok", "answer": "1"}, record])
    with pytest.raises(UserError, match=f"prompts.jsonl:2: {message}"):
        prepare.prepare([path], str(tmp_path / "out"), input_format="prompts", progress=False)


def test_cli_refuses_in_one_line(tmp_path):
    """G = 1 from the command line: exit 2, one line, no traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "train", "--objective", "grpo", "--post.group_size", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "no group baseline" in out.stderr
