"""What moved from models.hf to checkpoint/: the old names still import for one release, with a
DeprecationWarning naming their new home; `python -m models.hf ...` exits 2 naming the command it
became, `python -m checkpoint hf ...`."""

import importlib
import os
import subprocess
import sys

import pytest
from cpu_env import cpu_env

import models.hf
from models.hf_moved import MOVED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_imports_with_a_warning(name):
    with pytest.warns(
        DeprecationWarning, match=f"^models.hf.{name} moved to {MOVED[name]}.{name};"
    ):
        old = getattr(models.hf, name)
    assert old is getattr(importlib.import_module(MOVED[name]), name)


def test_from_import_works_and_other_names_do_not():
    with pytest.warns(DeprecationWarning, match="checkpoint.hf.from_pretrained"):
        from models.hf import from_pretrained
    from checkpoint.hf import from_pretrained as new

    assert from_pretrained is new
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        models.hf.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "argv, shown",
    [
        (
            ["import", "hf dir", "--out", "ckpt"],
            "python -m checkpoint hf import 'hf dir' --out ckpt",
        ),
        ([], "python -m checkpoint hf import|export ..."),
    ],
)
def test_the_old_command_exits_2_naming_the_new_one(argv, shown):
    p = subprocess.run(
        [sys.executable, "-m", "models.hf", *argv],
        cwd=ROOT,
        env=cpu_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout)
    assert p.stderr == f"error: python -m models.hf moved; the command is now: {shown}\n", p.stderr
