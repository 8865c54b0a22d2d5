"""Preference optimisation's pieces: each loss (train/core/preference.py) against a plain numpy
reimplementation, the step's pair objective (train/core/pair_loss.py) against numpy on the tiny
model's own logits, `prepare --format preference` (strings and chat message lists: two documents
a record, the loss mask on the responses only), the pipeline of pairs (whole pairs in a batch,
whole pairs held out, a pure function of the step), and the one-line refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_data_chat import model_dir  # noqa: F401  (a pytest fixture: a tiny HF chat model dir)

from errors import UserError
from models import model
from train.core import pair_loss, preference
from train.core.config import build
from train.data import prepare
from train.data.pairs import REJECTED, make_pair_pipeline
from train.data.pipeline import make_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ the losses against numpy


def _log_sigmoid(x):
    return -np.log1p(np.exp(-x))


def _np_losses(name, w, lo, rw, rl, nw, nl, beta, eps=0.0, gamma=1.0, lam=0.1):
    """Each paper's formula written out in numpy, in float64."""
    if name == "dpo":
        z = beta * ((w - rw) - (lo - rl))
        return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
    if name == "ipo":
        return (((w - rw) - (lo - rl)) - 1 / (2 * beta)) ** 2
    if name == "simpo":
        return -_log_sigmoid(beta * w / nw - beta * lo / nl - gamma)
    aw, al = w / nw, lo / nl  # orpo
    odds = lambda a: np.log(np.exp(a) / (1 - np.exp(a)))  # noqa: E731
    return -aw - lam * _log_sigmoid(odds(aw) - odds(al))


@pytest.mark.parametrize("name", ["dpo", "ipo", "orpo", "simpo"])
def test_each_loss_is_its_paper_formula(name):
    rng = np.random.default_rng(0)
    nw, nl = rng.integers(1, 20, 6).astype(np.float64), rng.integers(1, 20, 6).astype(np.float64)
    w, lo = -rng.uniform(0.1, 3, 6) * nw, -rng.uniform(0.1, 3, 6) * nl
    rw, rl = w + rng.normal(0, 1, 6), lo + rng.normal(0, 1, 6)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    if name == "dpo":
        got, _, _ = preference.dpo(f32(w), f32(lo), f32(rw), f32(rl), beta=0.3, label_smoothing=0.1)
        want = _np_losses(name, w, lo, rw, rl, nw, nl, 0.3, eps=0.1)
    elif name == "ipo":
        got, _, _ = preference.ipo(f32(w), f32(lo), f32(rw), f32(rl), tau=0.2)
        want = _np_losses(name, w, lo, rw, rl, nw, nl, 0.2)
    elif name == "orpo":
        got, _, _ = preference.orpo(f32(w), f32(lo), f32(nw), f32(nl), lam=0.25, beta=0.1)
        want = _np_losses(name, w, lo, rw, rl, nw, nl, 0.1, lam=0.25)
    else:
        got, _, _ = preference.simpo(f32(w), f32(lo), f32(nw), f32(nl), beta=2.0, gamma=0.5)
        want = _np_losses(name, w, lo, rw, rl, nw, nl, 2.0, gamma=0.5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_orpo_log_odds_stay_finite_near_probability_one():
    """A response of probability ~1 (mean log-prob 0 in float32): log(1 - p) is held finite."""
    zero = jnp.zeros(2, jnp.float32)
    loss, _, _ = preference.orpo(zero, zero - 1.0, zero + 1, zero + 1, lam=0.1, beta=0.1)
    assert np.all(np.isfinite(np.asarray(loss)))


# ------------------------------------------------------------------ the step's objective


def _pairs(vocab: int, b: int = 3, t: int = 16, seed: int = 0) -> dict:
    """B pairs with a shared prompt of 3-6 tokens and responses ending at different lengths."""
    rng = np.random.default_rng(seed)
    out = {}
    prompt = rng.integers(3, 7, b)
    for prefix in ("", REJECTED):
        tok = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
        if prefix:
            tok[:, :7] = out["inputs"][:, :7]  # the same prompt
        end = rng.integers(9, t + 2, b)
        j = np.arange(1, t + 1)
        out[prefix + "inputs"], out[prefix + "targets"] = tok[:, :-1], tok[:, 1:]
        w = (j >= prompt[:, None]) & (j < end[:, None])
        out[prefix + "weights"] = w.astype(np.float32)
    return out


def _np_seq_logps(cfg, params, inputs, targets, weights):
    logits = np.asarray(model.apply(cfg, params, inputs)[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return (picked * weights).sum(-1), weights.sum(-1)


def test_pair_objective_is_numpy_on_the_models_logits():
    """dpo's step objective: sequence log-probs of chosen and rejected (one forward of both), the
    reference's, the mean loss over pairs and the logged sums equal numpy's on model.apply."""
    cfg = build({"model.preset": "tiny", "model.dtype": "float32"})
    post = build(
        {"post.objective": "dpo", "post.beta": 0.5, "checkpoint.init_from": "x"}
    ).post  # the section alone
    params = model.init(cfg.model, jax.random.key(0))
    ref = model.init(cfg.model, jax.random.key(1))
    batch = _pairs(cfg.model.vocab_size)
    objective, (loss_sum, n, sums) = jax.jit(
        lambda p, b, r: pair_loss.pair_terms(cfg.model, post, p, b, r)
    )(params, batch, ref)
    k = REJECTED
    w, _ = _np_seq_logps(cfg.model, params, batch["inputs"], batch["targets"], batch["weights"])
    lo, _ = _np_seq_logps(
        cfg.model, params, batch[k + "inputs"], batch[k + "targets"], batch[k + "weights"]
    )
    rw, _ = _np_seq_logps(cfg.model, ref, batch["inputs"], batch["targets"], batch["weights"])
    rl, _ = _np_seq_logps(
        cfg.model, ref, batch[k + "inputs"], batch[k + "targets"], batch[k + "weights"]
    )
    want = _np_losses("dpo", w, lo, rw, rl, None, None, 0.5)
    assert float(n) == 3
    np.testing.assert_allclose(float(loss_sum), want.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(objective), want.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(sums["post/chosen_logp"]), w.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(sums["post/rejected_logp"]), lo.sum(), rtol=1e-5)
    margin = 0.5 * ((w - rw) - (lo - rl))
    np.testing.assert_allclose(float(sums["post/margin"]), margin.sum(), rtol=1e-4, atol=1e-5)
    assert float(sums["post/accuracy"]) == float((margin > 0).sum())


# ------------------------------------------------------------------ prepare and the pipeline


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


RECORDS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + a % 3)}
    for a in range(20)
    for b in range(0, 20, 2)
]


def _prepare(tmp_path, records, *extra) -> str:
    out = str(tmp_path / "ds")
    args = [_jsonl(tmp_path / "pairs.jsonl", records), "--format", "preference", "--out", out]
    assert prepare.main([*args, "--workers", "1", "--no-progress", *extra]) == 0
    return out


def _data(source: str, **over):
    return build({"data.source": source, "data.eval_fraction": 0.1, **over}).data


def test_prepare_strings_two_documents_a_record_masked_on_the_response(tmp_path):
    out = _prepare(tmp_path, RECORDS)
    index = json.load(open(os.path.join(out, "index.json")))
    assert index["input_format"] == "preference" and index["n_documents"] == 2 * len(RECORDS)
    pipe = make_pair_pipeline(_data(out), batch_size=4, seq_len=12, seed=0)
    assert len(pipe.train_pairs) + len(pipe.eval_pairs) == len(RECORDS)
    rows = pipe.global_batch(0)
    for i in range(4):
        text = bytes(int(t) for t in rows["inputs"][i] if t < 256).decode()
        prompt = text.split("=")[0] + "="
        a, b = (int(x) for x in prompt[:-1].split("+"))
        # the weights start on the first response token and cover the response and the EOS
        j = np.flatnonzero(rows["weights"][i])
        assert j[0] == len(prompt) - 1, (text, j)
        assert bytes(rows["targets"][i][j[:-1]].tolist()).decode() == str(a + b)
        rj = np.flatnonzero(rows[REJECTED + "weights"][i])
        assert np.array_equal(
            rows[REJECTED + "inputs"][i][: len(prompt)], rows["inputs"][i][: len(prompt)]
        )
        assert bytes(rows[REJECTED + "targets"][i][rj[:-1]].tolist()).decode() != str(a + b)
    again = make_pair_pipeline(_data(out), batch_size=4, seq_len=12, seed=0).global_batch(0)
    assert all(np.array_equal(rows[k], again[k]) for k in rows)  # a function of the step
    # the eval batches are held-out pairs (whole), never a training pair
    held = {tuple(r.tolist()) for r in pipe.eval_rows(0)["inputs"]}
    seen = {tuple(r.tolist()) for s in range(40) for r in pipe.global_batch(s)["inputs"]}
    assert held and not held & seen


def test_prepare_chat_lists_mask_the_response_turns_only(tmp_path, model_dir):  # noqa: F811
    """A multi-turn prompt whose history holds an assistant turn: only the response is trained."""
    history = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "alpha beta"},
        {"role": "user", "content": "why blue"},
    ]
    records = [
        {
            "prompt": history,
            "chosen": [{"role": "assistant", "content": f"because sky {i}"}],
            "rejected": "gamma",  # a string: one assistant message
        }
        for i in range(8)
    ]
    out = _prepare(tmp_path, records, "--tokenizer", str(model_dir))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    data = _data(out, **{"data.eval_fraction": 0.0})
    pipe = make_pair_pipeline(data, batch_size=2, seq_len=64, seed=0)
    rows = pipe.global_batch(0)
    for key, want in (("", "because sky"), (REJECTED, "gamma")):
        j = np.flatnonzero(rows[key + "weights"][0])
        text = tok.decode(rows[key + "targets"][0][j].tolist(), skip_special_tokens=False)
        assert text.startswith(want) and "alpha" not in text and "<|im_end|>" in text, text


@pytest.mark.parametrize(
    "record, match",
    [
        ({"prompt": "1+1=", "chosen": "  ", "rejected": "3"}, "'chosen' is an empty response"),
        ({"prompt": "1+1=", "chosen": "2"}, "no field 'rejected'"),
        (
            {"prompt": "1+1=", "chosen": "2", "rejected": [{"role": "assistant", "content": ""}]},
            "'rejected' is an empty response",
        ),  # fmt: skip
        (
            {"prompt": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b"},
            "message lists need --tokenizer",
        ),  # fmt: skip
    ],
)
def test_prepare_refuses_a_bad_pair_in_one_line(tmp_path, record, match):
    path = _jsonl(tmp_path / "pairs.jsonl", RECORDS[:3] + [record])
    with pytest.raises(UserError, match=match) as e:
        prepare.prepare([path], str(tmp_path / "ds"), input_format="preference", progress=False)
    assert "pairs.jsonl:4" in str(e.value) and "\n" not in str(e.value)


def test_the_pipeline_refuses_a_prompt_longer_than_the_sequence(tmp_path):
    out = _prepare(tmp_path, RECORDS + [{"prompt": "x" * 40, "chosen": "a", "rejected": "b"}])
    with pytest.raises(UserError, match=r"record 201\): its prompt is 40 tokens.*--seq-len 32"):
        make_pair_pipeline(_data(out), batch_size=4, seq_len=32, seed=0)


def test_config_refusals_are_one_line(tmp_path):
    with pytest.raises(UserError, match="--objective 'kto': valid: lm, dpo, ipo, orpo, simpo"):
        build({"post.objective": "kto"})
    with pytest.raises(UserError, match="--objective dpo without --init-from"):
        build({"post.objective": "dpo"})
    with pytest.raises(UserError, match="--post.label_smoothing 0.5"):
        build({"post.objective": "simpo", "post.label_smoothing": 0.5})
    with pytest.raises(UserError, match="prepared with --format text"):
        text = tmp_path / "t.txt"
        text.write_text("hello\n" * 100)
        prepare.main([str(text), "--out", str(tmp_path / "t"), "--workers", "1", "--no-progress"])
        make_pair_pipeline(_data(str(tmp_path / "t")), batch_size=2, seq_len=8, seed=0)
    pairs = _prepare(tmp_path, RECORDS[:20])  # pairs read as documents by --objective lm
    with pytest.raises(UserError, match="preference pairs .* train with --objective dpo"):
        make_pipeline(_data(pairs), batch_size=2, seq_len=8, seed=0)
    # the command line: exit 2 and one line, before anything compiles
    run = subprocess.run(
        [sys.executable, "-m", "train", "--objective", "ipo", "--model", "tiny"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: --objective ipo without --init-from: the reference model is the --init-from"
        " checkpoint (frozen); pass --init-from PATH (the SFT model), or use --objective orpo or"
        " simpo, which need no reference"
    ]
