"""S3 for real: a local S3-compatible server (moto's, on 127.0.0.1, started here) instead of
fsspec's in-memory stand-in (tests/test_storage.py). A run directory on s3:// goes through s3fs
like any bucket: a run there trains, writes its records and resumes. Checkpoint arrays cannot go
there with orbax-checkpoint 0.12.8 (checkpoint/array_store.py): a --checkpoint.dir on s3:// is
refused before anything is created, where the first save would have failed hours in, after
writing part of the step to a local directory named `s3:`."""

import json
import os

import pytest

from errors import UserError
from train.core.config import build
from train.run.loop import Trainer

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

BUCKET = "brigade-test"
RUN = {
    "model.preset": "tiny",
    "data.source": "synthetic",
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.progress": False,
    "logging.tensorboard": False,
}


@pytest.fixture
def s3(monkeypatch, tmp_path):
    """A bucket on a moto server of this test alone; AWS_* point boto, s3fs and epath at it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    import boto3
    from etils.epath import backend as epath_backend

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    # filesystems of this endpoint: fsspec and epath keep instances, not knowing AWS_ENDPOINT_URL
    s3fs.S3FileSystem.clear_instance_cache()
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    try:
        yield f"s3://{BUCKET}"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        epath_backend.fsspec_backend._get_filesystem.cache_clear()
        server.stop()
        assert os.listdir(tmp_path / "cwd") == []  # nothing written to a local `s3:` directory


@pytest.mark.slow
def test_a_run_directory_on_s3_trains_and_resumes(s3, tmp_path):
    from checkpoint import storage

    run = f"{s3}/runs/a"
    ck = str(tmp_path / "checkpoints")  # the arrays on a local path, the records on S3
    first = Trainer(build({**RUN, "train.steps": 2, "logging.run_dir": run, "checkpoint.dir": ck}))
    first.fit()
    assert {"brigade-run.json", "config.json", "metrics.jsonl", "summary.json"} <= set(
        storage.listdir(run)
    )
    again = Trainer(build({**RUN, "train.steps": 3, "logging.run_dir": run, "checkpoint.dir": ck}))
    again.fit()
    steps = [
        json.loads(ln)["step"] for ln in storage.read_text(f"{run}/metrics.jsonl").splitlines()
    ]
    assert steps == [1, 2, 3]
    resumes = [json.loads(ln) for ln in storage.read_text(f"{run}/resumes.jsonl").splitlines()]
    assert [(r["step"], r["after"]) for r in resumes] == [(2, "clean end")]


def test_a_checkpoint_dir_on_s3_is_refused_before_anything_is_created(s3, tmp_path):
    from checkpoint import storage

    cfg = build({**RUN, "logging.run_dir": str(tmp_path / "run"), "checkpoint.dir": f"{s3}/ck"})
    with pytest.raises(UserError) as e:
        Trainer(cfg).fit()
    line = str(e.value)
    assert line.startswith(f"--checkpoint.dir {s3}/ck: orbax-checkpoint "), line
    assert "Checkpoint path should be absolute" in line and "--checkpoint.dir" in line, line
    assert not (tmp_path / "run").exists() and not storage.exists(f"{s3}/ck")
    # a run directory on s3:// without --checkpoint.dir would keep its checkpoints there too
    cfg = build({**RUN, "logging.run_dir": f"{s3}/runs/b"})
    with pytest.raises(UserError, match=f"^--run-dir {s3}/runs/b/checkpoints: orbax-checkpoint"):
        Trainer(cfg).fit()
    assert not storage.exists(f"{s3}/runs/b")
