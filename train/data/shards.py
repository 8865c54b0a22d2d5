"""One shard of a prepared dataset opened for reading: its files checked against the index (sizes
always; sha256 with --data.verify; document offsets), then memory-mapped, or on an object store
read by ranges of nearby tokens. Any problem is one line naming the file."""

from __future__ import annotations

import hashlib

import numpy as np

from checkpoint import storage
from errors import UserError
from train.data.index import INDEX, shard_files
from train.data.tokenizers import file_sha256

REPREPARE = "re-run `python -m train.data prepare`"


def _scan(path: str, dtype: np.dtype) -> tuple[str, int]:
    """(sha256, largest value) of a token file, in one read."""
    h, top = hashlib.sha256(), 0
    with storage.open_file(path, "rb") as f:
        for block in iter(lambda: f.read(dtype.itemsize << 21), b""):
            h.update(block)
            top = max(top, int(np.frombuffer(block, dtype).max()))
    return h.hexdigest(), top


def open_shard(directory: str, sh: dict, dtype: np.dtype, verify: bool) -> tuple:
    """One shard of a validated index -> (tokens memmap, document offsets, largest token id, loss
    mask memmap or None), after checking its sizes (always), sha256 (when `verify`) and offsets;
    any problem is one line naming the file."""
    where = f"--data {directory}"
    files = {key: storage.join(directory, sh[key]) for key in shard_files(sh)}
    for what, path in files.items():
        if not storage.isfile(path):
            raise UserError(
                f"{where}: shard file {sh[what]} listed in {INDEX} is missing; {REPREPARE}"
            )
    kinds = {"tokens": dtype, "mask": np.dtype(np.uint8)}  # one value per token in each
    for what in (k for k in kinds if k in files):
        size = storage.getsize(files[what])
        if size != sh["n_tokens"] * kinds[what].itemsize:
            raise UserError(
                f"{where}: {sh[what]} holds {size} bytes, its index says {sh['n_tokens']}"
                f" {kinds[what].name} {what} (truncated or modified); {REPREPARE}"
            )
    # Datasets prepared before `max_token` was recorded: the shard is scanned for it here (one read,
    # what --data.verify does anyway) rather than refused, so they stay usable without re-preparing.
    max_token = sh.get("max_token")
    try:
        digest, found = (
            _scan(files["tokens"], dtype) if verify or max_token is None else (None, None)
        )
        digests = {
            "tokens": digest,
            **{k: file_sha256(files[k]) if verify else None for k in files if k != "tokens"},
        }
    except OSError as e:
        raise UserError(
            f"{where}: cannot read {', '.join(sh[k] for k in files)}: {e.strerror}"
        ) from None
    for what in files if verify else ():
        if digests[what] != sh["sha256"][what]:
            raise UserError(
                f"{where}: {sh[what]} does not match the sha256 in {INDEX} (corrupt or modified);"
                f" {REPREPARE}, or --data.verify false to skip this check"
            )
    if found is not None and max_token is not None and found != max_token:
        raise UserError(
            f"{where}: {sh['tokens']} holds token ids up to {found} but {INDEX} says max_token"
            f" {max_token}; {REPREPARE}"
        )
    off = _offsets(where, sh, files["offsets"])
    tokens, mask = (_map(files[k], kinds[k], sh["n_tokens"]) if k in files else None for k in kinds)
    return tokens, off.astype(np.int64), found if max_token is None else max_token, mask


def _offsets(where: str, sh: dict, path: str) -> np.ndarray:
    """The shard's document offsets, int64 [n_documents + 1], checked against its index entry."""
    try:
        with storage.open_file(path, "rb") as f:
            off = np.load(f)
    except OSError as e:
        raise UserError(f"{where}: cannot read {sh['offsets']}: {e.strerror}") from None
    # not an array file, or a pickle (never loaded: it could run code)
    except (ValueError, EOFError):
        raise UserError(
            f"{where}: {sh['offsets']} is not a .npy array of document offsets; {REPREPARE}"
        ) from None
    ok = (
        off.ndim == 1
        and off.dtype.kind in "iu"
        and len(off) == sh["n_documents"] + 1
        and off[0] == 0
        and off[-1] == sh["n_tokens"]
        and bool((np.diff(off) > 0).all())
    )
    if not ok:
        raise UserError(f"{where}: {sh['offsets']} does not match {sh['tokens']}; {REPREPARE}")
    return off


def _map(path: str, dtype: np.dtype, n: int):
    """A shard file as an array: memory-mapped, or read by ranges on an object store."""
    return (
        np.memmap(storage.local_path(path), dtype, mode="r", shape=(n,))
        if storage.is_local(path)
        else RangeReadShard(path, dtype, n)
    )


class RangeReadShard:
    """A token file on an object store, indexed like its memory map would be: the positions of a
    gather are grouped into runs of nearby tokens and each run is one ranged read (a batch's rows
    are windows of seq_len + 1 tokens), so nothing reads the whole shard."""

    # positions closer than this many tokens share one read (fewer requests, a little more data)
    GAP = 1 << 16

    def __init__(self, path: str, dtype: np.dtype, n_tokens: int):
        self.path, self.dtype, self.n_tokens = path, dtype, n_tokens

    def __len__(self) -> int:
        return self.n_tokens

    def __getitem__(self, positions) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        wanted = np.unique(positions)
        values = np.empty(len(wanted), self.dtype)
        bounds = [0, *(np.flatnonzero(np.diff(wanted) > self.GAP) + 1), len(wanted)]
        for a, b in zip(bounds[:-1], bounds[1:]):  # one run of nearby positions: wanted[a:b]
            lo, hi = int(wanted[a]), int(wanted[b - 1]) + 1
            raw = storage.read_range(
                self.path, lo * self.dtype.itemsize, (hi - lo) * self.dtype.itemsize
            )
            values[a:b] = np.frombuffer(raw, self.dtype)[wanted[a:b] - lo]
        return values[np.searchsorted(wanted, positions)]
