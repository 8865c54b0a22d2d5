"""train/run/sinks.py: the console (bar, plain lines, nothing), W&B offline (its run id kept in the
run directory, so a second run on it continues the same W&B run), and a real run without a
terminal."""

import glob
import json
import os
import subprocess
import sys

import pytest
from cpu_env import cpu_env

from errors import UserError
from train.core import run_sections
from train.core.config import build
from train.run import sinks
from train.run.metrics import MetricsLogger

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = {
    "step": 120,
    "loss": 2.2541,
    "tokens_per_sec": 3114.4,
    "mfu": 0.3131,
    "data_wait_s": 0.0002,
    "step_time_s": 0.1,
    "grad_norm": 0.5,
}


class Terminal:
    def isatty(self):
        return True


def test_progress_modes():
    with open(os.devnull, "w") as log_file:
        assert run_sections.progress_mode("auto", log_file) == "lines"
        assert [
            run_sections.progress_mode(v, log_file)
            for v in ("bar", "lines", "none", "false", "True")
        ] == ["bar", "lines", "none", "none", "lines"]  # true/false: auto/none
    assert run_sections.progress_mode("auto", Terminal()) == "bar"
    with pytest.raises(
        UserError, match="--logging.progress: 'fancy' is not one of auto, bar, lines, none"
    ):
        build({"logging.progress": "fancy"})
    assert build({"logging.progress": False}).logging.progress == "false"  # older configs: a bool


def test_step_line():
    assert sinks.step_line(RECORD) == "step 120 | loss 2.254 | 3,114 tok/s | mfu 31.3% | data 0.2%"
    more = {**RECORD, "mem_peak_bytes": 3 * 2**30, "step_time_max_over_median": 1.234}
    assert sinks.step_line(more).endswith("| data 0.2% | mem 3.00 GiB | slowest 1.23x median")
    assert (
        sinks.step_line({"step": 60, "eval_loss": 2.3012, "eval_ppl": 9.985})
        == "step 60 | eval loss 2.301 | ppl 9.98"
    )


def test_lines_and_none(tmp_path, capsys):
    for mode in ("lines", "none"):
        log = MetricsLogger(str(tmp_path / mode), 200, tensorboard=False, progress=mode)
        log.print("brigade: start")
        log.log(RECORD)
        log.advance(10)
        log.close()
    out = capsys.readouterr().out
    assert out == "brigade: start\n" + sinks.step_line(RECORD) + "\nbrigade: start\n"
    for mode in ("lines", "none"):  # metrics.jsonl whatever the console shows
        assert json.loads((tmp_path / mode / "metrics.jsonl").read_text()) == RECORD


def test_unknown_or_missing_tracker_is_one_line(monkeypatch):
    with pytest.raises(
        UserError, match="unknown option 'logging.mlflow'; valid logging options: .*wandb"
    ):
        build({"logging.mlflow": "proj"})
    monkeypatch.setattr(run_sections.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        UserError,
        match=r"--logging.wandb: the wandb package is not installed; pip install"
        r" 'brigade\[wandb\]'",
    ):
        build({"logging.wandb": "proj"})


@pytest.mark.parametrize("mode", ["bogus", "", "OFFLINE"])
def test_a_wandb_mode_wandb_refuses_is_one_line(tmp_path, monkeypatch, mode):
    """wandb.init's own answer to a bad WANDB_MODE is a pydantic traceback, after the run began."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", mode)
    line = (
        f"^WANDB_MODE={mode!r} \\(with --logging.wandb\\): not a W&B mode; valid: online,"
        f" offline, shared, disabled, dryrun, run, or unset it$"
    )
    with pytest.raises(UserError, match=line):
        build({"logging.wandb": "proj"})
    with pytest.raises(UserError, match=line):  # a sink made from a run's config.json
        sinks.WandbSink(str(tmp_path), "proj", {})
    assert build({"logging.wandb": ""}).logging.wandb == ""  # no W&B: WANDB_MODE is not ours
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert build({"logging.wandb": "proj"}).logging.wandb == "proj"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    return tmp_path / "wandb"


def offline_runs(wandb_dir) -> list[str]:
    """The run id of each offline W&B run written under `wandb_dir`, oldest first."""
    return [
        os.path.basename(d).rsplit("-", 1)[1]
        for d in sorted(glob.glob(f"{wandb_dir}/wandb/offline-run-*"))
    ]


def test_wandb_resume_continues_one_run(tmp_path, offline):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = build({"logging.wandb": "brigade-test", "logging.run_dir": str(run_dir)}).to_dict()
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "plan.json").write_text(json.dumps({"flops_per_step": 1e9}))
    ids = []
    for first in (1, 3):  # a run, then its resume from step 2 on the same run directory
        log = MetricsLogger(str(run_dir), 4, first - 1, tensorboard=False, progress="none")
        wb = next(s for s in log._sinks if isinstance(s, sinks.WandbSink))
        assert wb.run.project == "brigade-test" and wb.run.settings.resume == "allow"
        assert wb.run.config["train"]["steps"] == config["train"]["steps"]
        assert wb.run.config["plan"] == {"flops_per_step": 1e9}
        ids.append(wb.run.id)
        for step in (first, first + 1):
            log.log({**RECORD, "step": step})
        log.close()
    assert ids[0] == ids[1] == (run_dir / sinks.WANDB_ID).read_text().strip()
    assert offline_runs(offline) == ids
    # the report's plots, logged at the end of each attempt (matplotlib is in the dev extra)
    plots = glob.glob(f"{offline}/wandb/offline-run-*/files/media/images/report/loss_*.png")
    assert len(plots) == 2


@pytest.mark.slow
def test_run_without_a_terminal_prints_plain_lines(tmp_path, offline):
    """A real run whose stdout and stderr are pipes (a cluster's log files): plain step lines and no
    carriage return; --logging.wandb through the loop."""
    run_dir = tmp_path / "run"
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
            "--data",
            "synthetic",
            "--log-every",
            "1",
            "--eval-every",
            "0",
            "--train.sample_tokens",
            "0",
            "--logging.tensorboard",
            "false",
            "--checkpoint.every",
            "0",
            "--run-dir",
            str(run_dir),
            "--logging.wandb",
            "brigade-test",
        ],
        cwd=ROOT,
        env=cpu_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in lines] == ["step 1", "step 2", "step 3"], p.stdout
    assert all(" | loss " in ln and " tok/s | mfu " in ln and " | data " in ln for ln in lines)
    assert p.stdout.startswith("brigade: ") and "done: 3 steps" in p.stdout
    assert "\r" not in p.stdout + p.stderr
    assert offline_runs(offline) == [(run_dir / sinks.WANDB_ID).read_text().strip()]
