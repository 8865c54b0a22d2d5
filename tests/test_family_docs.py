"""README.md's HF family table and docs/extending.md's steps for adding a family stay true: the
table has a row for every model_type the importer reads (models/hf_config.py ARCHITECTURES) and no
other, and every file the table or the steps name exists."""

from __future__ import annotations

import re
from pathlib import Path

from models import hf_config

REPO = Path(__file__).resolve().parent.parent
PATH = re.compile(r"`((?:models|tests|mesh|plan|train|checkpoint)/[\w/]+\.py)`")


def family_table() -> list[tuple[list[str], list[str]]]:
    """README's `| model_type | options | files |` rows -> (model types, files); "the same" is the
    row above's files."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| `model_type` |"))
    rows, files = [], []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        types, _, where = [c.strip() for c in ln.strip("|").split("|")]
        files = files if where == "the same" else PATH.findall(where)
        rows.append((re.findall(r"`(\w+)`", types), files))
    return rows


def test_readme_family_table_names_every_family_and_real_files():
    rows = family_table()
    named = [t for types, _ in rows for t in types]
    assert sorted(named) == sorted(hf_config.ARCHITECTURES), named
    for types, files in rows:
        assert files, types
        missing = [f for f in files if not (REPO / f).is_file()]
        assert not missing, (types, missing)


def test_extending_names_the_files_to_touch_for_a_family():
    text = (REPO / "docs" / "extending.md").read_text()
    section = text.split("## A HuggingFace family of the built-in decoder", 1)[1].split("\n## ")[0]
    files = PATH.findall(section)
    for must in ("models/config.py", "models/hf.py", "models/hf_config.py", "models/presets.py"):
        assert must in files, must
    missing = [f for f in files if not (REPO / f).is_file()]
    assert not missing, missing
