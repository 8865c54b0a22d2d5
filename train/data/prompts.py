"""Batches of prompts for --objective grpo: a dataset prepared with `prepare --format prompts`
(one document per record: prompt, answer, EOS, the mask on the answer: train/data/
prompt_records.py), read as the step-indexed pipelines read theirs: batch `step` is a pure function
of (seed, step), every record once per epoch in a new keyed order, resumable at any step on any
mesh.

A batch of B prompts stays on the host: the rollout (train/run/rollouts.py) samples G completions
of each from the current parameters and builds the step's batch from them, so the pipeline's part
is `record` [B] (the record indices), `prompt` [B, P] (the prompts' tokens right-padded with EOS,
P the longest prompt of the dataset) and `length` [B]; the answers' and prompts' texts are read by
record (`answer`, `prompt_text`). A fixed hash of the record index holds --data.eval_fraction of
the records out, as every Brigade pipeline does: `eval_batches` gives up to --eval-batches batches
of them (host arrays, the same keys), whose greedy completions' rewards the run logs at
--eval-every (train/run/rollouts.py). With --post.updates_per_rollout N each batch of prompts
serves N steps (step k reads batch k // N): a rollout's N updates train on its one batch of
prompts, and every prompt is still sampled once per epoch. A prompt longer than --seq-len -
--post.max_new_tokens is refused when the pipeline opens, naming its record.
"""

from __future__ import annotations

import numpy as np

from checkpoint import storage
from errors import UserError
from train.data.index import INDEX
from train.data.order import permute, round_keys
from train.data.pairs import checked_source, load_documents
from train.data.pipeline import EVAL_STREAM, Pipeline
from train.data.sources import is_eval_doc


class PromptPipeline(Pipeline):
    """The built-in pipeline's interface (`next`, `seek`, `state`, ...) over the prompts of one
    prepared dataset; its batches are host arrays."""

    def __init__(
        self,
        directory: str,
        *,
        batch_size: int,
        seq_len: int,
        max_new: int,
        seed: int,
        eval_fraction: float = 0.0,
        per_rollout: int = 1,
        verify: bool = True,
        start_step: int = 0,
        prefetch: int = 2,
        vocab_size: int | None = None,
    ):
        self.docs, index = load_documents(directory, verify, "prompts")
        self.B, self.T, self.seed, self.max_new = batch_size, seq_len, seed, max_new
        self.sharding, self.start_step, self.prefetch = None, start_step, prefetch
        self.packing, self.packing_mask = False, False
        self.eos = index["eos_id"]
        self.sources = [checked_source(directory, index, vocab_size)]
        self.per_rollout = per_rollout
        if not len(self.docs.start):
            raise UserError(f"--data {directory}: holds no prompt")
        held = is_eval_doc(np.arange(len(self.docs.start)), eval_fraction)
        self.train_records, self.eval_records = np.flatnonzero(~held), np.flatnonzero(held)
        self.n = len(self.train_records)
        if not self.n:
            raise UserError(f"--data {directory}: no prompt left to train on after the eval split")
        self._check_prompts(directory)
        self.P = int(self.docs.prompt.max())
        self._ahead = None
        self._evals: dict[int, list] = {}

    def _check_prompts(self, directory: str) -> None:
        """Every prompt leaves --post.max_new_tokens within --seq-len."""
        room = self.T - self.max_new
        too_long = np.flatnonzero((self.docs.prompt > room) | (self.docs.prompt < 1))
        if len(too_long):
            d = int(too_long[0])
            raise UserError(
                f"--data {directory}: record {d + 1}: its prompt is {int(self.docs.prompt[d])}"
                f" tokens, longer than --seq-len {self.T} - --post.max_new_tokens {self.max_new}"
                f" = {room} ({len(too_long)} records like it); raise --seq-len, lower"
                " --post.max_new_tokens or drop those records"
            )

    def tokens(self, d: int) -> np.ndarray:
        s, a = int(self.docs.shard[d]), int(self.docs.start[d])
        return np.asarray(self.docs.tokens[s][a : a + int(self.docs.length[d])], np.int64)

    def answer_ids(self, d: int) -> np.ndarray:
        """Record d's answer tokens (between the prompt and the EOS)."""
        return self.tokens(d)[int(self.docs.prompt[d]) : -1]

    def host_rows(self, step: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Rows lo..hi-1 of batch `step` of prompts (that of steps step N .. step N + N - 1)."""
        epoch, offset = np.divmod(np.arange(step * self.B + lo, step * self.B + hi), self.n)
        picked = np.empty_like(offset)
        for e in np.unique(epoch):  # a batch may straddle an epoch boundary
            picked[epoch == e] = permute(
                offset[epoch == e], self.n, round_keys(self.seed, 0, int(e))
            )
        return self._rows(self.train_records[picked])

    def _rows(self, picked: np.ndarray) -> dict[str, np.ndarray]:
        prompt = np.full((len(picked), self.P), self.eos, np.int32)
        for i, d in enumerate(picked):
            n = int(self.docs.prompt[d])
            prompt[i, :n] = self.tokens(d)[:n]
        return {"record": picked, "prompt": prompt, "length": self.docs.prompt[picked]}

    def device_batch(self, step: int) -> dict:
        # the rollout places what it builds; a rollout's N steps read its one batch of prompts
        return self.host_rows(step // self.per_rollout, 0, self.B)

    def eval_batches(self, n: int) -> list[dict]:
        """Up to n batches of B held-out prompts, each once, in a fixed keyed order (the last one
        shorter when they run out)."""
        e = len(self.eval_records)
        if not e or n <= 0:
            return []
        order = self.eval_records[permute(np.arange(e), e, round_keys(self.seed, EVAL_STREAM, 0))]
        order = order[: n * self.B]
        return [self._rows(order[i : i + self.B]) for i in range(0, len(order), self.B)]

    @property
    def name(self) -> str:
        return self.sources[0].name

    def describe(self) -> str:
        return (
            f"data {self.name}: {self.n} prompts ({len(self.eval_records)} held out; at most"
            f" {self.P} tokens), {self.B} a rollout, each completed {self.max_new} tokens within"
            f" rows of {self.T}"
        )

    def state(self, step: int) -> dict:
        used = step // self.per_rollout * self.B  # the prompts of the rollouts before `step`
        return {
            "next_step": step,
            "seed": self.seed,
            "batch_size": self.B,
            "seq_len": self.T,
            "prompts": self.n,
            "fingerprint": self.sources[0].fingerprint,
            "epoch": used // self.n,
            "offset": used % self.n,
        }

    def check_state(self, saved: dict) -> list[str]:
        now = self.state(int(saved.get("next_step", 0)))
        return [f"data {k} {saved.get(k)} -> {now[k]}" for k in now if saved.get(k) != now[k]]


def make_prompt_pipeline(
    data_cfg, *, batch_size, seq_len, max_new, seed, per_rollout=1, vocab_size=None
):
    """The pipeline of prompts for a DataConfig whose source is one prepared prompts dataset."""
    source = data_cfg.source
    if (
        source in ("default", "synthetic")
        or "," in source
        or not storage.isfile(storage.join(source, INDEX))
    ):
        raise UserError(
            f"--data {source}: --objective grpo samples from one dataset of prompts prepared with"
            " `python -m train.data prepare FILE --format prompts --out DIR`; pass --data DIR"
        )
    return PromptPipeline(
        source,
        batch_size=batch_size,
        seq_len=seq_len,
        max_new=max_new,
        seed=seed,
        eval_fraction=data_cfg.eval_fraction,
        per_rollout=per_rollout,
        verify=data_cfg.verify,
        prefetch=data_cfg.prefetch,
        vocab_size=vocab_size,
    )
