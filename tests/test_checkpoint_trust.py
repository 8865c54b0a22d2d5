"""Damaged checkpoints are named, never crash: metadata of the wrong shape (ours and Orbax's), a
damaged array data file (one line naming the step and the file, from any reader), a symlinked step
(set aside, never deleted through), and a restore that reads the checkpoint once, not twice."""

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_env import cpu_env
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoint.__main__ import describe
from checkpoint.echoes import _is_echo, quiet_failed_read_echoes
from checkpoint.layout import check_meta
from checkpoint.manager import Checkpointer, UnreadableCheckpoint, open_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(8, PYTHONUNBUFFERED="1")
# the array's side: 256 KiB of random float32, so its data file dominates what a restore reads
N = 256


def abstract():
    mesh = jax.make_mesh((8,), ("data",))
    return {
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
        "params": {
            "w": jax.ShapeDtypeStruct((N, N), jnp.float32, sharding=NamedSharding(mesh, P("data")))
        },
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 2 and 4 of a small sharded state; each test damages its own copy."""
    d = tmp_path_factory.mktemp("saved") / "ck"
    values = np.random.default_rng(0).standard_normal((N, N), dtype=np.float32)
    state = jax.tree.map(
        lambda a, v: jax.device_put(v, a.sharding),
        abstract(),
        {"step": np.int32(4), "params": {"w": values}},
    )
    ck = Checkpointer(str(d), keep=0)
    for step in (2, 4):
        ck.save(step, state, {"step": step, "mesh": {"data": 8}})
    ck.close()
    return d, values


def copy(saved, tmp_path):
    return shutil.copytree(saved[0], tmp_path / "ck", symlinks=True)


def data_file(step_dir):
    """The array's data file (the largest under state/), relative to the step directory."""
    files = [
        os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
    ]
    return os.path.relpath(max(files, key=os.path.getsize), step_dir)


# ------------------------------------------------------------------ metadata of the wrong shape


def test_meta_schema_names_the_field():
    good = {
        "step": 4,
        "seed": 0,
        "mesh": {"data": 8},
        "data": {
            "next_step": 4,
            "seed": 0,
            "source": None,
            "loader": {"next_step": 4, "sources": [{"name": "x"}]},
        },
        "config": {"comm": {"outer_lr": 1}},
        "versions": {"jax": "0.10"},
    }
    assert check_meta(good, "d") is good and check_meta({"step": 8}, "d") == {"step": 8}
    cases = [
        ([], "expected an object, got an array ([])"),
        ({}, "field step: missing"),
        ({"step": True}, "field step: expected an integer, got a boolean (true)"),
        (
            {"step": 4, "mesh": {"data": "8"}},
            'field mesh.data: expected an integer, got a string ("8")',
        ),
        (
            {"step": 4, "config": {"comm": "int8"}},
            "field config.comm: expected an object, got a string",
        ),
        (
            {"step": 4, "data": {"loader": {"sources": [3]}}},
            "field data.loader.sources[0]: expected an object",
        ),
    ]
    for meta, needle in cases:
        with pytest.raises(UnreadableCheckpoint) as e:
            check_meta(meta, "/r/4")
        assert e.value.file == "meta/metadata" and needle in str(e.value), (meta, str(e.value))


@pytest.mark.parametrize("rel", ["meta/metadata", "_CHECKPOINT_METADATA", "state/_METADATA"])
def test_wrong_shape_metadata_is_an_unreadable_step(saved, tmp_path, rel):
    d = copy(saved, tmp_path)
    (d / "4" / rel).write_text("[]")
    ck = Checkpointer(str(d), create=False)  # Orbax alone stops here on a bad _CHECKPOINT_METADATA
    assert ck.all_steps() == [2, 4] and ck.latest_step() == 4
    for read in (ck.check_files, lambda s: ck.restore(s, abstract()), ck.restore_params_to_host):
        with pytest.raises(UnreadableCheckpoint) as e:
            read(4)
        assert e.value.file == rel and "\n" not in str(e.value), str(e.value)
    with pytest.raises(UnreadableCheckpoint, match=f"file {rel}: "):  # python -m checkpoint inspect
        describe(str(d))
    assert ck.meta(2) == {"step": 2, "mesh": {"data": 8}}  # the other steps read as before
    ck.set_aside(4)
    assert ck.all_steps() == [2] and (d / "4.unreadable").is_dir()


# ------------------------------------------------------------------ damaged array data


@pytest.mark.parametrize("damage", ["truncate", "delete", "corrupt"])
def test_damaged_data_file_is_named_by_every_reader(saved, tmp_path, damage):
    d = copy(saved, tmp_path)
    rel = data_file(d / "4")
    path = d / "4" / rel
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "delete":
        path.unlink()
    else:  # same size, a damaged chunk header: only decoding the chunk tells
        path.write_bytes(bytes(b ^ 0xFF for b in raw[:16]) + raw[16:])
    ck, step = open_checkpoint(str(d / "4"))
    readers = {
        "restore": lambda: ck.restore(step, abstract()),
        "restore_params": lambda: ck.restore_params(step, abstract()["params"]),
        "restore_params_to_host": lambda: ck.restore_params_to_host(step),
    }
    for name, read in readers.items():
        with pytest.raises(UnreadableCheckpoint) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(f"checkpoint {d / '4'} is unreadable (file {rel}: "), (name, msg)
        assert "\n" not in msg and "pybind11" not in msg and "Encountered error" not in msg, (
            name,
            msg,
        )
    if damage != "corrupt":
        assert f"file {rel}: {'missing' if damage == 'delete' else 'truncated'}" in msg


def test_restore_reads_the_data_once(saved, tmp_path):
    """A restore reads each stored value once: no full verification pass before it (that pass
    read the whole checkpoint on every process, which at scale is checkpoint x hosts of I/O)."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs /proc/self/io to count the bytes read")

    def bytes_read():
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar"))

    d = copy(saved, tmp_path)
    ck = Checkpointer(str(d), create=False)
    ck.restore(2, abstract())  # first use: Orbax sets up, Python imports what it needs
    stored = sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d / "4" / "state") for f in fs
    )
    before = bytes_read()
    state, _ = ck.restore(4, abstract())
    assert bytes_read() - before < 1.5 * stored, (bytes_read() - before, stored)
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), saved[1])


def test_a_cross_process_timeout_is_not_a_damaged_checkpoint(saved, tmp_path, monkeypatch):
    """A collective that timed out while processes read a step (a slow peer) says nothing about the
    files: it reaches the caller as it is (the CLI names it and exits 5), and the step is never
    called unreadable, so auto-resume cannot set an intact checkpoint aside. A real read failure
    still is."""
    d = copy(saved, tmp_path)
    ck = Checkpointer(str(d), create=False)
    timeout = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo AllGather failed: [unbound_buffer.cc:132] Timed out"
        " waiting 10000ms for send operation to complete"
    )
    for err, caught in (
        (timeout, jax.errors.JaxRuntimeError),
        (ValueError("bad bytes"), UnreadableCheckpoint),
    ):

        def fail(*a, err=err, **k):
            raise err

        monkeypatch.setattr(ck._mngr, "restore", fail)
        with pytest.raises(caught) as e:
            ck.restore(4, abstract())
        assert (e.value is timeout) == (caught is not UnreadableCheckpoint)
    assert ck.all_steps() == [2, 4]


def test_failed_read_echoes_are_dropped(monkeypatch):
    """A failed restore leaves reads in flight; they fail or complete after the one line that named
    the file, each with a traceback (Orbax's closed event loop, its read coroutines, asyncio's
    unretrieved futures): those echoes are dropped, nothing else."""
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError) as closed:
        loop.call_soon_threadsafe(print)

    def unraisable(e):
        return types.SimpleNamespace(exc_value=e, exc_traceback=e.__traceback__)

    orbax_echo = Exception(
        "Encountered error while reading array index: (slice(0, 8, 1),). See full TensorStore"
    )
    assert _is_echo(unraisable(closed.value)) and _is_echo(unraisable(orbax_echo))
    assert not _is_echo(unraisable(RuntimeError("Event loop is closed")))  # raised elsewhere: kept
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    quiet_failed_read_echoes()
    quiet_failed_read_echoes()  # installed once
    other = ValueError("Encountered error while reading array index")
    for e in (closed.value, orbax_echo, other):
        sys.unraisablehook(unraisable(e))
    assert [u.exc_value for u in seen] == [other]

    # the failed reads' futures, which nobody awaited, are logged by asyncio when collected
    kept, log = [], logging.getLogger("asyncio")
    handler = logging.Handler()
    handler.emit = kept.append
    log.addHandler(handler)
    try:
        for e in (
            ValueError("OUT_OF_RANGE: Error reading ... [tensorstore_spec='{}']"),
            ValueError("a real one"),
        ):
            log.error(
                "Future exception was never retrieved\nfuture: <Future>",
                exc_info=(type(e), e, None),
            )
    finally:
        log.removeHandler(handler)
    assert [str(r.exc_info[1]) for r in kept] == ["a real one"]


# ------------------------------------------------------------------ a symlinked step


def test_symlinked_step_is_set_aside_and_never_deleted(saved, tmp_path, capsys):
    d = copy(saved, tmp_path)
    target = shutil.copytree(d / "2", tmp_path / "elsewhere" / "1")
    before = sorted(p.name for p in target.rglob("*"))
    os.symlink(target, d / "1")
    assert Checkpointer(str(d), create=False).all_steps() == [
        1,
        2,
        4,
    ]  # a reader may read through it

    ck = Checkpointer(str(d), keep=2)  # its saves remove old steps: 1 would be the first to go
    out = capsys.readouterr().out
    assert ck.all_steps() == [2, 4]
    assert (
        f"warning: checkpoint step {d / '1'} is a symbolic link (to {target}); set aside as"
        f" {d / '1.symlink'}"
    ) in out and len(out.strip().splitlines()) == 1
    for step in (6, 8):
        ck.save(step, {"w": jnp.ones(4)}, {"step": step})
    ck.close()
    assert sorted(os.listdir(d)) == ["1.symlink", "6", "8"]
    assert (
        os.readlink(d / "1.symlink") == str(target)
        and sorted(p.name for p in target.rglob("*")) == before
    )


# ------------------------------------------------------------------ the real process

TRAIN = [
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
    "--checkpoint.every",
    "2",
]


def run(module, *args):
    p = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=ENV,
        text=True,
        capture_output=True,
        timeout=600,
    )
    return p.returncode, p.stdout, p.stderr


def test_orbax_error_records_go_to_a_file_the_line_names(saved, tmp_path, caplog, capfd):
    """A --resume of a step whose _CHECKPOINT_METADATA is garbage: Orbax logs its own error
    records (several) before Brigade's one line; none reaches the screen or a log handler, the
    line names the file that holds them (a refused run's directory is taken back: the system's
    temporary directory then)."""
    from errors import UserError
    from train.core.config import build
    from train.run.loop import Trainer

    ck = copy(saved, tmp_path)
    (ck / "4" / "_CHECKPOINT_METADATA").write_text("garbage{{")
    cfg = build(
        {
            "model.preset": "tiny",
            "data.source": "synthetic",
            "logging.run_dir": str(tmp_path / "run"),
            "checkpoint.resume": str(ck / "4"),
        }
    )
    caplog.set_level(logging.INFO)
    with pytest.raises(UserError) as e:
        Trainer(cfg).fit()
    line = str(e.value)
    assert line.startswith(f"checkpoint {ck / '4'} is unreadable (file _CHECKPOINT_METADATA:"), line
    report = line.rsplit("(Orbax's report: ", 1)[1].rstrip(")")
    assert "Failed to json parse Metadata file" in open(report).read()
    os.remove(report)
    assert not any("orbax" in r.pathname and r.levelno >= logging.ERROR for r in caplog.records)
    assert "ERROR:absl" not in capfd.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_damaged_metadata_in_real_runs(tmp_path):
    from train.core.config import from_args
    from train.run.loop import Trainer

    trained = tmp_path / "trained"
    cfg, _ = from_args([*TRAIN, "--steps", "4", "--run-dir", str(trained)])
    Trainer(cfg).fit()  # in-process: one compile fewer than a subprocess

    # (a) auto-resume, more steps: step 4's metadata is `[]`; step 2 is used, exit 0
    run_a = shutil.copytree(trained, tmp_path / "a")
    (run_a / "checkpoints" / "4" / "meta" / "metadata").write_text("[]")
    rc, out, err = run("train", *TRAIN, "--steps", "6", "--run-dir", run_a)
    assert rc == 0, err[-3000:]
    ck = run_a / "checkpoints"
    assert (
        f"checkpoint {ck / '4'} is unreadable"
        " (file meta/metadata: expected an object, got an array ([]))" in out
    ) and f"resumed from {ck / '2'} (step 2," in out, out
    assert (ck / "4.unreadable").is_dir() and sorted(
        int(s) for s in os.listdir(ck) if s.isdigit()
    ) == [2, 4, 6]

    # (b) --resume of a step whose metadata has a field of the wrong type: exit 2, one line
    run_b = shutil.copytree(trained, tmp_path / "b")
    meta_path = run_b / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["config"]["comm"]["sync_every"] = "2"
    meta_path.write_text(json.dumps(meta))
    rc, out, err = run(
        "train",
        *TRAIN,
        "--steps",
        "6",
        "--run-dir",
        tmp_path / "other",
        "--resume",
        run_b / "checkpoints" / "4",
    )
    assert rc == 2 and err.strip().splitlines() == [
        f"error: checkpoint {run_b / 'checkpoints' / '4'} is unreadable (file meta/metadata: field"
        f' config.comm.sync_every: expected an integer, got a string ("2"))'
    ], err

    # (c) inspect of the run whose newest step's metadata is `[]`: one line, exit 2
    run_c = shutil.copytree(trained, tmp_path / "c")
    (run_c / "checkpoints" / "4" / "meta" / "metadata").write_text("[]")
    rc, out, err = run("checkpoint", "inspect", run_c)
    assert rc == 2 and err.strip().splitlines() == [
        f"error: checkpoint {run_c / 'checkpoints' / '4'} is unreadable"
        " (file meta/metadata: expected an object, got an array ([]))"
    ], err
