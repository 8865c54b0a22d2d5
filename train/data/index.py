"""A prepared dataset's index (DIR/index.json): its name, format tag and schema, in one place for
the writer (prepare.py) and the readers (sources.py, and `prepare --overwrite`, which must
recognise a dataset before it replaces one).

Every value the loader uses is checked here before it is used, so a hand-edited, truncated or
foreign index.json is one line naming the file and the key, never a KeyError deep in the loader.
The file names an index lists must stay inside the dataset's directory: an absolute path or one
through `..` is refused (an index is data, and data must not make the loader read or
`prepare --overwrite` delete files elsewhere).
"""
from __future__ import annotations

import json
import os

from checkpoint import storage
from errors import UserError
from train.data.tokenizers import KINDS

FORMAT = "brigade-tokens/1"
INDEX = "index.json"
DTYPES = ("uint16", "uint32")

# key -> type, for every key the loader reads; `max_token` (the largest token id of a shard) is
# optional because datasets prepared before it existed lack it (sources.py scans those shards).
TOP = {"format": str, "tokenizer": dict, "vocab_size": int, "eos_id": int, "dtype": str, "n_tokens": int,
       "n_documents": int, "shards": list}
TOKENIZER = {"kind": str, "path": str, "id": str, "eos_id": int}
SHARD = {"tokens": str, "offsets": str, "n_tokens": int, "n_documents": int, "sha256": dict}
SHARD_OPTIONAL = {"max_token": int}
SHARD_SHA256 = {"tokens": str, "offsets": str}
_TYPE_NAMES = {str: "a string", int: "an integer", dict: "an object", list: "a list"}


def _typed(value, typ) -> bool:
    return isinstance(value, typ) and not (typ is int and isinstance(value, bool))  # JSON true is no count


def _key(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _check_keys(record, schema: dict, where: str, optional: dict | None = None) -> None:
    if not isinstance(record, dict):
        raise UserError(f"{repr(where) if where else 'the index'} must be an object, got {json.dumps(record)[:40]}")
    for key in schema:
        if key not in record:
            raise UserError(f"missing key '{_key(where, key)}'")
    for key, typ in {**schema, **(optional or {})}.items():
        if key in record and not _typed(record[key], typ):
            raise UserError(f"key '{_key(where, key)}' must be {_TYPE_NAMES[typ]}, got {json.dumps(record[key])[:40]}")


def inside_name(name: str) -> bool:
    """A file name that stays inside its directory: relative, not empty, no `..` component."""
    parts = name.replace("\\", "/").split("/")
    return bool(name) and not os.path.isabs(name) and parts[0] != "" and ".." not in parts


def validate(index) -> dict:
    """The index, or UserError naming the first key that is missing, mistyped or out of range."""
    _check_keys(index, TOP, "")
    _check_keys(index["tokenizer"], TOKENIZER, "tokenizer")
    problems = [
        (index["format"] != FORMAT, f"'format' is {index['format']!r}, not {FORMAT!r}"),
        (index["dtype"] not in DTYPES, f"'dtype' is {index['dtype']!r}; valid: {', '.join(DTYPES)}"),
        (index["vocab_size"] < 1, f"'vocab_size' is {index['vocab_size']}; must be >= 1"),
        (not 0 <= index["eos_id"] < index["vocab_size"], f"'eos_id' {index['eos_id']} is not below 'vocab_size'"),
        (not 0 <= index["tokenizer"]["eos_id"] < index["vocab_size"],
         f"'tokenizer.eos_id' {index['tokenizer']['eos_id']} is not below 'vocab_size'"),
        (index["tokenizer"]["kind"] not in KINDS, f"'tokenizer.kind' is {index['tokenizer']['kind']!r};"
                                                  f" valid: {', '.join(KINDS)}"),
        (not index["shards"], "'shards' is empty"),
    ]
    for bad, message in problems:
        if bad:
            raise UserError(message)
    for i, shard in enumerate(index["shards"]):
        _check_shard(shard, f"shards[{i}]")
    return index


def _check_shard(shard, where: str) -> None:
    _check_keys(shard, SHARD, where, SHARD_OPTIONAL)
    _check_keys(shard["sha256"], SHARD_SHA256, f"{where}.sha256")
    for key in ("tokens", "offsets"):
        if not inside_name(shard[key]):
            raise UserError(f"'{where}.{key}' is {shard[key]!r}: shard files must be named relative to the dataset"
                            f" directory, without '..'")
    for key in ("n_tokens", "n_documents"):  # prepare writes no empty shard
        if shard[key] < 1:
            raise UserError(f"'{where}.{key}' is {shard[key]}; must be >= 1")
    if shard.get("max_token", 0) < 0:
        raise UserError(f"'{where}.max_token' is {shard['max_token']}; must be >= 0")


def read_index(directory: str, context: str, hint: str) -> dict:
    """DIR/index.json, validated; any problem is UserError `CONTEXT: DIR/index.json: PROBLEM; HINT`."""
    path = storage.join(directory, INDEX)
    try:
        index = json.loads(storage.read_text(path))
        return validate(index)
    except OSError as e:
        problem = e.strerror
    except ValueError as e:  # json's errors are ValueErrors; UserError is one too
        problem = str(e) if isinstance(e, UserError) else f"not valid JSON ({str(e).splitlines()[0]})"
    raise UserError(f"{context}: {path}: {problem}; {hint}")


def listed_files(index: dict) -> set[str]:
    """Every file a (validated) index names, itself included: all that `prepare` writes into a dataset."""
    return {INDEX} | {sh[k] for sh in index["shards"] for k in ("tokens", "offsets")}
