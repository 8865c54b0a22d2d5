"""train/data against hostile or broken input: `prepare --out` never deletes what it did not write
(real processes), and every bad dataset, mixture, tokenizer or `--data` file is one line naming
the culprit, never a traceback, a Rust panic or a NaN loss."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from data_files import TEXTS, file_hashes, jsonl_file, tiktoken_file

from errors import UserError
from train.core.config import DataConfig
from train.data import prepare
from train.data.pipeline import make_pipeline


def _prepare_cli(args: list[str], cwd, home) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train.data", "prepare", *args, "--workers", "1", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "HOME": str(home)},
    )


def _layout(tmp_path):
    """tmp/work (the processes' cwd, with a file), tmp/home (their HOME, with a file), tmp/data/in
    (the input corpus) and tmp/ds (a prepared dataset with a foreign file next to its index)."""
    for d, name in (
        ("work", "notes.txt"),
        ("home", ".bashrc"),
        ("data/in", "a.txt"),
        ("data/in", "b.txt"),
    ):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / name).write_text(f"{d}/{name} text\n")
    prepare.prepare([str(tmp_path / "data" / "in")], str(tmp_path / "ds"), progress=False)
    (tmp_path / "ds" / "mine.txt").write_text("not Brigade's")


REFUSED_OUT = [  # (id, inputs, --out, words of the error) with paths relative to tmp_path
    ("cwd", ["data/in"], "work", "is or contains the current directory"),
    ("an-input-dir", ["data/in"], "data/in", "is or contains the input"),
    ("contains-an-input", ["data/in/a.txt"], "data", "is or contains the input"),
    ("home", ["data/in"], "home", "is or contains the home directory"),
    ("foreign-file", ["data/in"], "ds", "holds 'mine.txt', which prepare did not write"),
    ("inside-an-input-dir", ["data"], "data/in/ds", "is inside the input directory"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "inputs, out, words", [c[1:] for c in REFUSED_OUT], ids=[c[0] for c in REFUSED_OUT]
)
def test_prepare_refuses_an_out_it_would_destroy(tmp_path, inputs, out, words):
    """`prepare ... --out X --overwrite` in a real process: exit 2, one line, and not one file of
    tmp_path deleted or changed (before: `--out .` emptied the cwd, `--out INPUT` the corpus)."""
    _layout(tmp_path)
    before = file_hashes(tmp_path)
    out_arg = "." if out == "work" else str(tmp_path / out)  # the cwd as the user types it
    r = _prepare_cli(
        [*(str(tmp_path / i) for i in inputs), "--out", out_arg, "--overwrite"],
        tmp_path / "work",
        tmp_path / "home",
    )
    err = r.stderr.strip()
    assert (
        r.returncode == 2
        and err.startswith("error: prepare: --out ")
        and "\n" not in err
        and words in err
    ), err
    assert file_hashes(tmp_path) == before


@pytest.mark.slow
def test_prepare_overwrites_its_own_dataset(tmp_path):
    _layout(tmp_path)
    (tmp_path / "ds" / "mine.txt").unlink()
    old_index = json.load(open(tmp_path / "ds" / "index.json"))
    r = _prepare_cli(
        [str(tmp_path / "data" / "in" / "a.txt"), "--out", str(tmp_path / "ds"), "--overwrite"],
        tmp_path / "work",
        tmp_path / "home",
    )
    assert r.returncode == 0, r.stderr
    index = json.load(open(tmp_path / "ds" / "index.json"))
    assert index["n_documents"] == 1 < old_index["n_documents"]
    assert sorted(os.listdir(tmp_path)) == [
        "data",
        "ds",
        "home",
        "work",
    ]  # no .tmp-/.old- left behind


def test_prepare_overwrite_refuses_a_listed_name_that_is_a_directory(tmp_path, capsys):
    """A dataset whose index names a directory where a shard file belongs: `--overwrite` is one
    line and exit 2 before anything is written, and the directory's files stay (it used to raise
    IsADirectoryError from the clean-up, after the old dataset had been moved aside)."""
    ds = tmp_path / "ds"
    prepare.prepare([jsonl_file(tmp_path / "a.jsonl", TEXTS[:3])], str(ds), progress=False)
    shard = json.load(open(ds / "index.json"))["shards"][0]["tokens"]
    (ds / shard).unlink()
    (ds / shard).mkdir()
    (ds / shard / "mine.txt").write_text("the user's")
    before = file_hashes(tmp_path)
    code = prepare.main(
        [str(tmp_path / "a.jsonl"), "--out", str(ds), "--overwrite", "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"'{shard}', which its index names as a file of the dataset, is a directory" in err
    assert file_hashes(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["a.jsonl", "ds"]


# ------------------------------------------------------- bad datasets, mixtures, tokenizers, --data


def _edit_index(ds, edit) -> None:
    path = os.path.join(ds, "index.json")
    with open(path) as f:
        index = json.load(f)
    edit(index)
    with open(path, "w") as f:
        json.dump(index, f)


def _set(*keys_value):
    """An index edit: _set('shards', 0, 'tokens', '/etc/passwd') sets
    index['shards'][0]['tokens']."""
    *keys, last, value = keys_value

    def edit(index):
        for k in keys:
            index = index[k]
        index[last] = value

    return edit


def _drop(*keys):
    def edit(index):
        for k in keys[:-1]:
            index = index[k]
        del index[keys[-1]]

    return edit


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _lie_about_vocab(index) -> None:
    """A byte dataset (ids up to 257) whose index claims a vocabulary of 100."""
    index["vocab_size"], index["eos_id"], index["tokenizer"]["eos_id"] = 100, 0, 0


def _old_and_lying(index) -> None:
    """As a dataset prepared before `max_token` was recorded, lying about its vocabulary."""
    _lie_about_vocab(index)
    del index["shards"][0]["max_token"]


def _swap_offsets(ds) -> None:
    """Documents 1 and 2 swap their starts: the counts and the total still match the index."""
    path = os.path.join(ds, "shard-00000.offsets.npy")
    off = np.load(path)
    off[[1, 2]] = off[[2, 1]]
    np.save(path, off)


# (id, action on (tmp_path, ds) that raises UserError or returns --data or DataConfig
# fields, words of it)
BAD = [
    (
        "index-missing-key",
        lambda t, ds: _edit_index(ds, _drop("dtype")),
        "index.json: missing key 'dtype'",
    ),
    (
        "index-wrong-type",
        lambda t, ds: _edit_index(ds, _set("vocab_size", "259")),
        "key 'vocab_size' must be an integer, got \"259\"",
    ),
    (
        "shard-bool-count",
        lambda t, ds: _edit_index(ds, _set("shards", 0, "n_tokens", True)),
        "key 'shards[0].n_tokens' must be an integer",
    ),
    (
        "shard-missing-sha",
        lambda t, ds: _edit_index(ds, _drop("shards", 0, "sha256", "offsets")),
        "missing key 'shards[0].sha256.offsets'",
    ),
    (
        "shards-not-a-list",
        lambda t, ds: _edit_index(ds, _set("shards", {"0": 1})),
        "key 'shards' must be a list",
    ),
    (
        "index-not-an-object",
        lambda t, ds: _write(os.path.join(ds, "index.json"), b"[1, 2]"),
        "the index must be an object",
    ),
    (
        "bad-dtype",
        lambda t, ds: _edit_index(ds, _set("dtype", "float64")),
        "'dtype' is 'float64'; valid: uint16",
    ),
    (
        "absolute-shard-path",
        lambda t, ds: _edit_index(ds, _set("shards", 0, "tokens", "/etc/passwd")),
        "'shards[0].tokens' is '/etc/passwd': shard files must be named relative",
    ),
    (
        "dotdot-shard-path",
        lambda t, ds: _edit_index(ds, _set("shards", 0, "offsets", "../x/../../o.npy")),
        "'shards[0].offsets' is '../x/../../o.npy'",
    ),
    (
        "index-lies-about-vocab",
        lambda t, ds: _edit_index(ds, _lie_about_vocab),
        "holds token id 257, beyond both model.vocab_size=200 and the vocabulary its index records"
        " (100)",
    ),
    # found by scanning the shard all the same
    (
        "old-index-without-max-token",
        lambda t, ds: _edit_index(ds, _old_and_lying) or {"verify": False},
        "holds token id 257, beyond both",
    ),
    (
        "max-token-lies",
        lambda t, ds: _edit_index(ds, _set("shards", 0, "max_token", 99)),
        "holds token ids up to 257 but index.json says max_token 99",
    ),
    (
        "shard-missing",
        lambda t, ds: os.remove(os.path.join(ds, "shard-00000.offsets.npy")),
        "shard file shard-00000.offsets.npy listed in index.json is missing",
    ),
    (
        "offsets-not-npy",
        lambda t, ds: (
            _write(os.path.join(ds, "shard-00000.offsets.npy"), b"junk" * 9) or {"verify": False}
        ),
        "shard-00000.offsets.npy is not a .npy array",
    ),
    (
        "offsets-not-increasing",
        lambda t, ds: _swap_offsets(ds) or {"verify": False},
        "shard-00000.offsets.npy does not match shard-00000.bin",
    ),
    ("weight-1e-20", lambda t, ds: f"{ds}:1e-20,{ds}:1", "the weight 1e-20 of"),
    (
        "weight-inf",
        lambda t, ds: f"{ds}:inf,default:1",
        "needs a positive weight (finite; got inf)",
    ),
    (
        "weight-nan",
        lambda t, ds: f"{ds}:nan,default:1",
        "needs a positive weight (finite; got nan)",
    ),
    ("single-negative-weight", lambda t, ds: f"{ds}:-1", "needs a positive weight"),
    (
        "yaml-weight-.inf",
        lambda t, ds: _yaml(t, "- {source: ds, weight: .inf}\n- {source: default, weight: 1}\n"),
        "needs a positive weight (finite; got inf)",
    ),
    (
        "yaml-weight-true",
        lambda t, ds: _yaml(t, "- {source: ds, weight: true}\n- {source: default, weight: 1}\n"),
        "needs a positive weight (finite; got True)",
    ),
    (
        "tiktoken-without-every-byte",
        lambda t, ds: _truncated_tiktoken(t),
        "8 of the 256 single bytes have no rank (first: 0xb8)",
    ),
    (
        "binary-data-file",
        lambda t, ds: _binary(t / "some.bin"),
        "some.bin' is not UTF-8 text (byte 6)",
    ),
    (
        "binary-in-data-dir",
        lambda t, ds: _binary(t / "dir" / "z.bin") and str(t / "dir"),
        "z.bin' is not UTF-8",
    ),
    (
        "out-not-a-dataset",
        lambda t, ds: _prepare_over(t, "plain", make_dir=True),
        "index.json: No such file or directory; --overwrite replaces only a directory that holds a"
        " prepared dataset",
    ),
    (
        "out-a-file",
        lambda t, ds: _prepare_over(t, "notes.txt", make_dir=False),
        "notes.txt' is not a directory; --overwrite replaces only",
    ),
]


def _yaml(tmp_path, text) -> str:
    (tmp_path / "mix.yaml").write_text(text)
    return str(tmp_path / "mix.yaml")


def _truncated_tiktoken(tmp_path) -> None:
    """A rank file that loads but lacks bytes 0xb8-0xbf: tiktoken panics (in Rust) on "ÿ"
    (c3 bf)."""
    path = tiktoken_file(tmp_path)
    with open(path) as f:
        lines = f.read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join(lines[:0xB8] + lines[0xC0:]) + "\n")
    prepare.prepare(
        [jsonl_file(tmp_path / "t.jsonl", ["ÿ"])], str(tmp_path / "out"), path, progress=False
    )


def _prepare_over(tmp_path, name: str, make_dir: bool) -> None:
    """prepare --overwrite onto tmp_path/NAME: a directory holding a user file, or a user file."""
    target = tmp_path / name
    if make_dir:
        target.mkdir()
    (target / "notes.txt" if make_dir else target).write_text("the user's")
    prepare.prepare([jsonl_file(tmp_path / "a.jsonl", TEXTS[:2])], str(target), overwrite=True)


def _binary(path) -> str:
    path.parent.mkdir(exist_ok=True)
    (path.parent / "ok.txt").write_text("fine text\n")
    path.write_bytes(b"PK\x03\x04\x14\x00\xff\xfe" * 64)
    return str(path)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("pristine")
    prepare.prepare([jsonl_file(root / "a.jsonl", TEXTS)], str(root / "ds"), progress=False)
    return str(root / "ds")


@pytest.mark.parametrize("action, words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_one_line(tmp_path, pristine, capfd, action, words):
    ds = str(tmp_path / "ds")
    shutil.copytree(pristine, ds)
    with pytest.raises(UserError) as e:
        got = action(tmp_path, ds)
        cfg = {
            "source": ds,
            "eval_fraction": 0.0,
            **(got if isinstance(got, dict) else {"source": got} if got else {}),
        }
        make_pipeline(DataConfig(**cfg), batch_size=2, seq_len=8, seed=0, vocab_size=200)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    assert "panicked" not in capfd.readouterr().err
