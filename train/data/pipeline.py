"""The training data pipeline: batch `step` is a pure function of (seed, step).

Order. Each source is cut into fixed windows of seq_len + 1 tokens: with `packing` (default) its
documents are laid end to end (each ends with EOS) and window w is tokens [w*T, w*T + T + 1);
without it, window w is one chunk of one document, padded (weight 0) at the document's end. Global
row g = step * B + r picks a source by the mixture weights (Grain's exact interleave: after g rows,
source k has supplied g * w_k +- 1 of them, and its j-th row is known in O(1)), and that source's
j-th row is window perm_e(j mod n) of epoch e = j // n, where perm_e is a keyed bijection of [0, n)
(a Feistel network) seeded by (seed, source, e): every window once per epoch, a new order each
epoch, O(1) memory whatever the dataset size.

Consequences: resuming at step s on any mesh or process count replays exactly the batches an
uninterrupted run would have seen; each process builds only the rows its devices hold; the
loader's position (`state(step)`: per source epoch and offset) is derived from the step and stored
in the checkpoint only to check, on resume, that it still describes the same data.
"""

from __future__ import annotations

import functools
import queue
import threading
import time

import numpy as np

from errors import UserError
from train.data.order import mix, permute, proportions, round_keys, rows_per_source
from train.data.sources import Source, load_sources
from train.data.windows import Windows, batch_keys
from train.run import faults

EVAL_STREAM = 0x7FFF_FFFF  # key stream of the eval order, disjoint from source indices


def _check_vocab(src: Source, vocab_size: int) -> None:
    """An id >= the model's vocab_size would index past the embedding table (NaN losses, no hint of
    why): the model must cover both the tokenizer's vocabulary and the largest id actually
    present."""
    if src.max_token >= vocab_size and src.max_token >= src.vocab_size:
        raise UserError(
            f"data '{src.name}' holds token id {src.max_token}, beyond both"
            f" model.vocab_size={vocab_size} and the vocabulary its index records"
            f" ({src.vocab_size}): the index is wrong; re-run `python -m train.data prepare`"
        )
    if max(src.vocab_size, src.max_token + 1) > vocab_size:
        raise UserError(
            f"data '{src.name}' needs vocab_size >= {max(src.vocab_size, src.max_token + 1)} but"
            f" model.vocab_size={vocab_size} (largest token id {src.max_token}); raise"
            f" --model.vocab_size or use a smaller tokenizer"
        )


def abstract_batch(data_cfg, batch_size: int, seq_len: int, sharding) -> dict:
    """ShapeDtypeStructs of one global batch as the pipeline builds it (for AOT compiles and
    `plan`)."""
    import jax

    return {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), dt, sharding=sharding)
        for k, dt in batch_keys(data_cfg.packing_mask).items()
    }


# ------------------------------------------------------------------ the pipeline


class Pipeline:
    """`next() -> (batch, waited_s)` from `start_step` on, prepared `prefetch` steps ahead on a
    background thread and placed on the devices sharded like `batch_sharding`; `host_rows`
    and `global_batch` are the same rows as numpy (tests, benchmarks)."""

    def __init__(
        self,
        sources: list[tuple[Source, float]],
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        packing: bool = True,
        packing_mask: bool = False,
        batch_sharding=None,
        start_step: int = 0,
        prefetch: int = 2,
        vocab_size: int | None = None,
    ):
        self.sources = [s for s, _ in sources]
        self.weights = [w for _, w in sources]
        self.B, self.T, self.seed = batch_size, seq_len, seed
        self.packing, self.packing_mask = packing, packing_mask
        self.sharding, self.start_step, self.prefetch = batch_sharding, start_step, prefetch
        self.props = proportions(self.weights)
        for src in self.sources if vocab_size is not None else ():
            _check_vocab(src, vocab_size)
        eos = self.sources[0].tokenizer["eos_id"]
        self.train = [Windows(s.train, seq_len, packing, eos) for s in self.sources]
        self.eval = [Windows(s.eval, seq_len, packing, eos) for s in self.sources]
        for src, win in zip(self.sources, self.train):
            if not packing and src.train.longest_doc < seq_len + 1:
                raise UserError(
                    f"--seq-len {seq_len}: longer than every document of '{src.name}' (longest"
                    f" {src.train.longest_doc} tokens with EOS) with --data.packing false, so"
                    " every row would be mostly padding; use --data.packing true or --seq-len <="
                    f" {max(src.train.longest_doc - 1, 1)}"
                )
            if win.n == 0:
                raise UserError(
                    f"--seq-len {seq_len}: the train split of '{src.name}' has only"
                    f" {src.train.n_tokens} tokens; use a shorter --seq-len or more data"
                )
        self._ahead: _Ahead | None = None
        self._evals: dict[int, list] = {}

    # -- rows ---------------------------------------------------------------------------------
    def host_rows(self, step: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Rows lo..hi-1 of batch `step` (what one process builds for its devices)."""
        src, j = mix(np.arange(step * self.B + lo, step * self.B + hi), self.props)
        out = {
            k: np.zeros((hi - lo, self.T), dt) for k, dt in batch_keys(self.packing_mask).items()
        }
        for k in np.unique(src):
            rows_k, n = src == k, self.train[k].n
            epoch, offset = np.divmod(j[rows_k], n)
            w = np.empty_like(offset)
            for e in np.unique(epoch):  # a batch may straddle an epoch boundary
                w[epoch == e] = permute(
                    offset[epoch == e], n, round_keys(self.seed, int(k), int(e))
                )
            for name, value in self.train[k].rows(w, self.packing_mask).items():
                out[name][rows_k] = value
        return out

    def global_batch(self, step: int) -> dict[str, np.ndarray]:
        return self.host_rows(step, 0, self.B)

    def eval_rows(self, i: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Eval batch i: the same rows every call; sources without held-out windows are left out."""
        live = [k for k, w in enumerate(self.eval) if w.n]
        props = proportions([self.weights[k] for k in live])
        g = np.arange(i * self.B + lo, i * self.B + (self.B if hi is None else hi))
        src, j = mix(g, props)
        out = {k: np.zeros((len(g), self.T), dt) for k, dt in batch_keys(self.packing_mask).items()}
        for s in np.unique(src):
            win = self.eval[live[s]]
            w = permute(j[src == s] % win.n, win.n, round_keys(self.seed, EVAL_STREAM, live[s]))
            for name, value in win.rows(w, self.packing_mask).items():
                out[name][src == s] = value
        return out

    # -- devices ------------------------------------------------------------------------------
    def _place(self, rows_fn, nan: bool = False) -> dict:
        """Global [B, T] arrays sharded like the batch. This process builds one block of rows, the
        span of those its devices hold (contiguous on a mesh built outermost-first), and copies
        each device its slice."""
        import jax

        shape = (self.B, self.T)
        index = self.sharding.addressable_devices_indices_map(shape)
        rows = [idx[0].indices(self.B)[:2] for idx in index.values()]
        lo, hi = min(r[0] for r in rows), max(r[1] for r in rows)
        block = rows_fn(lo, hi)
        if nan:
            block["weights"] = block["weights"] * np.float32("nan")
        devices = list(index)
        parts = [
            value[r0 - lo : r1 - lo, idx[1]]
            for value in block.values()
            for (r0, r1), idx in zip(rows, index.values())
        ]
        # one transfer call for every key and device
        placed = jax.device_put(parts, devices * len(block))
        n = len(devices)
        return {
            name: jax.make_array_from_single_device_arrays(
                shape, self.sharding, placed[i * n : (i + 1) * n]
            )
            for i, name in enumerate(block)
        }

    def device_batch(self, step: int) -> dict:
        return self._place(functools.partial(self.host_rows, step), nan=step + 1 in self._nan_steps)

    @functools.cached_property
    def _nan_steps(self) -> set[int]:
        return faults.current().nan_steps  # fault injection: those steps' loss weights are NaN

    def seek(self, step: int) -> None:
        """Start at batch `step`: the loop opens the data (so a bad source is one line before the
        compile) before it knows the step it resumes at. Only before the first next()."""
        if self._ahead is not None:
            raise RuntimeError("Pipeline.seek after next(): batches are already being prepared")
        self.start_step = step

    def next(self) -> tuple[dict, float]:
        """The next batch (from start_step on) and the seconds the caller waited for it."""
        if self._ahead is None:
            self._ahead = _Ahead(self.device_batch, self.start_step, self.prefetch)
        return self._ahead.next()

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def eval_batches(self, n: int) -> list[dict]:
        """The same `n` held-out batches every time, so eval losses are comparable across steps;
        [] when no source holds out enough tokens for one window."""
        if not any(w.n for w in self.eval) or n <= 0:
            return []
        if n not in self._evals:
            self._evals[n] = [self._place(functools.partial(self.eval_rows, i)) for i in range(n)]
        return self._evals[n]

    # -- description and checkpoint state -------------------------------------------------------
    @property
    def name(self) -> str:
        if len(self.sources) == 1:
            return self.sources[0].name
        return "mixture " + ", ".join(
            f"{s.name} {100 * w:.0f}%" for s, w in zip(self.sources, self.weights)
        )

    def describe(self) -> str:
        train = sum(s.train.n_tokens for s in self.sources)
        ev = sum(s.eval.n_tokens for s in self.sources)
        docs = sum(s.train.n_docs for s in self.sources)
        return (
            f"data {self.name}: {train / 1e6:.1f}M train tokens in {docs} documents,"
            f" {ev / 1e6:.2f}M eval tokens, {sum(w.n for w in self.train)} windows of {self.T}"
            + (", packed" if self.packing else ", one document per row")
            + (" with segment masks" if self.packing_mask else "")
        )

    def state(self, step: int) -> dict:
        """The loader position before batch `step`, JSON-able, for the checkpoint's meta."""
        used = rows_per_source(step * self.B, self.props)
        return {
            "next_step": step,
            "seed": self.seed,
            "batch_size": self.B,
            "seq_len": self.T,
            "packing": self.packing,
            "packing_mask": self.packing_mask,
            "rows": step * self.B,
            "sources": [
                {
                    "name": s.name,
                    "fingerprint": s.fingerprint,
                    "weight": round(w, 6),
                    "windows": win.n,
                    "rows": n,
                    "epoch": n // win.n,
                    "offset": n % win.n,
                }
                for s, w, win, n in zip(self.sources, self.weights, self.train, used)
            ],
        }

    def check_state(self, saved: dict) -> list[str]:
        """Differences between a checkpoint's saved `state` and this pipeline at the same step:
        empty when the resumed run sees exactly the batches the saved run would have."""
        now = self.state(int(saved.get("next_step", 0)))
        diffs = [
            f"{name} {saved.get(k)} -> {now[k]}"
            for k, name in _SETTINGS.items()
            if saved.get(k) != now[k]
        ]
        old = saved.get("sources", [])
        if len(old) != len(now["sources"]):
            return diffs + [
                f"data sources {[s.get('name') for s in old]} ->"
                f" {[s['name'] for s in now['sources']]}"
            ]
        for a, b in zip(old, now["sources"]):
            diffs += [
                f"data source '{b['name']}' {k} {a.get(k)} -> {b[k]}"
                for k in b
                if k != "name" and a.get(k) != b[k]
            ]
        return diffs

    def tokenizer(self):
        """The tokenizer the data was prepared with (to encode a prompt and decode a sample), or
        None when its file (the path in the index) no longer loads: a sample is not worth failing
        for."""
        from train.data import tokenizers

        info = self.sources[0].tokenizer
        if info["kind"] == "byte":
            return tokenizers.ByteTokenizer()
        try:
            return tokenizers.load(f"{info['kind']}:{info['path']}")
        except UserError:
            return None


# state() keys that are settings, named as the config names them (so a caller can merge these lines
# with its own list of changed settings); the other keys follow from them and the step.
_SETTINGS = {
    "seed": "train.seed",
    "batch_size": "train.batch_size",
    "seq_len": "train.seq_len",
    "packing": "data.packing",
    "packing_mask": "data.packing_mask",
}


class _Ahead:
    """Calls make(step) for step = first, first+1, ... on a thread, `depth` results ahead."""

    def __init__(self, make, first_step: int, depth: int):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._error: BaseException | None = None

        def work():
            step = first_step
            try:
                while not self._stop.is_set():
                    item = make(step)
                    while not self._stop.is_set():
                        try:
                            self._q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    step += 1
            except BaseException as e:  # surfaced to the loop on its next get
                self._error = e

        self._thread = threading.Thread(target=work, name="brigade-data", daemon=True)
        self._thread.start()

    def next(self):
        t0 = time.perf_counter()
        while True:
            if self._error is not None:
                raise self._error
            try:
                return self._q.get(timeout=0.1), time.perf_counter() - t0
            except queue.Empty:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def make_pipeline(
    data_cfg,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    batch_sharding=None,
    start_step: int = 0,
    vocab_size: int | None = None,
) -> Pipeline:
    """The pipeline for a DataConfig (`--data.*`): loads (and verifies) every source of
    `data_cfg.source`, checks them against the model's vocab_size and seq_len."""
    sources = load_sources(data_cfg.source, data_cfg.eval_fraction, seed, data_cfg.verify)
    return Pipeline(
        sources,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        packing=data_cfg.packing,
        packing_mask=data_cfg.packing_mask,
        batch_sharding=batch_sharding,
        start_step=start_step,
        prefetch=data_cfg.prefetch,
        vocab_size=vocab_size,
    )
