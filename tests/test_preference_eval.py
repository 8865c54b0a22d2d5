"""The held-out eval of a preference run (--eval-every under dpo, simpo): the objective's own loss,
accuracy and margin on held-out pairs, kept whole, equal numpy's on the model's logits of the
policy and (dpo) the frozen reference; the console line shows them. Fake CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from equivalence import make_trainer
from test_lora_meshes import _save_base
from test_preference_meshes import _pairs_dataset

from models import model
from train.data.pairs import make_pair_pipeline
from train.run.sinks import step_line


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("sft"))
    return directory, _save_base(directory, "tiny", seed=3)


def np_sequence_logps(cfg, params, inputs, targets, weights):
    """-> (each row's summed log-probability under the mask, its mask count), float64."""
    logits = np.asarray(model.apply(cfg, params, inputs)[0], np.float64)
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    logp = np.take_along_axis(logits, targets[..., None], -1)[..., 0] - lse
    return (logp * weights).sum(-1), weights.sum(-1)


def log_sigmoid(x):
    return -np.logaddexp(0, -x)


@pytest.mark.parametrize("objective", ["dpo", "simpo"])
def test_held_out_eval_is_the_objectives_loss_on_whole_pairs(objective, base, tmp_path):
    over = {
        "model.preset": "tiny",
        "model.remat": "none",
        "post.objective": objective,
        "checkpoint.init_from": base[0],
        "data.source": _pairs_dataset(tmp_path),
        "data.eval_fraction": 0.1,
        "train.lr": 1e-2,
        "train.steps": 3,
        "train.seq_len": 16,
        "train.eval_every": 3,
        "train.eval_batches": 2,
        "checkpoint.every": 0,
    }
    tr = make_trainer("fsdp=2", tmp_path / "run", **over)
    tr.fit()
    (record,) = tr.eval_history
    assert record["step"] == 3 and "eval_loss" not in record, record
    line = step_line(record)
    assert "eval loss" in line and " | acc " in line and " | margin " in line, line

    cfg, t = tr.cfg, tr.cfg.train
    pipe = make_pair_pipeline(cfg.data, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed)
    rows = [pipe.eval_rows(i) for i in range(t.eval_batches)]
    b = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    trained = jax.device_get(tr.state.params)

    def logps(params, prefix):
        keys = ("inputs", "targets", "weights")
        return np_sequence_logps(cfg.model, params, *(b[prefix + k] for k in keys))

    (lw, nw), (ll, nl) = logps(trained, ""), logps(trained, "rejected_")
    beta = cfg.post.beta_or_default()
    if objective == "dpo":
        (rw, _), (rl, _) = logps(base[1], ""), logps(base[1], "rejected_")
        reward_w, reward_l = beta * (lw - rw), beta * (ll - rl)
        loss = -log_sigmoid(reward_w - reward_l)
    else:
        reward_w, reward_l = beta * lw / nw, beta * ll / nl
        loss = -log_sigmoid(reward_w - reward_l - cfg.post.gamma)
    np.testing.assert_allclose(record["eval/loss"], loss.mean(), rtol=1e-4)
    np.testing.assert_allclose(record["eval/margin"], (reward_w - reward_l).mean(), atol=1e-5)
    np.testing.assert_allclose(record["eval/accuracy"], (reward_w > reward_l).mean(), atol=1e-6)
    np.testing.assert_allclose(record["eval/chosen_logp"], lw.mean(), rtol=1e-4)
    assert 0 < record["eval/accuracy"] < 1 or objective == "simpo", record
