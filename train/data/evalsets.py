"""Named evaluation sets: prepared datasets evaluated on their own, beside the training data.

Two users share this: `python -m train eval CKPT --data [NAME=]DIR ...` (train/cli/evaluate.py) and
a run's periodic eval with `--data.eval_source [NAME=]DIR,...` (train/run/loop.py). Both parse the
same specs, open a set the same way (its eval split: the documents a run with the same
--data.eval_fraction and --seed holds out; or every document), check it against the model's
tokenizer and vocabulary, and cut the same batches from it; so the loss a run logs for a set at a
step is the loss `eval` gives for that step's checkpoint with `--eval-batches` = the run's
--train.eval_batches.

Nothing here imports JAX at module level: DataConfig.validate parses --data.eval_source with it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from checkpoint import storage
from errors import UserError
from train.data.index import INDEX

SPLITS = ("eval", "all")
# a set's name becomes part of a metric's name (eval/<NAME>/loss): a TensorBoard tag, a W&B key
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
PREPARE_HINT = "make one with `python -m train.data prepare INPUTS --tokenizer TOK --out DIR`"


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One opened set: its name, directory, and the batches evaluated (placed like a train
    batch)."""

    name: str
    directory: str
    batches: list
    windows: int  # the windows those batches hold (a wrapped row of the last batch is not counted)
    of_windows: int  # the windows of the whole split


def parse_specs(specs: list[str], flag: str) -> list[tuple[str, str]]:
    """`[NAME=]DIR` specs -> [(name, DIR)], the name defaulting to DIR's base name; one line
    (naming `flag`) for an empty part or a name given twice. No file is read."""
    sets: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, directory = spec.partition("=")
        if not sep:
            name, directory = storage.basename(spec.rstrip("/")), spec
        if not name or not directory:
            raise UserError(f"{flag} {spec!r}: expected DIR or NAME=DIR (a prepared dataset)")
        if name in (n for n, _ in sets):
            raise UserError(
                f"{flag} {spec!r}: the set name '{name}' is given twice; name each set once"
                f" with NAME=DIR"
            )
        sets.append((name, directory))
    return sets


def parse_source(spec: str) -> list[tuple[str, str]]:
    """--data.eval_source `[NAME=]DIR[,[NAME=]DIR ...]` -> [(name, DIR)] (syntax only: no file is
    read, so a config validates anywhere); a name must be usable in a metric's name."""
    flag, parts = "--data.eval_source", [part.strip() for part in spec.split(",")]
    if not all(parts):
        raise UserError(
            f"{flag} {spec!r}: an empty entry; expected [NAME=]DIR[,[NAME=]DIR ...] (prepared"
            " datasets)"
        )
    sets = parse_specs(parts, flag)
    for name, directory in sets:
        if not NAME_RE.fullmatch(name):
            raise UserError(
                f"{flag} {name}={directory}: the set name '{name}' is logged as eval/{name}/loss;"
                " use letters, digits, '_', '.' and '-' only (NAME=DIR)"
            )
    return sets


def check_prepared(sets: list[tuple[str, str]], flag: str) -> None:
    """One line for the first set whose directory holds no prepared dataset."""
    for name, directory in sets:
        if not storage.isfile(storage.join(directory, INDEX)):
            raise UserError(
                f"{flag} {name}={directory}: '{directory}' is not a prepared dataset (no {INDEX});"
                f" {PREPARE_HINT}"
            )


def open_set(
    name: str,
    directory: str,
    *,
    split: str,
    data_cfg,
    batch_size: int,
    seq_len: int,
    seed: int,
    vocab_size: int,
    sharding,
    where: str,
    check_tokenizer: Callable[[dict, str], None],
    other_split_hint: str = "",
):
    """The set as a Pipeline whose eval windows are the split to evaluate: its held-out documents
    (as --data.eval_fraction and --seed hold them out of a training run), or (`all`) every
    document, read as one stream. `check_tokenizer(record, where)`: raises when the set's
    tokenizer is not the model's. One line (prefixed `where`) when the split holds no window."""
    from train.data.pipeline import Pipeline
    from train.data.sources import load_source

    d = data_cfg
    src = load_source(directory, d.eval_fraction if split == "eval" else 0.0, seed, d.verify)
    check_tokenizer(src.tokenizer, where)
    if split == "all":
        src = dataclasses.replace(src, eval=src.train)
    # the model's vocabulary, and the train split the pipeline also cuts: name the set that fails
    try:
        pipeline = Pipeline(
            [(src, 1.0)],
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            packing=d.packing,
            packing_mask=d.packing_mask,
            batch_sharding=sharding,
            vocab_size=vocab_size,
        )
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    if not pipeline.eval[0].n:
        raise UserError(
            f"{where}: its {'eval split' if split == 'eval' else 'data'} holds {src.eval.n_tokens}"
            f" tokens, not one window of --seq-len {seq_len} + 1; use {other_split_hint}a larger"
            f" --data.eval_fraction (now {d.eval_fraction}) or a shorter --seq-len"
        )
    return pipeline


def split_batches(pipeline, limit: int, sharding) -> tuple[list[dict], int]:
    """-> (the batches covering every eval window once, or the first `limit` of them; the windows
    they hold). Row g of the eval rows is window g of a permutation while g < windows, then they
    wrap round: those rows of the last batch weigh 0, so no window counts twice."""
    import jax

    windows, rows_per_batch = pipeline.eval[0].n, pipeline.B
    n = -(-windows // rows_per_batch)
    n = min(n, limit) if limit else n
    batches = []
    for i in range(n):
        rows = pipeline.eval_rows(i)
        fresh_B = np.arange(i * rows_per_batch, (i + 1) * rows_per_batch) < windows
        rows["weights"] = rows["weights"] * fresh_B[:, None]
        batches.append(
            {
                k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
                for k, v in rows.items()
            }
        )
    return batches, min(n * rows_per_batch, windows)


def open_eval_source(
    data_cfg,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    eval_batches: int,
    vocab_size: int,
    sharding,
    check_tokenizer: Callable[[dict, str], None],
) -> list[EvalSet]:
    """--data.eval_source, opened and checked (every set before any batch is made, so that a bad
    set is one line before the compile): each set's eval split, its first `eval_batches` batches."""
    sets = parse_source(data_cfg.eval_source)
    check_prepared(sets, "--data.eval_source")
    pipelines = [
        open_set(
            name,
            directory,
            split="eval",
            data_cfg=data_cfg,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            vocab_size=vocab_size,
            sharding=sharding,
            where=f"--data.eval_source {name}={directory}",
            check_tokenizer=check_tokenizer,
        )
        for name, directory in sets
    ]
    out = []
    for (name, directory), pipeline in zip(sets, pipelines):
        batches, windows = split_batches(pipeline, eval_batches, sharding)
        out.append(EvalSet(name, directory, batches, windows, pipeline.eval[0].n))
    return out


def describe(sets: list[EvalSet], seq_len: int) -> str:
    """The run's opening line for its eval sets: what each eval covers of each set's eval split."""

    def covered(s: EvalSet) -> str:
        part = f"{s.windows}" if s.windows == s.of_windows else f"{s.windows} of {s.of_windows}"
        return f"{s.name} ({s.directory}) {part} windows in {len(s.batches)} batches"

    return f"eval sets (their eval splits, windows of {seq_len} tokens): " + "; ".join(
        covered(s) for s in sets
    )
