"""train/data/formats.py through `prepare`: compressed JSONL, Parquet and HuggingFace `datasets`
directories give exactly the tokens of the same documents as plain JSONL; their bad inputs are
one line and exit status 2."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from data_files import TEXTS, jsonl_file, prepared_docs

from train.data import prepare, prepare_inputs

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def same_tokens(a, b) -> bool:
    da, db = prepared_docs(a), prepared_docs(b)
    return len(da) == len(db) == len(TEXTS) and all(np.array_equal(x, y) for x, y in zip(da, db))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain JSONL and its prepared dataset (the documents every format must reproduce)."""
    root = tmp_path_factory.mktemp("formats")
    src = jsonl_file(root / "docs.jsonl", TEXTS)
    prepare.prepare([src], str(root / "plain"), progress=False)
    return root, open(src, "rb").read()


def write_format(root, kind: str) -> str:
    lines = open(root / "docs.jsonl", "rb").read()
    if kind == "jsonl.gz":
        (root / "docs.jsonl.gz").write_bytes(gzip.compress(lines))
    elif kind == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    elif kind == "parquet":  # several row groups, and other columns beside the text
        pq.write_table(
            pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}),
            root / "docs.parquet",
            row_group_size=64,
        )
    elif kind == "datasets":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(
            str(root / "docs.hf"), num_shards=3, num_proc=1
        )
        return str(root / "docs.hf")
    return str(root / f"docs.{kind}")


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst", "parquet", "datasets"])
def test_each_format_gives_the_plain_jsonl_tokens(reference, kind):
    root, _ = reference
    prepare.prepare([write_format(root, kind)], str(root / kind), progress=False)
    assert same_tokens(root / "plain", root / kind)


def test_streamed_files_in_chunks_through_the_pool(reference, tmp_path, monkeypatch):
    """Small chunks, two workers, streamed files between plain ones: documents stay in input
    order."""
    root, _ = reference
    monkeypatch.setattr(
        prepare_inputs, "TASK_BYTES", 700
    )  # the streamed files' chunks (read here, not in the workers)
    inputs = [
        write_format(root, "jsonl.gz"),
        str(root / "docs.jsonl"),
        write_format(root, "parquet"),
    ]
    assert (
        sum(
            1
            for _ in prepare_inputs.chunked(
                prepare_inputs.make_tasks(prepare_inputs.expand_inputs(inputs), 2), "text"
            )
        )
        > 20
    )
    index = prepare.prepare(inputs, str(tmp_path / "ds"), workers=2, progress=False)
    docs, plain = prepared_docs(tmp_path / "ds"), prepared_docs(root / "plain")
    assert index["n_documents"] == 3 * len(TEXTS)
    assert all(np.array_equal(x, y) for x, y in zip(docs, plain * 3))


def bad_inputs(root) -> dict[str, tuple[str, str]]:
    """name -> (input file, what its error line says)."""
    pq.write_table(pa.table({"body": ["a", "b"]}), root / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), root / "null.parquet")
    (root / "fake.parquet").write_bytes(b"not parquet at all")
    good = gzip.compress(b'{"text": "a"}\n' * 1000)
    (root / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    (root / "plain.jsonl.gz").write_bytes(b'{"text": "not gzip"}\n')
    zstandard = pytest.importorskip("zstandard")
    # cut mid-file (the reader used to hand the half line to the JSON parser: "not a JSON line"),
    # and cut exactly after a line break inside the frame (it used to pass, silently shorter)
    lines = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in TEXTS)
    whole = zstandard.ZstdCompressor().compress(lines)
    (root / "cut.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    frames = zstandard.ZstdCompressor().compress(lines[:100]) + whole
    (root / "cut-after-a-frame.jsonl.zst").write_bytes(frames[:-3])
    (root / "plain.jsonl.zst").write_bytes(b'{"text": "not zstd"}\n')
    (root / "dict").mkdir()
    (root / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return {
        "nocol": (
            "nocol.parquet",
            "nocol.parquet: no column 'text'; set --text-field (columns: body)",
        ),
        "ints": ("ints.parquet", "ints.parquet: column 'text' holds int64, not text"),
        "null": ("null.parquet", "null.parquet (row 1): no text in column 'text' (null)"),
        "fake": ("fake.parquet", "fake.parquet: not a readable Parquet file"),
        "cut": ("cut.jsonl.gz", "cut.jsonl.gz: not valid gzip data"),
        "plain": ("plain.jsonl.gz", "plain.jsonl.gz: not valid gzip data"),
        "cut-zst": ("cut.jsonl.zst", "cut.jsonl.zst: not valid Zstandard data (the file ends"),
        "cut-zst-2": ("cut-after-a-frame.jsonl.zst", "frame.jsonl.zst: not valid Zstandard data"),
        "plain-zst": ("plain.jsonl.zst", "plain.jsonl.zst: not valid Zstandard data"),
        "dict": ("dict", "is a datasets DatasetDict; name one split's directory, e.g."),
    }


def test_bad_inputs_are_one_line_exit_2(tmp_path, capsys):
    for name, (path, says) in bad_inputs(tmp_path).items():
        assert (
            prepare.main(
                [
                    str(tmp_path / path),
                    "--out",
                    str(tmp_path / f"out-{name}"),
                    "--workers",
                    "1",
                    "--no-progress",
                ]
            )
            == 2
        ), name
        err = capsys.readouterr().err
        assert err.startswith("error: prepare: ") and err.count("\n") == 1 and says in err, (
            name,
            err,
        )
        assert not (tmp_path / f"out-{name}").exists() and not list(
            tmp_path.glob(f"out-{name}.tmp-*")
        )
