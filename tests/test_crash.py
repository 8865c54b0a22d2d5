"""Crash safety of checkpoints: SIGKILL of `python -m train` at seeded random moments (also in the
middle of an asynchronous save) never leaves a half-written checkpoint that a restart would use,
and the restarted runs end with exactly the losses of an uninterrupted run; a damaged checkpoint
(a truncated or deleted file) is reported with its step directory and file, and auto-resume
falls back to the previous intact step without deleting anything."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from cpu_env import cpu_env

from errors import UserError
from train.core.config import build
from train.run.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(8, PYTHONUNBUFFERED="1")
STEPS, EVERY = 30, 3
CMD = [
    "--model",
    "tiny",
    "--model.dtype",
    "float32",
    "--steps",
    str(STEPS),
    "--checkpoint.every",
    str(EVERY),
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "0",
    "--logging.progress",
    "false",
    "--logging.tensorboard",
    "false",
    "--train.warmup_steps",
    "0",
    "--train.min_lr_ratio",
    "1",
]


def records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line still being written
            pass
    return [r for r in out if "loss" in r]


def committed(ck_dir):
    """The steps a restart may resume from: step directories that Orbax renamed into place
    (`<step>.orbax-checkpoint-tmp*` are half-written saves)."""
    if not os.path.isdir(ck_dir):
        return []
    return sorted(int(d) for d in os.listdir(ck_dir) if d.isdigit())


def start(run_dir, log):
    return subprocess.Popen(
        [sys.executable, "-m", "train", *CMD, "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def resumed_step(text):
    m = re.search(r"resumed from (\S+) \(step (\d+),", text)
    return (m.group(1), int(m.group(2))) if m else None


def kill_step(p, run_dir, ck_dir, base, mode, rng):
    """Wait until this run has committed a checkpoint past `base`, then until the loop reaches the
    kill point: the next save's step (save) or 0-2 steps further (step); plus a random delay.
    Returns the step waited for, or None when the run reached its last step first."""
    deadline = time.monotonic() + 180
    target = None
    while p.poll() is None and time.monotonic() < deadline:
        if target is None and max(committed(ck_dir), default=0) > base:
            newest = max(committed(ck_dir))
            target = newest + EVERY if mode == "save" else newest + rng.randint(0, 2)
        logged = max((r["step"] for r in records(run_dir)), default=0)
        if target is not None and logged >= target:
            break
        if logged >= STEPS - 1:
            return None
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.2) if mode == "save" else rng.uniform(0.0, 0.05))
    return None if p.poll() is not None or target is None or target >= STEPS else target


def startup_kill(p, run_dir, delay):
    """Wait `delay` seconds or until the run logs its first step, whichever comes first: a warm
    compilation cache can bring a run past its startup, and far into its steps, within a fixed
    delay (the runs then left too few steps to kill)."""
    deadline = time.monotonic() + delay
    while p.poll() is None and time.monotonic() < deadline and not records(run_dir):
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_matches_uninterrupted(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ck_dir = run_dir / "checkpoints"
    with open(tmp_path / "ref.log", "w") as log:
        assert start(ref_dir, log).wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[
            -3000:
        ]
    ref = [r["loss"] for r in records(ref_dir)]
    assert len(ref) == STEPS

    rng = random.Random(20261130)
    # startup: during import/restore/compile; save: right after a save began (the step that
    # triggers it is logged just before save() is called); step: anywhere in the steady loop.
    # A save/step kill waits for this run's first new checkpoint to be committed, so every run
    # makes progress however slowly the machine commits (asynchronous saves can lag several steps
    # behind the loop when the cores are busy).
    plan = ["startup", "save", "step", "save"]
    kills, resumes = [], 0
    for i, mode in enumerate(plan + ["finish"]):
        before = committed(ck_dir)
        log_path = tmp_path / f"run{i}.log"
        with open(log_path, "w") as log:
            p = start(run_dir, log)
            try:
                if mode == "startup":
                    startup_kill(p, run_dir, rng.uniform(1.0, 5.0))
                elif mode in ("save", "step"):
                    kill_at = kill_step(p, run_dir, ck_dir, max(before, default=0), mode, rng)
                    # it reached the last step before its kill: the plan ends here
                    if kill_at is None:
                        mode = "finish"
                if mode != "finish":
                    assert p.poll() is None, (
                        f"run {i} ended before its kill: " + log_path.read_text()[-3000:]
                    )
                    p.send_signal(signal.SIGKILL)
                rc = p.wait(timeout=300)
            finally:
                if p.poll() is None:
                    p.kill()
        text = log_path.read_text()
        kills.append((mode, before, [d for d in os.listdir(ck_dir)] if ck_dir.is_dir() else []))
        if mode == "finish":
            assert rc == 0, text[-3000:]
        else:
            assert rc == -signal.SIGKILL
        assert "unreadable" not in text, text[-3000:]
        got = resumed_step(text)
        resumes += got is not None
        if before:  # it must have resumed from the newest committed step, never a tmp one
            if mode == "finish":
                assert got is not None, text[-3000:]
            if got is not None:
                assert got == (str(ck_dir / str(before[-1])), before[-1]), (got, before, kills)
        else:
            assert got is None, text[-3000:]
        if mode == "finish":
            break

    print("kills (mode, committed steps before the run, checkpoint dir after it):", kills)
    assert sum(1 for _, before, _ in kills if before) >= 3, kills  # most restarts really resumed
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), kills
    assert [r["loss"] for r in recs] == ref  # bit-identical on CPU
    assert committed(ck_dir)[-1] == STEPS
    # goodput carried across the attempts: every resume counted, the work after each checkpoint lost
    last = recs[-1]
    assert (
        last["restarts"] == resumes and last["recomputed_steps"] >= 0 and last["time_lost_s"] > 0
    ), last
    assert last["time_total_s"] > sum(r["time_total_s"] for r in records(ref_dir)[-1:]), last


# ------------------------------------------------------------------ damaged checkpoints

BASE = {
    "model.preset": "tiny",
    "model.dtype": "float32",
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.warmup_steps": 0,
    "train.min_lr_ratio": 1.0,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.log_every": 1,
    "logging.progress": False,
    "logging.tensorboard": False,
    "parallelism.mesh": "data=4,model=2",
    "checkpoint.every": 3,
}


def make_cfg(run_dir, **over):
    return build({**BASE, "logging.run_dir": str(run_dir), **over})


def truncate_largest_data_file(step_dir):
    d = os.path.join(step_dir, "state", "d")
    name = max(os.listdir(d), key=lambda n: os.path.getsize(os.path.join(d, n)))
    path = os.path.join(d, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return f"state/d/{name}"


def test_damaged_checkpoint_falls_back_and_explicit_resume_names_the_file(tmp_path, capsys):
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    first = Trainer(make_cfg(run_dir, **{"train.steps": 6}))
    first.fit()
    ref = [r["loss"] for r in first.history]
    assert committed(ck) == [3, 6]

    # (1) auto-resume: the truncated step 6 is reported and set aside; step 3 is used
    bad_file = truncate_largest_data_file(ck / "6")
    capsys.readouterr()
    second = Trainer(make_cfg(run_dir, **{"train.steps": 9}))
    summary = second.fit()
    out = capsys.readouterr().out
    assert summary["resumed_from"] == 3 and summary["exit_code"] == 0
    assert f"checkpoint {ck / '6'} is unreadable (file {bad_file}: " in out
    assert (
        f"unreadable step 6 set aside as {ck / '6.unreadable'} (nothing deleted);"
        " resuming from step 3" in out
    )
    assert [r["step"] for r in second.history] == [4, 5, 6, 7, 8, 9]
    assert [r["loss"] for r in second.history][:3] == ref[3:]  # bit-identical to the first run
    # kept, not deleted
    assert committed(ck) == [3, 6, 9] and (ck / "6.unreadable" / "state").is_dir()

    # (2) explicit --resume of a damaged step: exit 2, one line naming the step dir and the file
    bad_file = truncate_largest_data_file(ck / "9")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            *CMD,
            "--steps",
            "12",
            "--run-dir",
            str(tmp_path / "other"),
            "--resume",
            str(ck / "9"),
        ],
        cwd=ROOT,
        env=ENV,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and f"checkpoint {ck / '9'} is unreadable (file {bad_file}: " in lines[0]
    ), p.stderr

    # (3) a deleted manifest and a truncated metadata file: named too, without reading arrays
    os.remove(ck / "3" / "state" / "manifest.ocdbt")
    with open(ck / "6" / "state" / "_METADATA", "r+b") as f:
        f.truncate(10)
    with pytest.raises(UserError) as e:
        Trainer(
            make_cfg(tmp_path / "third", **{"train.steps": 12, "checkpoint.resume": str(ck / "3")})
        ).fit()
    assert str(e.value).startswith(
        f"checkpoint {ck / '3'} is unreadable (file state/manifest.ocdbt: missing)"
    )

    # (4) no intact step left: auto-resume refuses in one line instead of silently starting over
    before = sorted(os.listdir(ck))
    with pytest.raises(UserError) as e:
        Trainer(make_cfg(run_dir, **{"train.steps": 12})).fit()
    msg = str(e.value)
    assert msg.startswith(f"no intact checkpoint in {ck}: step 9: {bad_file}: ") and "\n" not in msg
    assert (
        "step 6: state/_METADATA: not valid JSON" in msg
        and "step 3: state/manifest.ocdbt: missing" in msg
    )
    assert sorted(os.listdir(ck)) == before  # nothing deleted or renamed
