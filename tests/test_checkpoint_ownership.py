"""A checkpoint directory is its run's own (checkpoint/owner.py, train/run/ownership.py): another
run's is refused in one line unless adopted (--checkpoint.adopt true), and retention
(--checkpoint.keep) deletes only the steps the saving run wrote, never another run's."""

import json
import os
import shutil

import numpy as np
import pytest
from data_files import file_hashes as listing

from checkpoint.manager import Checkpointer
from checkpoint.owner import RECORD, read_record
from errors import UserError
from train.core.config import build
from train.run.loop import Trainer
from train.run.ownership import checkpoint_owner
from train.run.rundir import MARKER


def _steps(directory) -> list[int]:
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _save(ck: Checkpointer, steps) -> None:
    for step in steps:
        ck.save(step, {"w": np.full((4,), float(step), np.float32)}, {"step": step})
    ck.close()


def _other_run(tmp_path, steps=(10, 20, 30)):
    """Another run's directory (its marker) with its checkpoints/ holding `steps`, saved as it
    saves them (its owner record) -> (its run dir, its checkpoint dir)."""
    run = tmp_path / "other"
    (run / "checkpoints").mkdir(parents=True)
    (run / MARKER).write_text("{}\n")
    owner = checkpoint_owner(str(run), str(run / "checkpoints"), adopt=False, writer=True)
    _save(Checkpointer(str(run / "checkpoints"), keep=0, run_owner=owner), steps)
    return run, run / "checkpoints"


def test_another_runs_checkpoint_dir_is_refused_in_one_line_naming_the_flag(tmp_path):
    run, ck = _other_run(tmp_path)
    before = listing(run)
    mine = tmp_path / "mine"
    with pytest.raises(UserError) as e:
        checkpoint_owner(str(mine), str(ck), adopt=False, writer=True)
    line = str(e.value)
    assert line.startswith(f"--checkpoint.dir {ck} belongs to another run ({run}; it holds steps")
    assert "--checkpoint.adopt true" in line and "\n" not in line, line
    # through a run: refused before its run directory exists, the other run untouched
    cfg = build(
        {
            "model.preset": "tiny",
            "data.source": "synthetic",
            "logging.run_dir": str(mine),
            "checkpoint.dir": str(ck),
        }
    )
    with pytest.raises(UserError, match=r"belongs to another run .*--checkpoint.adopt true"):
        Trainer(cfg).fit()
    assert not mine.exists() and listing(run) == before
    # without a record (a directory written before records existed): its run directory tells
    os.remove(ck / RECORD)
    with pytest.raises(UserError, match=f"belongs to another run \\({run};"):
        checkpoint_owner(str(mine), str(ck), adopt=False, writer=True)


def test_retention_never_deletes_steps_the_run_did_not_write(tmp_path):
    """An adopted directory keeps the other run's steps whatever --checkpoint.keep says; the
    adopting run's own steps rotate; the record then names the adopter, so the first run is
    refused there in turn (both would save into it)."""
    run, ck = _other_run(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / MARKER).write_text("{}\n")
    owner = checkpoint_owner(str(mine), str(ck), adopt=True, writer=True)
    assert owner.written == set() and owner.adopted_from == str(run)
    _save(Checkpointer(str(ck), keep=1, keep_every=0, run_owner=owner), (40, 50, 60))
    assert _steps(ck) == [10, 20, 30, 60]  # another run's three, and this run's newest
    record = read_record(str(ck))
    assert record["run_dir"] == str(mine) and record["written"] == [40, 50, 60]
    assert record["adopted_from"] == str(run)
    with pytest.raises(UserError, match=f"belongs to another run \\({mine};"):
        checkpoint_owner(str(run), str(ck), adopt=False, writer=True)
    # a record is about the directory it was written in: a copy's steps are the copy's own
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    owner = checkpoint_owner(str(copy), str(copy / "checkpoints"), adopt=False, writer=True)
    assert owner.written == {10, 20, 30, 60} and owner.adopted_from == ""


def test_a_runs_own_directory_keeps_its_rotation(tmp_path):
    """The run's own <run-dir>/checkpoints: without a record (an older run) its steps are its
    own and rotate as before; a standalone directory's earlier steps are kept and said so."""
    run = tmp_path / "run"
    _save(Checkpointer(str(run / "checkpoints"), keep=0), (1, 2, 3))  # before records existed
    owner = checkpoint_owner(str(run), str(run / "checkpoints"), adopt=False, writer=True)
    assert owner.written == {1, 2, 3}
    _save(Checkpointer(str(run / "checkpoints"), keep=2, run_owner=owner), (4,))
    assert _steps(run / "checkpoints") == [3, 4]
    assert json.loads((run / "checkpoints" / RECORD).read_text())["written"] == [1, 2, 3, 4]

    alone = tmp_path / "scratch"
    _save(Checkpointer(str(alone), keep=0), (7, 8))  # no record, no run directory around it
    owner = checkpoint_owner(str(run), str(alone), adopt=False, writer=True)
    _save(Checkpointer(str(alone), keep=1, run_owner=owner), (9, 10))
    assert _steps(alone) == [7, 8, 10]


def test_a_local_tier_keeps_another_runs_steps(tmp_path):
    """The local tier (--checkpoint.local_dir) by the same rule: another run's copy is refused
    unless adopted; adopted, its steps are set aside as <step>.foreign where the run would
    delete its own (the steps after the one it resumes from), never deleted."""
    from checkpoint.tiers import drop_after

    theirs = tmp_path / "local" / "process-0"
    first = checkpoint_owner(str(tmp_path / "a"), str(theirs), adopt=False, writer=True)
    _save(Checkpointer(str(theirs), keep=0, process_local=True, run_owner=first), (3, 6, 9))
    with pytest.raises(UserError, match=r"^--checkpoint.local_dir .* belongs to another run"):
        checkpoint_owner(
            str(tmp_path / "b"), str(theirs), False, True, flag="--checkpoint.local_dir"
        )
    (tmp_path / "a").mkdir()  # the other run's directory exists: its record is not a moved one
    owner = checkpoint_owner(str(tmp_path / "b"), str(theirs), adopt=True, writer=True)
    tier = Checkpointer(str(theirs), keep=2, process_local=True, run_owner=owner)
    drop_after(tier, 3)  # resuming from step 3: 6 and 9 are not this run's to delete
    assert _steps(theirs) == [3] and {"6.foreign", "9.foreign"} <= set(os.listdir(theirs))
    _save(tier, (4, 5, 7))
    assert _steps(theirs) == [3, 5, 7]  # its own newest two; another run's 3 stays
    drop_after(Checkpointer(str(theirs), process_local=True, run_owner=owner), None)
    assert _steps(theirs) == [] and "3.foreign" in os.listdir(theirs)  # --resume none: aside


def test_a_copied_directory_elsewhere_is_no_other_runs_and_keeps_its_steps(tmp_path, capsys):
    """A checkpoint directory copied outside any run directory (a local tier copied to fork a
    run): its record and its steps' metadata describe the original, so it is no other run's;
    its steps, copies this run did not save, are kept."""
    run, ck = _other_run(tmp_path)
    copy = tmp_path / "scratch" / "ck"
    shutil.copytree(ck, copy)
    owner = checkpoint_owner(str(tmp_path / "fork"), str(copy), adopt=False, writer=True)
    assert owner.written == set() and owner.adopted_from == ""
    assert f"{copy}: a copy of {ck}; its steps 10, 20, 30 are kept" in capsys.readouterr().out
