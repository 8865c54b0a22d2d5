"""Fault injection behind one seam (train/run/faults.py): every BRIGADE_INJECT_* variable is parsed
and checked once, at start and before anything compiles; a malformed value, an unknown name, a step
the run never reaches are one line each. The rest of the code consults the typed Faults only."""

import ast
import io
import os
import tokenize

import pytest

from errors import UserError
from train.cli.main import main as train_main
from train.core.config import build
from train.run import faults
from train.run.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = "BRIGADE_INJECT_"

BAD = [
    ({P + "SPIKE_STEPS": "-3"}, f"{P}SPIKE_STEPS step -3: must be an integer >= 1"),
    ({P + "HANG_STEPS": "0"}, f"{P}HANG_STEPS step 0: must be an integer >= 1"),
    ({P + "NAN_STEPS": "5;6"}, f"{P}NAN_STEPS='5;6': expected comma-separated step numbers"),
    ({P + "NAN_STEPS": "1.5"}, f"{P}NAN_STEPS='1.5': expected comma-separated step numbers"),
    ({P + "NAN_STEPS": "3,,4"}, f"{P}NAN_STEPS='3,,4': expected comma-separated"),
    ({P + "STEP_DELAY": "0:nan"}, f"{P}STEP_DELAY seconds nan: must be a number in [0, 3600]"),
    ({P + "STEP_DELAY": "0:-1"}, f"{P}STEP_DELAY seconds -1.0: must be a number in [0, 3600]"),
    ({P + "STEP_DELAY": "0:inf"}, f"{P}STEP_DELAY seconds inf: must be a number in [0, 3600]"),
    ({P + "STEP_DELAY": "0.5"}, f"{P}STEP_DELAY='0.5': expected PROCESS:SECONDS, e.g. 1:0.5"),
    ({P + "STEP_DELAY": "-1:0.5"}, f"{P}STEP_DELAY process -1: must be an integer >= 0"),
    ({P + "KILL_AT_SHUTDOWN_PROCESSES": "one"}, f"{P}KILL_AT_SHUTDOWN_PROCESSES='one': expected"),
    ({P + "NAN_STEP": "5"}, f"{P}NAN_STEP: not a fault injection variable; valid: {P}NAN_STEPS,"),
]


@pytest.mark.parametrize("env, line", BAD, ids=[f"{k}={v}" for e, _ in BAD for k, v in e.items()])
def test_a_malformed_variable_is_one_line(env, line):
    with pytest.raises(UserError) as e:
        faults.parse(env)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), e.value


def test_good_values_and_empty_ones():
    f = faults.parse(
        {
            P + "NAN_STEPS": " 5, 6 ",
            P + "SPIKE_STEPS": "",  # empty: as if unset
            P + "STEP_DELAY": "1:0.5",
            P + "KILL_AT_SHUTDOWN_PROCESSES": "1",
            "BRIGADE_OTHER": "x",  # not ours
        }
    )
    assert f == faults.Faults(
        nan_steps=frozenset({5, 6}), delay=(1, 0.5), kill_at_shutdown=frozenset({1})
    )
    assert f.delay_s(1) == 0.5 and f.delay_s(0) == 0.0
    assert faults.parse({}) == faults.Faults()


def test_a_drill_that_would_never_happen_is_refused():
    with pytest.raises(UserError, match=f"^{P}HANG_STEPS: step 50 is beyond --steps 10"):
        faults.parse({P + "HANG_STEPS": "3,50"}).check(10)
    with pytest.raises(UserError, match=f"^{P}STEP_DELAY: process 2 does not exist.* 0 to 1$"):
        faults.parse({P + "STEP_DELAY": "2:0.1"}).check(10, processes=2)
    with pytest.raises(UserError, match=f"^{P}NAN_STEPS: poisons the built-in data pipeline"):
        faults.parse({P + "NAN_STEPS": "3"}).check(10, own_data=True)


def test_python_m_train_refuses_before_making_the_run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(P + "STEP_DELAY", "0:nan")
    run_dir = tmp_path / "run"
    assert train_main(["--model", "tiny", "--steps", "2", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {P}STEP_DELAY seconds nan: must be a number in [0, 3600]\n", err
    assert not run_dir.exists()


def test_trainer_refuses_before_compiling(tmp_path, monkeypatch):
    cfg = build(
        {"model.preset": "tiny", "train.steps": 4, "logging.run_dir": str(tmp_path / "run")}
    )
    monkeypatch.setenv(P + "SPIKE_STEPS", "9")
    with pytest.raises(UserError, match=f"^{P}SPIKE_STEPS: step 9 is beyond --steps 4"):
        Trainer(cfg)
    monkeypatch.setenv(P + "SPIKE_STEPS", "2")
    monkeypatch.setenv(P + "NAN_STEPS", "2")
    with pytest.raises(UserError, match=f"^{P}NAN_STEPS: poisons the built-in"):
        Trainer(cfg, data=[])


def _string_literals(path: str) -> list[str]:
    with open(path) as f:
        tokens = tokenize.generate_tokens(io.StringIO(f.read()).readline)
        return [t.string for t in tokens if t.type == tokenize.STRING]


def test_only_the_seam_reads_the_variables():
    readers = []
    for pkg in ("mesh", "models", "checkpoint", "train", "plan"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and path != os.path.join(ROOT, "train", "run", "faults.py"):
                    if any(P in s for s in _string_literals(path)):
                        readers.append(os.path.relpath(path, ROOT))
    assert not readers, readers
    tree = ast.parse(open(os.path.join(ROOT, "train", "data", "pipeline.py")).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert "train.run.resilience" not in imported  # the data pipeline consults the seam alone
