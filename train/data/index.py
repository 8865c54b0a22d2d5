"""A prepared dataset's layout: its shard writer, and its index (DIR/index.json: name, format tag
and schema), in one place for the writer (prepare.py) and the readers (sources.py, and
`prepare --overwrite`, which must recognise a dataset before it replaces one).

A dataset of supervised records (`prepare --format chat|prompt_completion`, train/data/chat.py)
has a loss mask per shard (`shard-NNNNN.mask.bin`, one uint8 per token, 1 = trained on) and the
format tag MASKED_FORMAT, which a reader that knows no masks refuses rather than train on the
prompts; a dataset without masks keeps FORMAT, and its every token weighs 1.

Every value the loader uses is checked here before it is used, so a hand-edited, truncated or
foreign index.json is one line naming the file and the key, never a KeyError deep in the loader.
The file names an index lists must stay inside the dataset's directory: an absolute path or one
through `..` is refused (an index is data, and data must not make the loader read or
`prepare --overwrite` delete files elsewhere).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from checkpoint import storage
from errors import UserError
from train.data.tokenizers import KINDS, file_sha256

FORMAT = "brigade-tokens/1"
MASKED_FORMAT = "brigade-tokens/2"
INDEX = "index.json"
DTYPES = ("uint16", "uint32")

# key -> type, for every key the loader reads; `max_token` (the largest token id of a shard) is
# optional because datasets prepared before it existed lack it (sources.py scans those shards).
TOP = {
    "format": str,
    "tokenizer": dict,
    "vocab_size": int,
    "eos_id": int,
    "dtype": str,
    "n_tokens": int,
    "n_documents": int,
    "shards": list,
}
TOKENIZER = {"kind": str, "path": str, "id": str, "eos_id": int}
SHARD = {"tokens": str, "offsets": str, "n_tokens": int, "n_documents": int, "sha256": dict}
SHARD_OPTIONAL = {"max_token": int}
SHARD_SHA256 = {"tokens": str, "offsets": str}
SHARD_MASK = {"mask": str}  # required in a MASKED_FORMAT index, in the shard and in its sha256
_TYPE_NAMES = {str: "a string", int: "an integer", dict: "an object", list: "a list"}


def _typed(value, typ) -> bool:
    # JSON true is no count
    return isinstance(value, typ) and not (typ is int and isinstance(value, bool))


def _key(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _check_keys(record, schema: dict, where: str, optional: dict | None = None) -> None:
    if not isinstance(record, dict):
        raise UserError(
            f"{repr(where) if where else 'the index'} must be an object, got"
            f" {json.dumps(record)[:40]}"
        )
    for key in schema:
        if key not in record:
            raise UserError(f"missing key '{_key(where, key)}'")
    for key, typ in {**schema, **(optional or {})}.items():
        if key in record and not _typed(record[key], typ):
            raise UserError(
                f"key '{_key(where, key)}' must be {_TYPE_NAMES[typ]}, got"
                f" {json.dumps(record[key])[:40]}"
            )


def inside_name(name: str) -> bool:
    """A file name that stays inside its directory: relative, not empty, no `..` component."""
    parts = name.replace("\\", "/").split("/")
    return bool(name) and not os.path.isabs(name) and parts[0] != "" and ".." not in parts


def validate(index) -> dict:
    """The index, or UserError naming the first key that is missing, mistyped or out of range."""
    _check_keys(index, TOP, "")
    _check_keys(index["tokenizer"], TOKENIZER, "tokenizer")
    problems = [
        (
            index["format"] not in (FORMAT, MASKED_FORMAT),
            f"'format' is {index['format']!r}, not {FORMAT!r} or {MASKED_FORMAT!r}",
        ),
        (
            index["dtype"] not in DTYPES,
            f"'dtype' is {index['dtype']!r}; valid: {', '.join(DTYPES)}",
        ),
        (index["vocab_size"] < 1, f"'vocab_size' is {index['vocab_size']}; must be >= 1"),
        (
            not 0 <= index["eos_id"] < index["vocab_size"],
            f"'eos_id' {index['eos_id']} is not below 'vocab_size'",
        ),
        (
            not 0 <= index["tokenizer"]["eos_id"] < index["vocab_size"],
            f"'tokenizer.eos_id' {index['tokenizer']['eos_id']} is not below 'vocab_size'",
        ),
        (
            index["tokenizer"]["kind"] not in KINDS,
            f"'tokenizer.kind' is {index['tokenizer']['kind']!r}; valid: {', '.join(KINDS)}",
        ),
        (not index["shards"], "'shards' is empty"),
    ]
    for bad, message in problems:
        if bad:
            raise UserError(message)
    for i, shard in enumerate(index["shards"]):
        _check_shard(shard, f"shards[{i}]", index["format"] == MASKED_FORMAT)
    return index


def _check_shard(shard, where: str, masked: bool) -> None:
    # a mask it has is checked like the rest
    masked = masked or (isinstance(shard, dict) and "mask" in shard)
    _check_keys(shard, {**SHARD, **(SHARD_MASK if masked else {})}, where, SHARD_OPTIONAL)
    _check_keys(
        shard["sha256"], {**SHARD_SHA256, **(SHARD_MASK if masked else {})}, f"{where}.sha256"
    )
    for key in shard_files(shard):
        if not inside_name(shard[key]):
            raise UserError(
                f"'{where}.{key}' is {shard[key]!r}: shard files must be named relative to the"
                " dataset directory, without '..'"
            )
    for key in ("n_tokens", "n_documents"):  # prepare writes no empty shard
        if shard[key] < 1:
            raise UserError(f"'{where}.{key}' is {shard[key]}; must be >= 1")
    if shard.get("max_token", 0) < 0:
        raise UserError(f"'{where}.max_token' is {shard['max_token']}; must be >= 0")


def read_index(directory: str, context: str, hint: str) -> dict:
    """DIR/index.json, validated; any problem is UserError `CONTEXT: DIR/index.json: PROBLEM;
    HINT`."""
    path = storage.join(directory, INDEX)
    try:
        index = json.loads(storage.read_text(path))
        return validate(index)
    except OSError as e:
        problem = e.strerror
    except ValueError as e:  # json's errors are ValueErrors; UserError is one too
        problem = (
            str(e) if isinstance(e, UserError) else f"not valid JSON ({str(e).splitlines()[0]})"
        )
    raise UserError(f"{context}: {path}: {problem}; {hint}")


def shard_files(shard: dict) -> tuple[str, ...]:
    """The keys of a shard's files: tokens, offsets, and its loss mask where it has one."""
    return (
        ("tokens", "offsets", "mask")
        if isinstance(shard.get("mask"), str)
        else ("tokens", "offsets")
    )


def listed_files(index: dict) -> set[str]:
    """Every file a (validated) index names, itself included: all that `prepare` writes into a
    dataset."""
    return {INDEX} | {sh[k] for sh in index["shards"] for k in shard_files(sh)}


# ------------------------------------------------------------------ the writer


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class ShardWriter:
    """Whole documents -> shard files in `directory` and their index records (`shards`): tokens,
    document offsets and, when `masked`, the loss mask of every token."""

    def __init__(self, directory: str, dtype: np.dtype, shard_tokens: int, masked: bool = False):
        self.directory, self.dtype, self.shard_tokens, self.masked = (
            directory,
            dtype,
            shard_tokens,
            masked,
        )
        self.shards: list[dict] = []
        self._f = None

    def _open(self) -> None:
        name = f"shard-{len(self.shards):05d}"
        self._name, self._hash, self._lengths, self._n, self._max = name, hashlib.sha256(), [], 0, 0
        self._f = open(os.path.join(self.directory, f"{name}.bin"), "wb")
        if self.masked:
            self._mask_f, self._mask_hash = (
                open(os.path.join(self.directory, f"{name}.mask.bin"), "wb"),
                hashlib.sha256(),
            )

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Appends whole documents (and their mask, uint8 like tokens); a shard is closed once it
        holds shard_tokens or more."""
        ends = np.cumsum(lengths)
        lo = 0
        while lo < len(lengths):
            if self._f is None:
                self._open()
            room = self.shard_tokens - self._n
            base = ends[lo - 1] if lo else 0
            # at least one document
            hi = max(lo + 1, int(np.searchsorted(ends, base + room, side="right")))
            chunk = tokens[base : ends[hi - 1]]
            self._max = max(self._max, int(chunk.max()))  # every document holds at least its EOS
            data = chunk.astype(self.dtype).tobytes()
            self._f.write(data)
            self._hash.update(data)
            if self.masked:
                bits = mask[base : ends[hi - 1]].astype(np.uint8).tobytes()
                self._mask_f.write(bits)
                self._mask_hash.update(bits)
            self._lengths.append(lengths[lo:hi])
            self._n += int(ends[hi - 1] - base)
            lo = hi
            if self._n >= self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self._f is None:
            return
        self._f.close()
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(self._lengths))]).astype(np.int64)
        off_name = f"{self._name}.offsets.npy"
        np.save(os.path.join(self.directory, off_name), offsets)
        shard = {
            "tokens": f"{self._name}.bin",
            "offsets": off_name,
            "n_tokens": int(offsets[-1]),
            "n_documents": len(offsets) - 1,
            "max_token": self._max,
            "sha256": {
                "tokens": self._hash.hexdigest(),
                "offsets": file_sha256(os.path.join(self.directory, off_name)),
            },
        }
        if self.masked:
            self._mask_f.close()
            shard["mask"], shard["sha256"]["mask"] = (
                f"{self._name}.mask.bin",
                self._mask_hash.hexdigest(),
            )
        self.shards.append(shard)
        self._f = None
