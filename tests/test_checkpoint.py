"""checkpoint/ and the loop's use of it: exact resume on the same mesh, resharding restore onto
fewer devices, a clear error for another model's checkpoint, `python -m checkpoint` inspect and
export, SIGTERM/SIGINT preemption of `python -m train`, and retention (keep, keep_every).

All runs use a constant learning rate (warmup 0, min_lr_ratio 1): the schedule then does not
depend on train.steps, so a 4-step run resumed to 8 steps computes exactly what an 8-step run
does (with the default warm-up + cosine over train.steps, raising --steps changes the schedule).
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_env import cpu_env

from checkpoint.manager import Checkpointer, open_checkpoint
from checkpoint.owner import RECORD
from errors import UserError
from train.core.config import build, from_args
from train.core.setup import abstract_state
from train.run import resume
from train.run.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(8, PYTHONUNBUFFERED="1")
MESH = "data=4,model=2"
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
    "parallelism.mesh": MESH,
}


def make_cfg(run_dir, **over):
    return build({**BASE, "logging.run_dir": str(run_dir), **over})


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 uninterrupted steps on data=4,model=2, saving every 4: the reference losses and the
    step-4 checkpoint that the other tests resume from. That save is asynchronous and the next
    step donates the state's buffers, so resuming from it also checks that save() returned only
    after its device-to-host copy."""
    run_dir = tmp_path_factory.mktemp("straight")
    tr = Trainer(make_cfg(run_dir, **{"checkpoint.every": 4}))
    summary = tr.fit()
    assert summary["exit_code"] == 0 and summary["checkpoint"] == str(run_dir / "checkpoints" / "8")
    return run_dir, [r["loss"] for r in tr.history]


# ------------------------------------------------------------------ (a) exact resume, same mesh


def test_resume_same_mesh_is_bit_identical(straight, tmp_path):
    ref_dir, ref = straight
    # the steps, and the record of which of them this run wrote (checkpoint/owner.py)
    assert sorted(os.listdir(ref_dir / "checkpoints")) == ["4", "8", RECORD]

    first = Trainer(make_cfg(tmp_path, **{"train.steps": 4}))
    first.fit()
    assert [r["loss"] for r in first.history] == ref[:4]
    with open(
        tmp_path / "metrics.jsonl", "a"
    ) as f:  # logged by a run that died after its last save
        f.write('{"step": 5, "loss": 99.0}\n')

    second = Trainer(make_cfg(tmp_path))  # same command, more steps: resume=latest finds step 4
    summary = second.fit()
    assert summary["resumed_from"] == 4 and summary["exit_code"] == 0
    assert [r["step"] for r in second.history] == [5, 6, 7, 8]
    assert [r["loss"] for r in second.history] == ref[4:]  # bit-identical on CPU
    recs = records(tmp_path)  # appended to, with the dead run's step 5 dropped
    assert [r["step"] for r in recs] == list(range(1, 9)) and [r["loss"] for r in recs] == ref
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "8", RECORD]

    again = Trainer(make_cfg(tmp_path)).fit()  # already at --steps: report, train nothing
    assert again["trained_steps"] == 0 and again["steps"] == 8 and again["exit_code"] == 0
    assert len(records(tmp_path)) == 8


# ------------------------------------------------------------------ (b) resharding restore


@pytest.mark.parametrize(
    "mesh,n_devices", [("fsdp=4", 4), ("", 1)], ids=["fsdp4-on-4", "one-device"]
)
def test_resharding_restore(straight, tmp_path, mesh, n_devices):
    ref_dir, ref = straight
    step4 = str(ref_dir / "checkpoints" / "4")
    tr = Trainer(
        make_cfg(tmp_path, **{"parallelism.mesh": mesh, "checkpoint.resume": step4}),
        devices=jax.devices()[:n_devices],
    )
    # The restore reads into the new shardings directly: every array arrives with its target
    # sharding, and each device holds only its own shard.
    state, meta = resume.restore(tr.setup, abstract_state(tr.setup), *open_checkpoint(step4))
    assert (
        meta["mesh"]["data"] == 4 and meta["mesh"]["model"] == 2 and meta["data"]["next_step"] == 4
    )
    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(tr.setup.state_shardings)):
        assert x.sharding == sh and len(x.sharding.device_set) == n_devices
    wq = state.params["blocks"]["attn"]["wq_DNH"]  # [L, D, N, H], D sharded over fsdp
    assert wq.addressable_shards[0].data.shape == (2, 64 // n_devices, 4, 16)
    del state

    summary = tr.fit()
    assert summary["resumed_from"] == 4
    assert [r["step"] for r in tr.history] == [5, 6, 7, 8]
    np.testing.assert_allclose([r["loss"] for r in tr.history], ref[4:], rtol=1e-5)


# ------------------------------------------------------------------ (c) another model's checkpoint


def test_mismatched_model_config_lists_arrays(straight, tmp_path):
    ref_dir, _ = straight
    cfg = make_cfg(tmp_path, **{"model.d_model": 32, "checkpoint.resume": str(ref_dir)})
    with pytest.raises(UserError) as e:
        Trainer(cfg).fit()
    msg = str(e.value)
    assert "does not match this model config" in msg and str(ref_dir / "checkpoints" / "8") in msg
    assert "params/blocks/attn/wk_DKH: checkpoint (2, 64, 2, 16) vs model (2, 32, 2, 8)" in msg
    assert "\n" not in msg


def test_resume_errors(straight, tmp_path):
    ref_dir, _ = straight
    with pytest.raises(UserError, match="no such checkpoint directory"):
        Trainer(make_cfg(tmp_path, **{"checkpoint.resume": str(tmp_path / "missing")})).fit()
    with pytest.raises(UserError, match="holds no committed checkpoint"):
        Trainer(make_cfg(tmp_path / "a", **{"checkpoint.resume": str(tmp_path)})).fit()
    # resume=none must not mix runs
    with pytest.raises(UserError, match="already holds checkpoints"):
        Trainer(make_cfg(ref_dir, **{"checkpoint.resume": "none"})).fit()


# ------------------------------------------------------------------ (d) python -m checkpoint


def run_checkpoint_cli(*args):
    p = subprocess.run(
        [sys.executable, "-m", "checkpoint", *map(str, args)],
        cwd=ROOT,
        env=ENV,
        text=True,
        capture_output=True,
        timeout=120,
    )
    return p.returncode, p.stdout, p.stderr


def test_inspect_and_export_cli(straight, tmp_path):
    ref_dir, _ = straight
    rc, out, err = run_checkpoint_cli("inspect", ref_dir)  # a run dir: its latest step
    assert rc == 0, err
    assert (
        f"checkpoint {ref_dir / 'checkpoints' / '8'}" in out
        and "step: 8 (steps in this directory: 4, 8)" in out
    )
    assert (
        "mesh: data=4,model=2 (8 devices, 1 process)" in out and "data: next step 8, seed 0" in out
    )
    assert "train: steps=8 batch_size=8 seq_len=32" in out and "checkpoint: dir= every=4" in out
    assert f"jax {jax.__version__}" in out and "brigade " in out
    lines = {
        ln.split()[0]: ln.split(None, 1)[1] for ln in out.splitlines() if ln.startswith("  params/")
    }
    assert " ".join(lines["params/embed_VD"].split()) == "(264, 64) float32 66.0 KiB"

    rc, out, err = run_checkpoint_cli("inspect", ref_dir / "checkpoints" / "4", "--json")
    assert rc == 0, err
    info = json.loads(out)
    arrays = {a["name"]: a for a in info["arrays"]}
    assert (
        info["step"] == 4
        and info["meta"]["config"] == make_cfg(ref_dir, **{"checkpoint.every": 4}).to_dict()
    )
    assert info["meta"]["model"]["d_model"] == 64 and info["meta"]["mesh"]["model"] == 2
    assert arrays["step"] == {"name": "step", "shape": [], "dtype": "int32", "bytes": 4}
    assert arrays["opt_state/inner_state/1/0/mu/lm_head_DV"]["shape"] == [64, 264]
    n_params = sum(1 for n in arrays if n.startswith("params/"))

    out_dir = tmp_path / "export"
    rc, out, err = run_checkpoint_cli(
        "export", ref_dir / "checkpoints" / "4", "--params-only", out_dir
    )
    assert rc == 0, err
    exported, step = open_checkpoint(str(out_dir))
    assert step == 4 and [n for n, _, _ in exported.arrays(4)] == sorted(
        n for n in arrays if n.startswith("params/")
    )
    assert len(exported.arrays(4)) == n_params and exported.meta(4)["contents"] == "params"
    original, _ = open_checkpoint(str(ref_dir / "checkpoints" / "4"))
    for a, b in zip(
        jax.tree.leaves(exported.restore_params_to_host(4)),
        jax.tree.leaves(original.restore_params_to_host(4)),
    ):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(UserError, match="parameters only"):
        Trainer(make_cfg(tmp_path / "run", **{"checkpoint.resume": str(out_dir)})).fit()

    for args, needle in (
        (("inspect", tmp_path / "nope"), "no such checkpoint directory"),
        (("export", ref_dir, "--params-only", out_dir), "already exists"),
    ):
        rc, out, err = run_checkpoint_cli(*args)
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ (e) preemption

TRAIN_CMD = [
    "--model",
    "tiny",
    "--model.dtype",
    "float32",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "0",
    "--logging.progress",
    "false",
    "--logging.tensorboard",
    "false",
    "--log-every",
    "1",
    "--steps",
    "100000",
    "--checkpoint.every",
    "1000",
]


def interrupt(run_dir, sig, after_steps: int):
    """Start `python -m train`, send `sig` once it has logged `after_steps` more steps; ->
    (rc, stdout)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "train", *TRAIN_CMD, "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        start = len(records(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and len(
                records(run_dir)
            ) >= start + after_steps:
                break
            time.sleep(0.05)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, err


@pytest.mark.slow
def test_sigterm_saves_and_rerun_resumes(tmp_path):
    rc, out, err = interrupt(tmp_path, signal.SIGTERM, 2)
    assert rc == 143, err[-3000:]
    n = records(tmp_path)[-1]["step"]
    saved = tmp_path / "checkpoints" / str(n)
    assert f"stopped by SIGTERM after step {n}, checkpoint {saved} committed" in out
    ck = Checkpointer(str(tmp_path / "checkpoints"), create=False)
    assert ck.all_steps() == [n] and ck.meta(n)["step"] == n

    rc, out, err = interrupt(tmp_path, signal.SIGINT, 2)  # the same command again
    assert rc == 130, err[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / str(n)} (step {n}," in out
    recs = records(tmp_path)
    m = recs[-1]["step"]
    assert m >= n + 2 and [r["step"] for r in recs] == list(range(1, m + 1))
    assert f"stopped by SIGINT after step {m}" in out and Checkpointer(
        str(tmp_path / "checkpoints"), create=False
    ).all_steps() == [n, m]


# ------------------------------------------------------------------ (f) retention


def test_keep_latest_and_keep_every(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=2, keep_every=4, async_save=True)
    for step in range(1, 11):
        ck.save(step, {"w": jnp.full((4,), float(step))}, {"step": step})
    ck.close()
    expect = [4, 8, 9, 10]  # the latest 2, and the recovery points 4 and 8 forever
    assert sorted(int(d) for d in os.listdir(tmp_path)) == expect
    again = Checkpointer(str(tmp_path), create=False)
    assert again.all_steps() == expect and again.latest_step() == 10
    assert again.meta(8) == {"step": 8}


# ------------------------------------------------------------------ config


def test_checkpoint_flags(tmp_path):
    cfg, _ = from_args(
        [
            "--checkpoint.async",
            "false",
            "--resume",
            "none",
            "--checkpoint.every",
            "0",
            "--checkpoint.keep_every",
            "100",
        ]
    )
    c = cfg.checkpoint
    assert (c.async_save, c.resume, c.every, c.keep, c.keep_every, c.dir) == (
        False,
        "none",
        0,
        3,
        100,
        "",
    )
    assert (
        cfg.to_dict()["checkpoint"]["async"] is False
        and "async_save" not in cfg.to_dict()["checkpoint"]
    )
    y = tmp_path / "c.yaml"
    y.write_text("checkpoint:\n  async: false\n  keep: 5\n")
    assert (
        build({}, str(y)).checkpoint.async_save is False and build({}, str(y)).checkpoint.keep == 5
    )
    with pytest.raises(UserError, match="checkpoint.keep -1: must be an integer >= 0"):
        build({"checkpoint.keep": -1})
    with pytest.raises(
        UserError, match="valid checkpoint options: dir, every, keep, keep_every, async, resume"
    ):
        build({"checkpoint.async_save": False})


def test_init_from_params_on_another_mesh(straight, tmp_path):
    """--init-from: a fresh run (step 0, fresh optimizer) with a checkpoint's parameters, read
    into another mesh's shardings; another model config's checkpoint is refused, naming arrays."""
    from checkpoint.__main__ import export_params

    run_dir, _ = straight
    exported = export_params(str(run_dir / "checkpoints" / "4"), str(tmp_path / "params"))
    saved = Checkpointer(str(tmp_path / "params"), create=False).restore_params_to_host(4)
    tr = Trainer(
        make_cfg(
            tmp_path / "run",
            **{"parallelism.mesh": "fsdp=4,model=2", "checkpoint.init_from": exported},
        )
    )
    state, note = resume.init_from(tr.setup, abstract_state(tr.setup).params, exported)
    assert int(state.step) == 0 and "fresh optimizer" in note
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.params, saved)
    wq = state.params["blocks"]["attn"]["wq_DNH"]
    assert wq.sharding.spec == tr.setup.state_shardings.params["blocks"]["attn"]["wq_DNH"].spec
    other = Trainer(make_cfg(tmp_path / "other", **{"model.d_ff": 128}))
    with pytest.raises(
        UserError, match=r"does not match this model config .*w_up_DF: checkpoint \(2, 64, 192\) vs"
    ):
        resume.init_from(other.setup, abstract_state(other.setup).params, exported)


def test_profile_steps_writes_a_trace(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "--model",
            "tiny",
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--eval-every",
            "0",
            "--train.sample_tokens",
            "0",
            "--logging.progress",
            "false",
            "--logging.tensorboard",
            "false",
            "--run-dir",
            str(tmp_path),
            "--profile.steps",
            "2:4",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "profile: steps 2:4 traced into" in p.stdout, p.stderr[-2000:]
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    data = jax.profiler.ProfileData.from_file(str(traces[0]))
    names = {e.name for plane in data.planes for line in plane.lines for e in line.events}
    assert "train" in names  # the StepTraceAnnotation of the traced steps


def test_resume_converts_between_sync_layouts(straight, tmp_path):
    """The straight run (compression none) resumed with int8 (error feedback on: residuals, clipping
    before the sync): same losses up to the first compressed sync, residuals from zero; that run
    resumed again without compression drops them. A switch to DiLoCo is refused in one line."""
    ref_dir, ref = straight
    ckpt4 = str(ref_dir / "checkpoints" / "4")
    int8 = Trainer(
        make_cfg(
            tmp_path,
            **{
                "comm.compression": "int8",
                "checkpoint.resume": ckpt4,
                "train.steps": 6,
                "checkpoint.every": 2,
            },
        )
    )
    summary = int8.fit()
    assert summary["resumed_from"] == 4 and summary["exit_code"] == 0
    assert int8.history[0]["loss"] == ref[4]  # step 5's loss precedes its (first compressed) sync
    assert max(float(np.abs(np.asarray(r)).max()) for r in jax.tree.leaves(int8.state.residual)) > 0
    plain = Trainer(make_cfg(tmp_path))  # resume=latest: int8's step 6, residuals dropped
    summary = plain.fit()
    assert (
        summary["resumed_from"] == 6 and summary["exit_code"] == 0 and plain.state.residual is None
    )
    assert all(np.isfinite(r["loss"]) for r in plain.history)
    diloco = Trainer(make_cfg(tmp_path / "d", **{"comm.sync_every": 2, "checkpoint.resume": ckpt4}))
    with pytest.raises(
        UserError,
        match=r"checkpoints/4 was written with --comm.compression none --comm.error_feedback"
        r" auto --comm.sync_every 1: DiLoCo's train state .* does not convert",
    ):
        saver = Checkpointer(str(tmp_path / "d" / "checkpoints"))
        resume.resume_point(diloco.setup, abstract_state(diloco.setup), saver)
