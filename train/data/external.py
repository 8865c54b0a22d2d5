"""Your own batches: `Trainer(cfg, data=ITERABLE, eval_data=ITERABLE)` trains on any Python
iterable of batches instead of the built-in pipeline; `IterableData` gives it the pipeline's face
(`seek`, `next`, `eval_batches`, `state`, ...), so the loop, checkpoints and resume are the same.

A batch is a dict of numpy arrays [rows, T] with T = --seq-len:
    inputs, targets   integer token ids (< model.vocab_size)
    weights           float loss weights (optional: all ones); 0 masks a token out
    segment_ids, positions   integers; exactly when --data.packing_mask is true (packed documents)
Rows: either the GLOBAL batch (--batch-size rows; every process may yield the same arrays and
keeps the rows its devices hold) or, with several processes, this process's share
(--batch-size / process count rows, in process order: the rows its devices hold). Brigade tells
the two apart by the row count, checks every batch (a missing or unknown key, a wrong shape or
dtype: one line naming the key, what it got and what it expects) and places it with the run's
batch sharding.

Resume. An iterable with `state() -> JSON-able` and `restore(state)` resumes exactly: the state
before the first batch a checkpoint has not trained on is saved in the checkpoint (where the
built-in pipeline's position goes) and restored before the first batch is drawn. Without them a
resumed run warns and starts the iterable from its beginning: Brigade cannot know whether
skipping would reproduce the same batches, and the training steps continue from the checkpoint.

Eval: batches of `eval_data` (the first --train.eval_batches of them, placed once and reused so
losses compare across steps); no eval without it. No text sample at the end: Brigade does not
know the batches' tokenizer.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from errors import UserError
from train.data.windows import batch_keys

# recent iterator states kept: a save asks for the position of the batch just drawn
KEPT_POSITIONS = 4


class IterableData:
    """The built-in pipeline's interface over a user iterable (see the module docstring)."""

    def __init__(
        self,
        batches: Iterable[dict],
        eval_batches: Iterable[dict] | None = None,
        *,
        batch_size: int,
        seq_len: int,
        packing_mask: bool,
        batch_sharding,
        vocab_size: int,
    ):
        self.source, self.eval_source = batches, eval_batches
        self.B, self.T, self.sharding, self.vocab_size = (
            batch_size,
            seq_len,
            batch_sharding,
            vocab_size,
        )
        self.keys = batch_keys(packing_mask)
        self.packing_mask = packing_mask
        self.exact_resume = callable(getattr(batches, "state", None)) and callable(
            getattr(batches, "restore", None)
        )
        self._it = None
        self._next_step = 0
        self._positions: dict[int, Any] = {}
        self._evals: dict[int, list] = {}

    # -- the pipeline's interface ---------------------------------------------------------------
    def seek(self, step: int, saved: dict | None = None) -> None:
        """Start at batch `step`; `saved`: the checkpoint's loader position (a resume)."""
        self._next_step = step
        if step == 0:
            return
        held = (saved or {}).get("iterable")
        if self.exact_resume and held is not None:
            self.source.restore(held)
        elif jax.process_index() == 0:
            why = (
                "it has no state()/restore()"
                if not self.exact_resume
                else "the checkpoint holds no position of it"
            )
            print(
                f"warning: resuming at step {step} with a custom data iterable from its beginning"
                f" ({why}); the batches differ from an uninterrupted run's",
                flush=True,
            )

    def next(self) -> tuple[dict, float]:
        """The next batch, checked and placed, and the seconds spent waiting for the iterable."""
        if self._it is None:
            self._it = iter(self.source)
        t0 = time.perf_counter()
        if self.exact_resume:  # the position before this batch: what a save after it must record
            self._positions[self._next_step] = self.source.state()
            self._positions.pop(self._next_step - KEPT_POSITIONS, None)
        try:
            raw = next(self._it)
        except StopIteration:
            raise UserError(
                f"data=: the iterable ended before batch {self._next_step + 1} (--steps needs"
                f" more); make it longer or endless (itertools.cycle)"
            ) from None
        waited = time.perf_counter() - t0
        self._next_step += 1
        return self.place(raw, f"batch {self._next_step}"), waited

    def close(self) -> None:
        self._it = None

    def eval_batches(self, n: int) -> list[dict]:
        if self.eval_source is None or n <= 0:
            return []
        if n not in self._evals:
            self._evals[n] = [
                self.place(b, f"eval batch {i + 1}")
                for i, b in enumerate(itertools.islice(iter(self.eval_source), n))
            ]
        return self._evals[n]

    def describe(self) -> str:
        return f"data: a Python iterable of {self.B} x {self.T} batches"

    def state(self, step: int) -> dict:
        """The position before batch `step`, for the checkpoint's meta (`iterable`: the iterable's
        own state, None without state())."""
        position = self._positions.get(step)
        # nothing drawn past it
        if position is None and self.exact_resume and step == self._next_step:
            position = self.source.state()
        return {"next_step": step, "sources": [], "iterable": position}

    def check_state(self, saved: dict) -> list[str]:
        return []  # the iterable's state is the user's: only restore() can judge it

    def tokenizer(self):
        return None

    # -- checks and placement -------------------------------------------------------------------
    def place(self, raw: Any, what: str) -> dict:
        """One batch of numpy arrays -> global arrays [B,T] sharded like the batch."""
        batch = self.check(raw, what)
        shape = (self.B, self.T)
        if len(next(iter(batch.values()))) == self.B:  # the global batch: keep this process's rows
            return {
                k: jax.make_array_from_callback(shape, self.sharding, lambda idx, v=v: v[idx])
                for k, v in batch.items()
            }
        return {
            k: jax.make_array_from_process_local_data(self.sharding, v, shape)
            for k, v in batch.items()
        }

    def check(self, raw: Any, what: str) -> dict[str, np.ndarray]:
        """The batch with every key of the step, the default weights added, the dtypes the step
        compiles for; UserError (one line) on the first key that does not fit."""
        if not isinstance(raw, dict):
            raise UserError(
                f"data=: {what} is a {type(raw).__name__}; expected a dict with keys"
                f" {', '.join(self.keys)}"
            )
        extra = sorted(set(raw) - set(self.keys))
        if extra:
            hint = (
                " (only with --data.packing_mask true)"
                if {"segment_ids", "positions"} & set(extra)
                else ""
            )
            raise UserError(
                f"data=: {what}: unexpected key '{extra[0]}'{hint}; valid keys:"
                f" {', '.join(self.keys)}"
            )
        rows = (self.B,) if jax.process_count() == 1 else (self.B, self.B // jax.process_count())
        out = {}
        for key, dtype in self.keys.items():
            if key not in raw:
                if key == "weights":
                    continue
                raise UserError(
                    f"data=: {what}: missing key '{key}'; expected {', '.join(self.keys)}"
                    f" (weights optional), each [{' or '.join(map(str, rows))}, {self.T}]"
                )
            value = np.asarray(raw[key])
            kind = np.floating if key == "weights" else np.integer
            if value.ndim != 2 or value.shape[0] not in rows or value.shape[1] != self.T:
                raise UserError(
                    f"data=: {what}: '{key}' has shape {value.shape}; expected ({rows[0]},"
                    f" {self.T}) (--batch-size, --seq-len)"
                    + (f" or this process's ({rows[1]}, {self.T})" if len(rows) > 1 else "")
                )
            if not np.issubdtype(value.dtype, kind):
                raise UserError(
                    f"data=: {what}: '{key}' has dtype {value.dtype}; expected"
                    f" {'a float' if kind is np.floating else 'an integer'} dtype"
                )
            out[key] = value.astype(dtype, copy=False)
        n = {v.shape[0] for v in out.values()}
        if len(n) > 1:
            raise UserError(f"data=: {what}: the arrays have different row counts {sorted(n)}")
        for key in ("inputs", "targets"):
            if out[key].size and (out[key].min() < 0 or out[key].max() >= self.vocab_size):
                raise UserError(
                    f"data=: {what}: '{key}' holds token id {int(out[key].max())}"
                    f" (min {int(out[key].min())}); ids must be in [0, model.vocab_size"
                    f" = {self.vocab_size})"
                )
        if "weights" not in out:
            out["weights"] = np.ones(next(iter(out.values())).shape, np.float32)
        return {k: out[k] for k in self.keys}
