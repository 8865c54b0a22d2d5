"""train/cli/console.py: `brigade COMMAND ...` reaches each `python -m` entry point's main with its
arguments; an unknown command is one line and exit status 2; the installed script runs."""

import os
import shutil
import subprocess
import sys

import pytest

from train.cli import console
from train.data.prepare import INDEX


def test_help_lists_every_command(capsys):
    assert console.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "plan", "report", "prepare", "hf", "inspect", "export"):
        assert f"\n  {name} " in out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["nope"], "error: brigade: unknown command 'nope'; valid: train, plan,"),
        ([], "error: brigade: no command; valid: train, plan,"),
    ],
)
def test_unknown_command_is_one_line(capsys, argv, says):
    assert console.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1


def test_prepare_makes_a_dataset(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("one document\n")
    assert (
        console.main(
            [
                "prepare",
                str(tmp_path / "a.txt"),
                "--out",
                str(tmp_path / "ds"),
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (tmp_path / "ds" / INDEX).is_file() and "1 documents" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", "--steps", "0"], "error: --steps 0: must be an integer >= 1"),
        (["plan", "--steps", "0"], "error: --steps 0: must be an integer >= 1"),
        (["report", "{tmp}/none"], "error: report: '{tmp}/none' is not a directory"),
        (["inspect", "{tmp}/none"], "error: '{tmp}/none': no such checkpoint directory"),
        (["export", "{tmp}/none", "{tmp}/out"], "error: export: pass --params-only"),
    ],
)
def test_each_command_reaches_its_main(tmp_path, capsys, argv, says):
    """Each command's own error for a bad argument: the arguments arrived at that command."""
    assert console.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says.format(tmp=tmp_path)), err


def test_hf_reaches_the_checkpoint_cli(tmp_path):
    with pytest.raises(SystemExit) as exit_:  # argparse's own exit: --out is required
        console.main(["hf", "import", str(tmp_path)])
    assert exit_.value.code == 2


def test_installed_script():
    """`pip install -e .` puts `brigade` beside the interpreter (pyproject's [project.scripts])."""
    script = os.path.join(os.path.dirname(sys.executable), "brigade")
    script = script if os.path.exists(script) else shutil.which("brigade")
    assert script, "no brigade script: run pip install -e . --no-deps"
    p = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("usage: brigade COMMAND"), p.stderr
