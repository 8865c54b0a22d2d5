"""The local checkpoint tier (--checkpoint.local_dir, checkpoint/tiers.py): saved every
--checkpoint.local_every steps next to the persistent saves; resume takes the newest intact step
across both tiers, bit-identical to an uninterrupted run; a damaged or lost local copy falls back
to the persistent tier; with two processes they agree on one step, a process whose local tier
is gone takes its shards from the copy its neighbour kept (checkpoint/peer_copy.py), and without
that copy they all resume from the persistent one.

A run "crashes" after its last local save by deleting its final persistent step (the state a
SIGKILL between the two saves leaves); the drill kills real processes. Constant learning rate
(warmup 0, min_lr_ratio 1), as in tests/test_checkpoint.py.
"""

import os
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from test_multiprocess import FLAGS, TIMEOUT_S, Children, child_env, free_port, losses

from checkpoint.__main__ import describe
from checkpoint.peer_copy import peer_dir
from checkpoint.tiers import process_dir
from errors import UserError
from train.core.config import build
from train.core.setup import abstract_state
from train.run import resume
from train.run.loop import Trainer
from train.run.startup import open_checkpoints

BASE = {
    "model.preset": "tiny",
    "model.dtype": "float32",
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.steps": 8,
    "train.warmup_steps": 0,
    "train.min_lr_ratio": 1.0,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.log_every": 1,
    "logging.progress": False,
    "logging.tensorboard": False,
    "parallelism.mesh": "data=4,model=2",
    "checkpoint.every": 4,
    "checkpoint.local_every": 3,
}


def make_cfg(tmp_path, **over):
    return build(
        {
            **BASE,
            "logging.run_dir": str(tmp_path / "run"),
            "checkpoint.local_dir": str(tmp_path / "local"),
            **over,
        }
    )


def committed(d) -> list[int]:
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def truncate_largest_data_file(step_dir) -> None:
    d = os.path.join(step_dir, "state", "d")
    path = max((os.path.join(d, n) for n in os.listdir(d)), key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def resume_after_crash(tmp_path, capsys) -> tuple[Trainer, dict, list[float], str]:
    """Delete the final persistent step (a crash after step 7), run the same config again ->
    (the trainer, its summary, its losses, what it printed)."""
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "8")
    capsys.readouterr()
    tr = Trainer(make_cfg(tmp_path))
    summary = tr.fit()
    return tr, summary, [r["loss"] for r in tr.history], capsys.readouterr().out


def same_params(a: Trainer, b: Trainer) -> bool:
    return all(
        np.array_equal(x, y)
        for x, y in zip(
            jax.tree.leaves(jax.device_get(a.state.params)),
            jax.tree.leaves(jax.device_get(b.state.params)),
            strict=True,
        )
    )


def test_local_tier_resume_is_exact_and_falls_back(tmp_path, capsys):
    local = Path(process_dir(tmp_path / "local", 0))
    ref = Trainer(make_cfg(tmp_path))
    assert ref.fit()["exit_code"] == 0
    ref_losses = [r["loss"] for r in ref.history]
    # local every 3 (3, 6), persistent every 4 and at the end (4, 8): one tier per step
    assert committed(tmp_path / "run" / "checkpoints") == [4, 8] and committed(local) == [3, 6]
    info = describe(str(tmp_path / "local"))  # `python -m checkpoint inspect LOCAL_DIR`
    assert info["path"] == str(local / "6") and info["meta"]["local"]["process"] == 0

    # (1) the newest step is local: resumed from it, bit-identical losses and parameters
    tr, summary, got, out = resume_after_crash(tmp_path, capsys)
    assert summary["resumed_from"] == 6 and f"resumed from {local / '6'} (step 6" in out
    assert got == ref_losses[6:] and same_params(tr, ref)
    # (2) the local step is damaged: one warning, set aside, the persistent step 4 instead
    truncate_largest_data_file(local / "6")
    tr, summary, got, out = resume_after_crash(tmp_path, capsys)
    assert summary["resumed_from"] == 4 and got == ref_losses[4:] and same_params(tr, ref)
    assert (
        f"checkpoint {local / '6'} is unreadable" in out
        and f"set aside as {local / '6.unreadable'}" in out
    )
    # (3) the local tier is gone (a lost disk): the persistent tier, again exact
    shutil.rmtree(tmp_path / "local")
    tr, summary, got, out = resume_after_crash(tmp_path, capsys)
    assert summary["resumed_from"] == 4 and got == ref_losses[4:] and same_params(tr, ref)
    assert committed(local) == [6]  # saved again, into a fresh local tier


def test_bad_local_dir_is_one_line(tmp_path):
    with pytest.raises(
        UserError, match=r"^--checkpoint.local_every 0: must be >= 1 when --checkpoint.local_dir"
    ):
        make_cfg(tmp_path, **{"checkpoint.local_every": 0})
    (tmp_path / "file").write_text("")
    for local, why in (
        (tmp_path / "run" / "checkpoints" / "fast", "inside the persistent checkpoint directory"),
        (tmp_path / "file" / "local", "cannot create"),
    ):
        tr = Trainer(make_cfg(tmp_path, **{"checkpoint.local_dir": str(local)}))
        with pytest.raises(UserError) as e:
            # where a run opens its tiers, before any step
            resume.resume_point(tr.setup, abstract_state(tr.setup), open_checkpoints(tr.cfg))
        assert str(e.value).startswith("--checkpoint.local_dir") and why in str(e.value)
        assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_agree_on_the_local_step_or_the_persistent_one(tmp_path):
    """2 processes x 4 devices, persistent saves every 4 steps, local every step. Both hang at
    step 7 (after the local save of step 6); process 1 is SIGKILLed and process 0 ends itself
    (a lost peer: 5). Then, at once: (A) the same run restarts and resumes from local step 6;
    (B) a copy of it whose process 1 lost its local disk (its copy and the copy it kept of
    process 0) resumes from local step 6 too: process 0 kept a copy of process 1's shards
    (checkpoint/peer_copy.py); (C) the same loss with --checkpoint.local_peer false resumes from
    persistent step 4. A's and B's steps 7-10 equal C's and C's 5-6 the killed run's: every tier
    restores exactly."""

    def start(kids: Children, tag: str, run: str, env: dict, *extra: str) -> None:
        port = free_port()
        for i in range(2):
            kids.start(
                f"{tag}{i}",
                FLAGS
                + list(extra)
                + [
                    "--mesh-dcn",
                    "data=2",
                    "--steps",
                    "10",
                    "--train.sample_tokens",
                    "0",
                    "--checkpoint.every",
                    "4",
                    "--checkpoint.local_every",
                    "1",
                    "--run-dir",
                    str(tmp_path / run),
                    "--checkpoint.local_dir",
                    str(tmp_path / f"{run}-local"),
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                ],
                env,
            )

    env = child_env(4)
    kids = Children(tmp_path)
    start(kids, "first", "a", {**env, "BRIGADE_INJECT_HANG_STEPS": "7"})
    held = [Path(process_dir(tmp_path / "a-local", i)) for i in range(2)]
    # two compiles (process 1 never hits the compilation cache) and six steps: on 2 cores shared
    # with other drills this took over TIMEOUT_S once, so the wait for local step 6 gets twice that
    # and the wait is for the local tier to hold exactly 5 and 6: the save of 6 commits before step
    # 4 is removed (keep 2), so a kill right after the commit could still find 4 there
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while (
        not all(committed(d) == [5, 6] for d in held)
        and time.monotonic() < deadline
        and all(p.poll() is None for _, p, _, _ in kids.procs)
    ):
        time.sleep(0.2)
    (_, p0, _, _), (_, p1, _, _) = kids.procs
    p1.send_signal(signal.SIGKILL)  # one host lost; process 0 notices it (exit 5)
    code0 = p0.wait(timeout=TIMEOUT_S)
    kids.kill()
    logs = kids.logs()
    assert code0 == 5, logs
    assert all(committed(d) == [5, 6] for d in held) and committed(
        tmp_path / "a" / "checkpoints"
    ) == [4], logs
    killed = losses(tmp_path / "a", logs)
    assert killed["step"] == [1, 2, 3, 4, 5, 6], logs

    for copy in ("b", "c"):  # process 1 lost its local disk: its copy and the one it kept
        shutil.copytree(tmp_path / "a", tmp_path / copy)
        shutil.copytree(tmp_path / "a-local", tmp_path / f"{copy}-local")
        shutil.rmtree(process_dir(tmp_path / f"{copy}-local", 1))
        shutil.rmtree(peer_dir(tmp_path / f"{copy}-local", 1))
    kids = Children(tmp_path)
    start(kids, "A", "a", env)
    start(kids, "B", "b", env)
    start(kids, "C", "c", env, "--checkpoint.local_peer", "false")
    kids.wait_all(3 * TIMEOUT_S)
    logs = kids.logs()
    out = {t: (tmp_path / f"{t}0.stdout").read_text() for t in "ABC"}
    assert f"resumed from {held[0] / '6'} (step 6" in out["A"], logs
    b_local = Path(process_dir(tmp_path / "b-local", 0))
    assert f"resumed from {b_local / '6'} (step 6" in out["B"], logs
    assert f"resumed from {tmp_path / 'c' / 'checkpoints' / '4'} (step 4" in out["C"], logs
    a, b, c = (losses(tmp_path / t, logs) for t in "abc")
    assert a["step"] == b["step"] == c["step"] == list(range(1, 11)), logs
    assert c["loss"][4:6] == killed["loss"][4:6], logs
    assert a["loss"][6:] == b["loss"][6:] == c["loss"][6:], logs
