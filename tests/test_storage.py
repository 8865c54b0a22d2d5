"""Run directories, checkpoint directories and prepared datasets through checkpoint/storage.py:
local paths as before, and an object store (`gs://`) played by fsspec's in-memory filesystem,
which has no local path at all: a write that bypassed the abstraction would fail or land in the
test's working directory, which every test checks stays empty."""

import json
import os
import sys

import fsspec
import numpy as np
import pytest
from data_files import jsonl_file
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import _registry as registry  # the implementations registered in this process

from checkpoint import storage
from errors import UserError
from train.data.prepare import prepare
from train.data.shards import RangeReadShard
from train.data.sources import load_prepared
from train.run.goodput import Goodput, read_records
from train.run.rundir import (
    MARKER,
    RunDirLock,
    check_writable_run_dir,
    drop_records_after,
    prepare_run_dir,
)
from train.run.sinks import JsonlSink


class FakeGCS(MemoryFileSystem):
    """gs://BUCKET/... held in memory (gcsfs's place in fsspec's registry, for one test)."""

    protocol = ("gs", "gcs")
    store, pseudo_dirs = {}, [""]

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            path = path[len(prefix) :] if path.startswith(prefix) else path
        return MemoryFileSystem._strip_protocol(path)


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    before = {name: registry.get(name) for name in FakeGCS.protocol}
    for name in FakeGCS.protocol:
        fsspec.register_implementation(name, FakeGCS, clobber=True)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    FakeGCS.store.clear()
    FakeGCS.pseudo_dirs[:] = [""]
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    try:
        yield "gs://bucket"
    finally:
        assert os.listdir(tmp_path / "cwd") == []  # nothing went to a local path named like the URL
        for name, cls in before.items():
            if cls is None:
                registry.pop(name, None)
            else:
                fsspec.register_implementation(name, cls, clobber=True)
        epath_backend.fsspec_backend._get_filesystem.cache_clear()


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_files_through_one_abstraction(where, tmp_path, gcs):
    root = str(tmp_path / "root") if where == "local" else f"{gcs}/root"
    assert (
        storage.is_local(root) == (where == "local")
        and storage.basename(storage.join(root, "a")) == "a"
    )
    assert storage.dirname(storage.join(root, "a")) == root and not storage.exists(root)
    storage.makedirs(root)
    log = storage.join(root, "log.txt")
    storage.write_text(log, "one\n")
    storage.write_text(log, "two\n")  # replaced whole, no temporary file left beside it
    storage.append_text(log, "three\n")
    assert storage.read_text(log) == "two\nthree\n" and storage.listdir(root) == ["log.txt"]
    assert storage.read_range(log, 4, 3) == b"thr" and storage.getsize(log) == 10
    lines = storage.AppendLog(storage.join(root, "metrics.jsonl"), upload_every_s=3600)
    lines.write("a\n")
    lines.write("b\n")
    lines.close()
    # a resumed run continues the file
    again = storage.AppendLog(storage.join(root, "metrics.jsonl"))
    again.write("c\n")
    again.close()
    assert storage.read_text(storage.join(root, "metrics.jsonl")) == "a\nb\nc\n"
    storage.remove(log)
    storage.remove(log)  # a missing file is no error
    assert sorted(storage.listdir(root)) == ["metrics.jsonl"]
    with pytest.raises(FileNotFoundError):
        storage.listdir(storage.join(root, "missing"))


def test_a_run_directory_on_an_object_store(gcs, capsys):
    run = f"{gcs}/runs/a"
    with RunDirLock(run):
        pass
    assert "is not locked against a second run" in capsys.readouterr().out
    assert storage.isfile(f"{run}/{MARKER}")
    goodput = Goodput(0.0)
    prepare_run_dir(run, '{"model": {}}\n', None, goodput)
    sink = JsonlSink(run, lambda rec: rec)
    for step in (1, 2, 3):
        sink.log({"step": step, "loss": 1.0 / step})
    sink.close()
    assert [r["step"] for r in read_records(run)] == [1, 2, 3]
    prepare_run_dir(run, '{"model": {}}\n', 2, goodput)  # resumed from step 2: step 3 is redone
    assert [r["step"] for r in read_records(run)] == [1, 2]
    assert json.loads(storage.read_text(f"{run}/resumes.jsonl"))["step"] == 2
    drop_records_after(run, 1)
    assert [r["step"] for r in read_records(run)] == [1]
    storage.write_text(f"{gcs}/theirs/notes.txt", "mine")
    with pytest.raises(UserError, match="not a Brigade run directory"):
        check_writable_run_dir(f"{gcs}/theirs")


def test_a_prepared_dataset_on_an_object_store_is_read_by_ranges(tmp_path, gcs, monkeypatch):
    docs = tmp_path / "docs.jsonl"
    jsonl_file(docs, [f"document {i}: " + "abc" * (i % 7) for i in range(300)])
    local = str(tmp_path / "ds")
    prepare([str(docs)], local, "byte", progress=False)
    # made locally, then uploaded
    prepare([str(docs)], f"{gcs}/ds", "byte", progress=False, shard_tokens=1000)
    # the shards it no longer has go
    prepare([str(docs)], f"{gcs}/ds", "byte", progress=False, overwrite=True)
    assert sorted(storage.listdir(f"{gcs}/ds")) == sorted(os.listdir(local))
    here, there = (
        load_prepared(local, 0.3, verify=True),
        load_prepared(f"{gcs}/ds", 0.3, verify=True),
    )
    assert isinstance(there.train.shards[0], RangeReadShard) and isinstance(
        here.train.shards[0], np.memmap
    )
    rng = np.random.default_rng(0)
    for stream_here, stream_there in ((here.train, there.train), (here.eval, there.eval)):
        v = rng.integers(0, stream_here.n_tokens, size=(4, 33))
        np.testing.assert_array_equal(stream_here.gather(v), stream_there.gather(v))
    shard, reads = there.train.shards[0], []
    monkeypatch.setattr(RangeReadShard, "GAP", 16)
    read_range = storage.read_range
    monkeypatch.setattr(
        storage,
        "read_range",
        lambda p, offset, size: reads.append(size) or read_range(p, offset, size),
    )
    far = np.array([[0, 1, 2], [len(shard) - 3, len(shard) - 2, len(shard) - 1]])
    np.testing.assert_array_equal(shard[far], np.asarray(here.train.shards[0])[far])
    assert reads == [3 * shard.dtype.itemsize] * 2  # two runs of nearby tokens, two small reads


# ------------------------------------------------------------------ a scheme without its package


@pytest.fixture
def without(monkeypatch):
    """-> hide(package): `package` is not installed and fsspec has no filesystem for its schemes."""
    real = storage.importlib.util.find_spec

    def hide(package: str, protocols: tuple[str, ...]) -> None:
        monkeypatch.delitem(sys.modules, package, raising=False)
        for name in protocols:
            monkeypatch.delitem(registry, name, raising=False)
        monkeypatch.setattr(
            storage.importlib.util,
            "find_spec",
            lambda name, *a: None if name == package else real(name, *a),
        )

    return hide


@pytest.mark.parametrize(
    "package, url, words",
    [
        ("gcsfs", "gs://bucket/run", ["pip install gcsfs", "pip install 'brigade[gcs]'"]),
        ("s3fs", "s3://bucket/run", ["pip install s3fs", "pip install 'brigade[s3]'"]),
    ],
)
def test_a_url_whose_package_is_missing_is_one_line(tmp_path, capsys, without, package, url, words):
    from train.cli.main import main as train_main
    from train.data.prepare import main as prepare_main

    without(package, ("gs", "gcs") if package == "gcsfs" else ("s3", "s3a"))
    with pytest.raises(UserError) as e:
        storage.exists(url)
    assert str(e.value).startswith(f"{url}: {url[:5]} paths need the {package} package"), e.value
    (tmp_path / "in.txt").write_text("some text\n")
    for command, argv, flag in [
        (train_main, ["--model", "tiny", "--run-dir", url], "--run-dir"),
        (train_main, ["--model", "tiny", "--checkpoint.dir", url], "--checkpoint.dir"),
        (train_main, ["--model", "tiny", "--data", url, "--run-dir", str(tmp_path / "r")], url),
        (prepare_main, [str(tmp_path / "in.txt"), "--out", url, "--workers", "1"], url),
    ]:
        assert command(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert flag in err and all(w in err for w in words), err


def test_tensorboard_events_on_a_url_name_their_package(monkeypatch, without):
    from train.core.config import build

    monkeypatch.setattr(storage, "require_backend", lambda *a: None)  # s3fs: the test above
    without("boto3", ())
    with pytest.raises(
        UserError,
        match=r"^--logging.tensorboard: TensorBoard events in s3://b/r need the boto3 package,"
        r" which is not installed; pip install boto3 \(or pip install 'brigade\[s3\]'\), or"
        r" --logging.tensorboard false$",
    ):
        build({"logging.run_dir": "s3://b/r"})
    assert not build(
        {"logging.run_dir": "s3://b/r", "logging.tensorboard": False}
    ).logging.tensorboard
