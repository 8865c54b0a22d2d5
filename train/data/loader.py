"""Batches of random windows, deterministic in (seed, step), placed on the mesh with a
background prefetch thread.

Batch `step` depends only on (seed, step), so resuming at step s replays exactly the batches an
uninterrupted run would have seen, on any mesh or process count. Each process gathers only the
rows its own devices hold.
"""
from __future__ import annotations

import os
import queue
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from mesh.errors import UserError

_EVAL_STREAM = 0x7FFF_FFFF  # rng stream id for eval batches, disjoint from step numbers


class WindowSampler:
    """Row i of batch `step` is tokens[start_i : start_i + T + 1] with start_i from rng(seed, step)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, what: str = "train"):
        if len(tokens) < seq_len + 2:
            raise UserError(f"--seq-len {seq_len}: the {what} split has only {len(tokens)} tokens;"
                            f" use a shorter --seq-len or more data")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed

    def starts(self, stream: int, index: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, stream, index))
        return rng.integers(0, len(self.tokens) - self.seq_len, self.batch_size)  # last start: len - T - 1

    def rows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> inputs, targets: int32 [len(starts), T]."""
        w = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return w[:, :-1], w[:, 1:]

    def global_batch(self, step: int) -> dict[str, np.ndarray]:
        inputs, targets = self.rows(self.starts(0, step))
        return {"inputs": inputs, "targets": targets}


def to_device(sampler: WindowSampler, starts: np.ndarray, sharding: NamedSharding,
              weight: float = 1.0) -> dict[str, jax.Array]:
    """Build the global [B,T] arrays; each process only gathers the rows its devices hold.
    `weights` [B,T] float32 scales each target's loss (1 everywhere here; NaN for fault injection)."""
    shape = (sampler.batch_size, sampler.seq_len)
    cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def rows_for(index):
        key = (index[0].start, index[0].stop)
        if key not in cache:
            cache[key] = sampler.rows(starts[index[0]])
        return cache[key]

    return {
        "inputs": jax.make_array_from_callback(shape, sharding, lambda idx: rows_for(idx)[0][:, idx[1]]),
        "targets": jax.make_array_from_callback(shape, sharding, lambda idx: rows_for(idx)[1][:, idx[1]]),
        "weights": jax.make_array_from_callback(
            shape, sharding, lambda idx: np.full(np.empty(shape)[idx].shape, weight, np.float32)),
    }


def injected_nan_steps() -> set[int]:
    """Fault injection for tests and drills: BRIGADE_INJECT_NAN_STEPS=5,6,7 makes those steps'
    loss weights NaN, so their gradients are non-finite (the NaN guard must skip them)."""
    raw = os.environ.get("BRIGADE_INJECT_NAN_STEPS", "")
    return {int(x) for x in raw.split(",") if x.strip()}


class Prefetcher:
    """Puts batches first_step, first_step+1, ... on the devices `depth` steps ahead of the loop.

    `next()` returns (batch, seconds the caller waited): the data-wait time of the step.
    """

    def __init__(self, sampler: WindowSampler, sharding: NamedSharding, first_step: int, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._error: BaseException | None = None

        nan_steps = injected_nan_steps()

        def work():
            step = first_step
            try:
                while not self._stop.is_set():
                    batch = to_device(sampler, sampler.starts(0, step), sharding,
                                      float("nan") if step + 1 in nan_steps else 1.0)
                    while not self._stop.is_set():
                        try:
                            self._q.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    step += 1
            except BaseException as e:  # surfaced to the loop on its next get
                self._error = e

        self._thread = threading.Thread(target=work, name="brigade-prefetch", daemon=True)
        self._thread.start()

    def next(self) -> tuple[dict[str, jax.Array], float]:
        t0 = time.perf_counter()
        while True:
            if self._error is not None:
                raise self._error
            try:
                batch = self._q.get(timeout=0.1)
                return batch, time.perf_counter() - t0
            except queue.Empty:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def eval_batches(sampler: WindowSampler, sharding: NamedSharding, n: int) -> list[dict[str, jax.Array]]:
    """The same `n` held-out batches every time, so eval losses are comparable across steps."""
    return [to_device(sampler, sampler.starts(_EVAL_STREAM, i), sharding) for i in range(n)]
