"""Data sources for the pipeline: what `--data.source` names, loaded as token streams.

A source is one of
  default                the stdlib corpus (byte tokens, train/eval split by file name; corpus.py)
  synthetic              random bytes (throughput runs)
  DIR                    a prepared dataset (DIR/index.json; `python -m train.data prepare`)
  PATH                   any other text file or directory, byte-tokenised on the fly (corpus.py)
and `--data.source` is one source or a mixture: `A:0.7,B:0.3` (each entry `SOURCE:WEIGHT`) or
FILE.yaml holding a list of `{source: ..., weight: ...}`. Weights are relative.

Each source becomes a `Stream` per split: its documents laid end to end (each ends with EOS) as one
virtual token sequence over memory-mapped shards, with the loss mask of each token where the dataset
has one (`prepare --format chat|prompt_completion`). A prepared dataset's eval split is a fixed hash
of the document index (like the default corpus's hash of file names): independent of the seed, the
same on every process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from checkpoint import storage
from errors import UserError
from train.data import corpus
from train.data.index import INDEX, read_index
from train.data.shards import REPREPARE, open_shard

SOURCE_CHOICES = (
    "default, synthetic, a prepared dataset DIR, a text file/directory, A:0.7,B:0.3 or FILE.yaml"
)


@dataclasses.dataclass
class Stream:
    """A virtual token sequence: segment i is shards[seg_shard[i]][seg_start[i]:][:len], placed at
    virtual positions seg_vstart[i]:seg_vstart[i+1]; document d spans
    doc_vstart[d]:doc_vstart[d+1]."""

    shards: list[np.ndarray]
    seg_shard: np.ndarray  # int64 [S]
    seg_start: np.ndarray  # int64 [S]
    seg_vstart: np.ndarray  # int64 [S+1]
    doc_vstart: np.ndarray  # int64 [D+1]
    # per shard its loss mask (uint8, 1 = trained on); None: all ones
    masks: list[np.ndarray] | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.seg_vstart[-1])

    @property
    def n_docs(self) -> int:
        return len(self.doc_vstart) - 1

    @property
    def longest_doc(self) -> int:
        return int(np.diff(self.doc_vstart).max()) if self.n_docs else 0

    @classmethod
    def from_array(
        cls, tokens: np.ndarray, doc_starts: np.ndarray, mask: np.ndarray | None = None
    ) -> Stream:
        n = len(tokens)
        return cls(
            [tokens],
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            np.array([0, n], np.int64),
            np.append(doc_starts, n).astype(np.int64),
            None if mask is None else [mask],
        )

    def gather(self, v: np.ndarray) -> np.ndarray:
        """Tokens at virtual positions v (any shape, 0 <= v < n_tokens) -> int32, same shape."""
        return self._gather(self.shards, v, np.int32)

    def gather_mask(self, v: np.ndarray) -> np.ndarray:
        """Loss mask at virtual positions v -> float32 0/1, same shape (any nonzero byte counts as
        1)."""
        if self.masks is None:
            return np.ones(v.shape, np.float32)
        return (self._gather(self.masks, v, np.uint8) != 0).astype(np.float32)

    def _gather(self, arrays: list[np.ndarray], v: np.ndarray, dtype) -> np.ndarray:
        if len(self.seg_shard) == 1:
            return arrays[self.seg_shard[0]][v + self.seg_start[0]].astype(dtype)
        seg = np.searchsorted(self.seg_vstart, v, side="right") - 1
        phys = self.seg_start[seg] + (v - self.seg_vstart[seg])
        shard = self.seg_shard[seg]
        out = np.empty(v.shape, dtype)
        for s in np.unique(shard):
            mask = shard == s
            out[mask] = arrays[s][phys[mask]]
        return out

    def doc_of(self, v: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.doc_vstart, v, side="right") - 1


@dataclasses.dataclass
class Source:
    name: str
    train: Stream
    eval: Stream
    vocab_size: int
    tokenizer: dict  # the index's tokenizer record; `id` decides what may be mixed
    fingerprint: str  # changes when the tokens do: a resumed run checks it
    max_token: int  # the largest token id in either split: the model's vocab_size must exceed it


def hash_u64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fixed, well-mixed hash of uint64 values (vectorised)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def is_eval_doc(doc_index: np.ndarray, eval_fraction: float) -> np.ndarray:
    return hash_u64(doc_index) % np.uint64(10_000) < np.uint64(int(eval_fraction * 10_000))


# ------------------------------------------------------------------ in-memory corpora (corpus.py)


def _doc_starts(tokens: np.ndarray) -> np.ndarray:
    """Documents of a corpus.py array end with EOS; the start of each."""
    ends = np.flatnonzero(tokens == corpus.EOS) + 1
    return np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)


def from_corpus(c: corpus.Corpus, whole_docs: bool = True) -> Source:
    streams = [
        Stream.from_array(t, _doc_starts(t) if whole_docs else np.zeros(1, np.int64))
        for t in (c.train, c.eval)
    ]
    fingerprint = hashlib.sha256(c.train.tobytes()).hexdigest()[:16]
    max_token = max(int(t.max()) for t in (c.train, c.eval) if len(t))
    return Source(
        c.name,
        streams[0],
        streams[1],
        c.vocab_size,
        {"kind": "byte", "id": "byte", "vocab_size": corpus.BYTE_VOCAB, "eos_id": corpus.EOS},
        fingerprint,
        max_token,
    )


# ------------------------------------------------------------------ prepared datasets


def load_prepared(directory: str, eval_fraction: float, verify: bool) -> Source:
    """Memory-maps every shard after checking sizes (always) and sha256 checksums (when
    `verify`)."""
    index = read_index(directory, f"--data {directory}", REPREPARE)
    if index.get("input_format") == "preference":  # pairs: train/data/pairs.py reads them
        raise UserError(
            f"--data {directory}: preference pairs (prepare --format preference) train with"
            " --objective dpo|ipo|orpo|simpo; read as documents, the rejected responses would be"
            " trained on too"
        )
    dtype = np.dtype(index["dtype"])
    opened = [open_shard(directory, sh, dtype, verify) for sh in index["shards"]]
    shards, offsets = [o[0] for o in opened], [o[1] for o in opened]
    # a shard without a mask in a dataset with masks (only by editing the index) weighs all its
    # tokens
    masks = (
        [np.ones(len(o[0]), np.uint8) if o[3] is None else o[3] for o in opened]
        if any(o[3] is not None for o in opened)
        else None
    )
    doc_counts = [len(o) - 1 for o in offsets]
    held = is_eval_doc(np.arange(sum(doc_counts)), eval_fraction)
    starts = np.cumsum([0] + doc_counts)
    split = [
        _select(shards, offsets, [m[starts[i] : starts[i + 1]] for i in range(len(shards))], masks)
        for m in (~held, held)
    ]
    fingerprint = hashlib.sha256(
        json.dumps([s["sha256"] for s in index["shards"]]).encode()
    ).hexdigest()[:16]
    return Source(
        f"{storage.basename(directory)} ({index['tokenizer']['id']})",
        split[0],
        split[1],
        index["vocab_size"],
        index["tokenizer"],
        fingerprint,
        max(o[2] for o in opened),
    )


def _select(
    shards: list[np.ndarray],
    offsets: list[np.ndarray],
    keep: list[np.ndarray],
    masks: list[np.ndarray] | None = None,
) -> Stream:
    """The kept documents of every shard, end to end; runs of consecutive kept documents become
    one segment, so a mostly-kept shard is a handful of segments."""
    seg_shard, seg_start, seg_len, doc_len = [], [], [], []
    for s, (off, k) in enumerate(zip(offsets, keep)):
        if not k.any():
            continue
        edge = np.diff(np.concatenate([[0], k.astype(np.int8), [0]]))
        # run = docs first..last-1
        first, last = (np.flatnonzero(edge == 1), np.flatnonzero(edge == -1))
        seg_shard.append(np.full(len(first), s))
        seg_start.append(off[first])
        seg_len.append(off[last] - off[first])
        doc_len.append(np.diff(off)[k])
    if not seg_shard:
        return Stream(
            shards,
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            masks,
        )
    cat = lambda xs: np.concatenate(xs).astype(np.int64)  # noqa: E731
    return Stream(
        shards,
        cat(seg_shard),
        cat(seg_start),
        np.concatenate([[0], np.cumsum(cat(seg_len))]),
        np.concatenate([[0], np.cumsum(cat(doc_len))]),
        masks,
    )


# ------------------------------------------------------------------ --data.source

# The smallest mixture weight must be at least this share of the largest: the interleave turns
# weights into integers with the smallest at 100 (train/data/order.py proportions), so a smaller
# ratio makes those grow towards int64 overflow in its row arithmetic; and such a source would
# supply no row in practice.
MIN_WEIGHT_RATIO = 1e-6


def check_weights(entries: list[tuple[str, float | None]], where: str) -> list[tuple[str, float]]:
    """Each weight finite and > 0, the smallest >= MIN_WEIGHT_RATIO x the largest; else
    UserError."""
    for name, weight in entries:
        if (
            not isinstance(weight, (int, float))
            or isinstance(weight, bool)
            or not 0 < weight < float("inf")
        ):
            raise UserError(
                f"--data {where!r}: mixture entry '{name}' needs a positive weight (finite; got"
                f" {weight}), as in dirA:0.7,dirB:0.3"
            )
    (lo_name, lo), (_, hi) = min(entries, key=lambda e: e[1]), max(entries, key=lambda e: e[1])
    if lo < hi * MIN_WEIGHT_RATIO:
        raise UserError(
            f"--data {where!r}: the weight {lo} of '{lo_name}' is below {MIN_WEIGHT_RATIO:g} x the"
            f" largest ({hi}), too small to mix; raise it or leave that source out"
        )
    return [(name, float(weight)) for name, weight in entries]


def parse_mixture(source: str) -> list[tuple[str, float]]:
    """`A:0.7,B:0.3` or FILE.yaml (a list of {source, weight}) -> [(source, weight)]; a single
    source without a weight has weight 1."""
    if source.endswith((".yaml", ".yml")) and os.path.isfile(source):
        return _mixture_yaml(source)
    entries = []
    for part in source.split(","):
        name, sep, w = part.rpartition(":")
        try:
            weight = float(w) if sep else None
        except ValueError:
            name, weight = part, None
        entries.append((name if weight is not None else part, weight))
    if len(entries) == 1 and entries[0][1] is None:
        return [(entries[0][0], 1.0)]
    return check_weights(entries, source)


def _mixture_yaml(path: str) -> list[tuple[str, float]]:
    from train.data.yaml_load import load  # bounded: size, UTF-8, aliases, keys given twice

    items = load(path, "--data")
    if not (
        isinstance(items, list)
        and items
        and all(
            isinstance(i, dict) and isinstance(i.get("source"), str) and "weight" in i
            for i in items
        )
    ):
        raise UserError(
            f"--data {path}: a mixture file is a list of {{source: DIR, weight: POSITIVE}} entries"
        )
    entries = check_weights([(i["source"], i["weight"]) for i in items], path)
    base = os.path.dirname(os.path.abspath(path))  # relative sources are relative to the file
    return [
        (
            name
            if name in ("default", "synthetic") or os.path.isabs(name)
            else os.path.join(base, name),
            weight,
        )
        for name, weight in entries
    ]


def load_source(spec: str, eval_fraction: float, seed: int, verify: bool = True) -> Source:
    if spec == "default":
        return from_corpus(corpus.stdlib_corpus(eval_fraction))
    if spec == "synthetic":
        # random bytes: one long document
        return from_corpus(corpus.synthetic_corpus(seed), whole_docs=False)
    if storage.isfile(storage.join(spec, INDEX)):
        return load_prepared(spec, eval_fraction, verify)
    if not storage.is_local(spec):  # text corpora are read from a local disk
        raise UserError(
            f"--data: '{spec}' holds no prepared dataset ({INDEX}); on an object store --data takes"
            f" a prepared dataset (python -m train.data prepare); valid: {SOURCE_CHOICES}"
        )
    if not os.path.exists(spec):
        raise UserError(f"--data: '{spec}' is not a file or directory; valid: {SOURCE_CHOICES}")
    return from_corpus(corpus.text_corpus(spec, eval_fraction))


def dataset_vocab(source: str) -> int | None:
    """The vocab_size a model needs for the prepared datasets `--data.source` names (their indexes'
    vocab_size, or a larger token id they hold), read from index.json alone; None when it names
    none (the byte-level sources fit every preset). For a model whose vocab_size is not set."""
    needs = []
    for spec, _ in parse_mixture(source):
        if spec not in ("default", "synthetic") and storage.isfile(storage.join(spec, INDEX)):
            index = read_index(spec, f"--data {spec}", REPREPARE)
            needs.append(
                max(index["vocab_size"], *(sh.get("max_token", 0) + 1 for sh in index["shards"]))
            )
    return max(needs) if needs else None


def load_sources(
    source: str, eval_fraction: float, seed: int, verify: bool = True
) -> list[tuple[Source, float]]:
    """Every source of `--data.source` with its normalised weight; all must share one tokenizer."""
    mix = parse_mixture(source)
    loaded = [(load_source(s, eval_fraction, seed, verify), w) for s, w in mix]
    ids = {src.tokenizer["id"] for src, _ in loaded}
    if len(ids) > 1:
        raise UserError(
            f"--data {source!r}: the sources use different tokenizers ("
            + ", ".join(f"{src.name}: {src.tokenizer['id']}" for src, _ in loaded)
            + "); prepare them with the same --tokenizer"
        )
    total = sum(w for _, w in mix)
    return [(src, w / total) for src, w in loaded]
