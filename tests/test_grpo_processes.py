"""`python -m train --objective grpo` as 2 processes x 2 CPU devices on 127.0.0.1 (one 4-device
mesh data=2,fsdp=2 whose data axis spans the processes, gloo collectives) logs what 1 process with
4 fake devices logs: the same sampled rollouts (the rewards of every step, equal), the same loss
and gradient norm (float32 reduction order), the same held-out reward eval; two updates a rollout,
so the second update's clipped ratio is compared too. The children and their logs are
tests/test_multiprocess.py's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_grpo_meshes import _prompts_dataset
from test_multiprocess import Children, child_env, free_port

TIMEOUT_S = 150  # normally ~40 s on 2 busy cores; only a hang should reach this


def records(run_dir) -> tuple[list[dict], list[dict]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in recs if "loss" in r], [r for r in recs if "eval/reward_mean" in r]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_sample_score_and_step_as_one(tmp_path):
    flags = [
        "--model",
        "tiny",
        "--model.dtype",
        "float32",
        "--objective",
        "grpo",
        "--data",
        _prompts_dataset(tmp_path),
        "--data.eval_fraction",
        "0.1",
        "--mesh",
        "data=2,fsdp=2",
        "--batch-size",
        "4",
        "--seq-len",
        "12",
        "--steps",
        "4",
        "--lr",
        "1e-2",
        "--train.eps",
        "1e-3",
        "--post.group_size",
        "4",
        "--post.max_new_tokens",
        "3",
        "--post.updates_per_rollout",
        "2",
        "--post.reward",
        "format",
        "--post.reward_pattern",
        "(?s).*[0-9a-e].*",
        "--log-every",
        "1",
        "--eval-every",
        "2",
        "--checkpoint.every",
        "2",
        "--train.sample_tokens",
        "0",
        "--logging.progress",
        "false",
        "--logging.tensorboard",
        "false",
    ]
    port = free_port()
    kids = Children(tmp_path)
    kids.start("single", flags + ["--run-dir", str(tmp_path / "single")], child_env(4))
    for i in range(2):
        kids.start(
            f"proc{i}",
            flags
            + ["--mesh-dcn", "data=2", "--run-dir", str(tmp_path / "multi")]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
            + ["--process-id", str(i)],
            child_env(2),
        )
    kids.wait_all(TIMEOUT_S)
    logs = kids.logs()
    want, want_evals = records(tmp_path / "single")
    got, got_evals = records(tmp_path / "multi")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4], logs
    for key in ("grpo/reward_mean", "grpo/reward_std", "grpo/completion_tokens"):
        assert [r[key] for r in got] == [r[key] for r in want], (key, logs)
    assert 0 < want[-1]["grpo/reward_mean"] < 1, want  # the rewards vary: the updates move
    for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4), ("grpo/ratio_mean", 1e-5)):
        np.testing.assert_allclose(
            [r[key] for r in got], [r[key] for r in want], rtol=rtol, atol=1e-7, err_msg=key
        )
    assert [r["step"] for r in got_evals] == [2, 4], logs
    for g, w in zip(got_evals, want_evals):
        assert g["eval/reward_mean"] == w["eval/reward_mean"], (g, w)
    saved = [d.name for d in (tmp_path / "multi" / "checkpoints").iterdir() if d.name.isdigit()]
    assert sorted(map(int, saved)) == [2, 4], saved
