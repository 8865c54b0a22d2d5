"""Batches of preference pairs for --objective dpo|ipo|orpo|simpo: a dataset prepared with
`prepare --format preference` (document 2k = pair k's prompt + chosen, 2k + 1 its prompt +
rejected, the loss mask on the responses: train/data/preference_records.py), read as the
step-indexed pipeline reads windows (train/data/pipeline.py): batch `step` is a pure function of
(seed, step), every pair once per epoch in a new keyed order, resumable at any step on any mesh.

A batch of B pairs: `inputs`, `targets`, `weights` [B, T] of the chosen sequences and the same
keys prefixed `rejected_` of the rejected ones (train/core/pair_loss.py), one sequence per row
from its start, right-padded (weight 0). A sequence longer than T + 1 tokens loses its end (the
response's tail); a prompt that leaves no response token within T is refused, naming the pair.
The held-out split is a fixed hash of the pair index (whole pairs), and the eval batches are
held-out pairs, whole: the run's eval is the objective's own loss and metrics on them
(train/core/pair_loss.py HeldOutPairs).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json

import numpy as np

from errors import UserError
from train.data.index import INDEX, read_index
from train.data.order import permute, round_keys
from train.data.pipeline import EVAL_STREAM, Pipeline
from train.data.shards import REPREPARE, open_shard
from train.data.sources import is_eval_doc

KEYS = ("inputs", "targets", "weights")
REJECTED = "rejected_"  # train/core/pair_loss.py's prefix


def pair_keys() -> dict[str, type]:
    keys = {"inputs": np.int32, "targets": np.int32, "weights": np.float32}
    return {**keys, **{REJECTED + k: dt for k, dt in keys.items()}}


def abstract_pairs(batch_size: int, seq_len: int, sharding) -> dict:
    """ShapeDtypeStructs of one global batch of pairs (AOT compiles, `plan`)."""
    import jax

    return {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), dt, sharding=sharding)
        for k, dt in pair_keys().items()
    }


@dataclasses.dataclass
class PairSource:
    """What the loop and the checks read of a data source: its name, the index's tokenizer
    record, a fingerprint of its tokens."""

    name: str
    tokenizer: dict
    fingerprint: str


def checked_source(directory: str, index: dict, vocab_size: int | None) -> PairSource:
    """The source record of a prepared dataset of pairs or prompts, after one line if its tokens
    need a larger vocabulary than the model's; its fingerprint hashes the shards' hashes."""
    max_token = max(sh.get("max_token", 0) for sh in index["shards"])
    if vocab_size is not None and max(index["vocab_size"], max_token + 1) > vocab_size:
        raise UserError(
            f"data '{directory}' needs vocab_size >= {max(index['vocab_size'], max_token + 1)}"
            f" but model.vocab_size={vocab_size}; raise --model.vocab_size"
        )
    fingerprint = hashlib.sha256(
        json.dumps([s["sha256"] for s in index["shards"]]).encode()
    ).hexdigest()[:16]
    return PairSource(directory, index["tokenizer"], fingerprint)


@dataclasses.dataclass
class Documents:
    """Every document of a prepared dataset, in order: shard, first token, length, and where its
    response (the first token of mask 1) starts."""

    tokens: list[np.ndarray]
    masks: list[np.ndarray]
    shard: np.ndarray
    start: np.ndarray
    length: np.ndarray
    prompt: np.ndarray  # tokens before the response

    def rows(self, docs: np.ndarray, seq_len: int, eos: int) -> dict[str, np.ndarray]:
        """Documents [R] -> inputs, targets, weights [R, T]: each from its start, right-padded."""
        r = len(docs)
        tokens = np.full((r, seq_len + 1), eos, np.int64)
        mask = np.zeros((r, seq_len + 1), np.float32)
        for i, d in enumerate(docs):
            n = min(int(self.length[d]), seq_len + 1)
            a, s = int(self.start[d]), int(self.shard[d])
            tokens[i, :n] = self.tokens[s][a : a + n]
            mask[i, :n] = self.masks[s][a : a + n] != 0
        return {
            "inputs": tokens[:, :-1].astype(np.int32),
            "targets": tokens[:, 1:].astype(np.int32),
            "weights": mask[:, 1:],
        }


def load_documents(
    directory: str, verify: bool, input_format: str = "preference"
) -> tuple[Documents, dict]:
    """The documents of a `prepare --format preference` (or `input_format`: prompts, for
    train/data/prompts.py) dataset -> (Documents, its index)."""
    where = f"--data {directory}"
    index = read_index(directory, where, REPREPARE)
    if index.get("input_format") != input_format:
        wanted = {
            "preference": "the preference objectives train on pairs: `python -m train.data prepare"
            " FILE --format preference --out DIR` (records with prompt, chosen, rejected)",
            "prompts": "--objective grpo samples from prompts: `python -m train.data prepare"
            " FILE --format prompts --out DIR` (records with prompt and answer)",
        }[input_format]
        raise UserError(
            f"{where}: prepared with --format {index.get('input_format', 'text')}; {wanted}"
        )
    dtype = np.dtype(index["dtype"])
    opened = [open_shard(directory, sh, dtype, verify) for sh in index["shards"]]
    shard, start, length, prompt = [], [], [], []
    for s, (_, offsets, _, mask) in enumerate(opened):
        first, n = offsets[:-1], np.diff(offsets)
        ones = np.flatnonzero(np.asarray(mask))
        at = np.searchsorted(ones, first)
        response = np.where(at < len(ones), ones[np.minimum(at, len(ones) - 1)], len(mask))
        shard.append(np.full(len(first), s))
        start.append(first)
        length.append(n)
        prompt.append(np.where(response < first + n, response - first, n))
    cat = lambda xs: np.concatenate(xs).astype(np.int64)  # noqa: E731
    tokens, masks = [o[0] for o in opened], [o[3] for o in opened]
    docs = Documents(tokens, masks, cat(shard), cat(start), cat(length), cat(prompt))
    if input_format == "preference" and len(docs.start) % 2:
        raise UserError(f"{where}: {len(docs.start)} documents, not pairs; {REPREPARE}")
    return docs, index


class PairPipeline(Pipeline):
    """The built-in pipeline's interface (`next`, `seek`, `eval_batches`, `state`, ...) over the
    pairs of one prepared dataset."""

    def __init__(
        self,
        directory: str,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        eval_fraction: float,
        verify: bool = True,
        batch_sharding=None,
        start_step: int = 0,
        prefetch: int = 2,
        vocab_size: int | None = None,
    ):
        self.docs, index = load_documents(directory, verify)
        self.B, self.T, self.seed = batch_size, seq_len, seed
        self.sharding, self.start_step, self.prefetch = batch_sharding, start_step, prefetch
        self.packing, self.packing_mask = False, False
        self.eos = index["eos_id"]
        self.sources = [checked_source(directory, index, vocab_size)]
        n_pairs = len(self.docs.start) // 2
        held = is_eval_doc(np.arange(n_pairs), eval_fraction)
        self.train_pairs, self.eval_pairs = np.flatnonzero(~held), np.flatnonzero(held)
        self._check_prompts(directory)
        if not len(self.train_pairs):
            raise UserError(f"--data {directory}: no pair left to train on after the eval split")
        self._ahead = None
        self._evals: dict[int, list] = {}

    def _check_prompts(self, directory: str) -> None:
        """Every pair has a response token among the targets of its T + 1 first tokens."""
        too_long = np.flatnonzero(self.docs.prompt >= self.T)
        if len(too_long):
            d = int(too_long[0])
            raise UserError(
                f"--data {directory}: pair {d // 2} (record {d // 2 + 1}): its prompt is"
                f" {int(self.docs.prompt[d])} tokens, which leaves no response token within"
                f" --seq-len {self.T} ({len(too_long)} sequences like it); raise --seq-len or"
                " drop those records"
            )

    def _pairs(self, pairs: np.ndarray) -> dict[str, np.ndarray]:
        chosen = self.docs.rows(2 * pairs, self.T, self.eos)
        rejected = self.docs.rows(2 * pairs + 1, self.T, self.eos)
        return {**chosen, **{REJECTED + k: v for k, v in rejected.items()}}

    def host_rows(self, step: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        n = len(self.train_pairs)
        epoch, offset = np.divmod(np.arange(step * self.B + lo, step * self.B + hi), n)
        picked = np.empty_like(offset)
        for e in np.unique(epoch):  # a batch may straddle an epoch boundary
            picked[epoch == e] = permute(offset[epoch == e], n, round_keys(self.seed, 0, int(e)))
        return self._pairs(self.train_pairs[picked])

    def eval_rows(self, i: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Eval batch i: held-out pairs, whole (the objective's held-out loss and metrics)."""
        n = len(self.eval_pairs)
        g = np.arange(i * self.B + lo, i * self.B + (self.B if hi is None else hi))
        return self._pairs(
            self.eval_pairs[permute(g % n, n, round_keys(self.seed, EVAL_STREAM, 0))]
        )

    def eval_batches(self, n: int) -> list[dict]:
        if not len(self.eval_pairs) or n <= 0:
            return []
        if n not in self._evals:
            self._evals[n] = [self._place(functools.partial(self.eval_rows, i)) for i in range(n)]
        return self._evals[n]

    @property
    def name(self) -> str:
        return self.sources[0].name

    def describe(self) -> str:
        return (
            f"data {self.name}: {len(self.train_pairs)} preference pairs ({len(self.eval_pairs)}"
            f" held out), one sequence per row of {self.T} tokens"
        )

    def state(self, step: int) -> dict:
        n = len(self.train_pairs)
        return {
            "next_step": step,
            "seed": self.seed,
            "batch_size": self.B,
            "seq_len": self.T,
            "pairs": n,
            "fingerprint": self.sources[0].fingerprint,
            "epoch": step * self.B // n,
            "offset": step * self.B % n,
        }

    def check_state(self, saved: dict) -> list[str]:
        now = self.state(int(saved.get("next_step", 0)))
        return [f"data {k} {saved.get(k)} -> {now[k]}" for k in now if saved.get(k) != now[k]]


def make_pair_pipeline(
    data_cfg, *, batch_size, seq_len, seed, batch_sharding=None, vocab_size=None
):
    """The pipeline of pairs for a DataConfig whose source is one prepared preference dataset."""
    source = data_cfg.source
    if source in ("default", "synthetic") or "," in source:
        raise UserError(
            f"--data {source}: the preference objectives train on one dataset of pairs prepared"
            " with `python -m train.data prepare FILE --format preference --out DIR`; pass --data"
            " DIR"
        )
    from checkpoint import storage

    if not storage.isfile(storage.join(source, INDEX)):
        raise UserError(
            f"--data {source}: holds no prepared dataset ({INDEX}); prepare the pairs with"
            " `python -m train.data prepare FILE --format preference --out DIR`"
        )
    return PairPipeline(
        source,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        eval_fraction=data_cfg.eval_fraction,
        verify=data_cfg.verify,
        batch_sharding=batch_sharding,
        prefetch=data_cfg.prefetch,
        vocab_size=vocab_size,
    )
