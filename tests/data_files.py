"""Small datasets for the data tests: JSONL files, the documents of a prepared dataset, and an
in-memory source whose token values identify their position."""
from __future__ import annotations

import json
import os

import numpy as np

from train.data import corpus, prepare
from train.data.sources import Source, Stream


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
            out.append(tokens[a:b - 1])
    return out


def memory_source(tokens, doc_starts, name="mem", eval_tokens=None) -> Source:
    """An in-memory source whose token values identify their position (windows are recognisable)."""
    ev = eval_tokens if eval_tokens is not None else np.zeros(0, np.uint32)
    return Source(name, Stream.from_array(tokens, np.asarray(doc_starts)), Stream.from_array(ev, np.zeros(1, np.int64)),
                  int(tokens.max()) + 1, {"kind": "byte", "id": "byte", "eos_id": corpus.EOS}, name, int(tokens.max()))
