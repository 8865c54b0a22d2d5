"""Small datasets for the data tests: sample texts, JSONL files, a tiny tiktoken vocabulary, the
documents of a prepared dataset, an in-memory source whose token values identify their position;
and a listing of every file under a directory with its hash (to prove that nothing changed)."""

from __future__ import annotations

import base64
import hashlib
import json
import os

import numpy as np
import pytest

from train.data import corpus, prepare
from train.data.sources import Source, Stream

TEXTS = [
    f"document {i}: "
    + " ".join(["alpha", "beta", "gamma", "délta"][(i * j) % 4] for j in range(i % 37 + 1))
    for i in range(300)
]


def jsonl_file(path, texts, field="text"):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({field: t, "id": 0}) + "\n")
    return str(path)


def prepared_docs(directory) -> list[np.ndarray]:
    """Every document of a prepared dataset, in order, without its EOS."""
    index = json.load(open(os.path.join(directory, prepare.INDEX)))
    out = []
    for sh in index["shards"]:
        tokens = np.fromfile(os.path.join(directory, sh["tokens"]), index["dtype"])
        off = np.load(os.path.join(directory, sh["offsets"]))
        for a, b in zip(off[:-1], off[1:]):
            assert tokens[b - 1] == index["eos_id"]
            out.append(tokens[a : b - 1])
    return out


def memory_source(tokens, doc_starts, name="mem", eval_tokens=None) -> Source:
    """An in-memory source whose token values identify their position (windows are recognisable)."""
    ev = eval_tokens if eval_tokens is not None else np.zeros(0, np.uint32)
    return Source(
        name,
        Stream.from_array(tokens, np.asarray(doc_starts)),
        Stream.from_array(ev, np.zeros(1, np.int64)),
        int(tokens.max()) + 1,
        {"kind": "byte", "id": "byte", "eos_id": corpus.EOS},
        name,
        int(tokens.max()),
    )


def tiktoken_file(tmp_path):
    pytest.importorskip("tiktoken")
    merges = [b"al", b"ph", b"pha", b"alpha", b"be", b"ta", b"beta", b"do", b"cu", b"ment"]
    ranks = [bytes([i]) for i in range(256)] + merges
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return str(path)


def file_hashes(root) -> dict[str, str]:
    """Every file under root: relative path -> sha256 of its contents."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            path = os.path.join(dirpath, n)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out
