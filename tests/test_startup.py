"""A refused run leaves the disk as it found it (train/run/startup.py): refusals that can be made
before anything is created are (a vocabulary too small for the data, a local tier directory that
cannot be created, another run's checkpoint directory), and one that comes after the run claimed
its directory (a --resume PATH that is not there) takes back the skeleton it made; a run
directory that existed stays exactly as it was, and a named run gives its runs/<name> back."""

import os

import pytest
from data_files import file_hashes as listing

from errors import UserError
from train.core.config import build
from train.run.loop import Trainer

BASE = {
    "model.preset": "tiny",
    "data.source": "synthetic",
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.steps": 2,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.progress": False,
    "logging.tensorboard": False,
}


def refused(match: str, **over) -> None:
    with pytest.raises(UserError, match=match):
        Trainer(build({**BASE, **over})).fit()


@pytest.mark.parametrize("where", ["new", "existing empty"])
def test_refusals_leave_no_run_dir_skeleton(tmp_path, where):
    run = tmp_path / "a" / "run"  # its parent is new too: nothing of the path may stay
    if where == "existing empty":
        run.mkdir(parents=True)
    text = tmp_path / "corpus.txt"
    text.write_text("plain text, byte-level ids up to 258 " * 200)
    (tmp_path / "file").write_text("")
    before = listing(tmp_path)
    at = {"logging.run_dir": str(run)}
    for match, over in (
        # before anything is created: the data, the local tier, whose the checkpoints are
        (
            r"needs vocab_size >= \d+ but model.vocab_size=100",
            {"data.source": str(text), "model.vocab_size": 100},
        ),
        (
            r"^--checkpoint.local_dir: cannot create .*: Not a directory",
            {"checkpoint.local_dir": str(tmp_path / "file" / "local")},
        ),
        # after the run claimed its directories: the skeleton is taken back
        (r"no such checkpoint directory", {"checkpoint.resume": str(tmp_path / "nope")}),
        (
            r"no such checkpoint directory",
            {
                "checkpoint.resume": str(tmp_path / "nope"),
                "checkpoint.dir": str(tmp_path / "b" / "ck"),
            },
        ),
    ):
        refused(match, **at, **over)
        assert listing(tmp_path) == before, over
        assert os.path.isdir(run) == (where == "existing empty") and not (tmp_path / "b").exists()


def test_a_refused_resume_leaves_an_existing_run_dir_exactly_as_it_was(tmp_path):
    run = tmp_path / "run"
    Trainer(build({**BASE, "logging.run_dir": str(run)})).fit()
    before = listing(run)
    refused(
        r"no such checkpoint directory",
        **{
            "logging.run_dir": str(run),
            "train.steps": 4,
            "checkpoint.resume": str(tmp_path / "nope"),
        },
    )
    # the same files, the same bytes; only the lock file names its latest holder
    after = listing(run)
    assert after.keys() == before.keys()
    assert {k: v for k, v in after.items() if k != ".brigade-lock"} == {
        k: v for k, v in before.items() if k != ".brigade-lock"
    }


def test_a_refused_named_run_gives_its_directory_and_runs_latest_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    older = tmp_path / "runs" / "20260101-000000-tiny-dataN"
    older.mkdir(parents=True)
    (older / "config.json").write_text("{}")
    os.symlink(older.name, tmp_path / "runs" / "latest")
    refused(r"no such checkpoint directory", **{"checkpoint.resume": str(tmp_path / "nope")})
    assert sorted(os.listdir(tmp_path / "runs")) == [older.name, "latest"]
    assert os.readlink(tmp_path / "runs" / "latest") == older.name
