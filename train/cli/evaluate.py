"""`python -m train eval CKPT --data [NAME=]DIR ... [flags]`: the mean loss and perplexity of a
checkpoint's parameters on prepared datasets, one line per set (or one JSON object with --json).

CKPT is resolved as --resume PATH and --init-from resolve it (a run directory, a checkpoint
directory, one step's directory, an HF import), and the model is the one its metadata records.
Every run flag applies (--mesh, --batch-size, --seq-len, --model.dtype, --data.eval_fraction, ...);
where the checkpoint's run set the batch size, sequence length, seed, eval fraction and packing,
those are the defaults, so that the run's own eval batches are the ones evaluated here.

Each set is evaluated over its eval split (`--split eval`, the default: the documents a run with
the same --data.eval_fraction holds out) or over all its documents (`--split all`): every window
of --seq-len tokens once, in batches of --batch-size, or only the first --eval-batches N batches.
The loss is a run's eval loss (train/core/inference.py Evaluator, over train/core/batch_loss.py's
eval_step): token losses weighted by the dataset's loss mask, so a chat dataset's loss is over the
assistant turns only. A set prepared with another
tokenizer than the checkpoint's is refused, like --init-from (--data.allow_tokenizer_mismatch).
"""

from __future__ import annotations

import json
import math
import os

import jax

from errors import ArgParser, UserError, number, one_line_errors
from train.cli.checkpoint_model import Opened, command_parser, open_model
from train.core.inference import Evaluator
from train.data import evalsets
from train.run import checkpoint_match

SPLITS = evalsets.SPLITS
# The run settings an evaluation takes from the checkpoint's own run unless a flag says otherwise:
# they decide which windows and batches its held-out documents make.
EVAL_SETTINGS = (
    "train.batch_size",
    "train.seq_len",
    "train.seed",
    "data.eval_fraction",
    "data.packing",
    "data.packing_mask",
)


def parse_sets(specs: list[str] | None) -> list[tuple[str, str]]:
    """--data [NAME=]DIR, repeated -> [(name, DIR)]; the name defaults to DIR's base name."""
    if not specs:
        raise UserError(
            "eval: no --data; name the sets to evaluate with --data DIR or --data NAME=DIR"
            " (repeatable)"
        )
    sets = evalsets.parse_specs(specs, "eval: --data")
    evalsets.check_prepared(sets, "eval: --data")
    return sets


def set_pipeline(opened: Opened, name: str, directory: str, split: str, sharding):
    """The dataset as a pipeline whose eval windows are the split to evaluate
    (train/data/evalsets.py), checked against the checkpoint's tokenizer and vocabulary."""
    cfg, d, t = opened.cfg, opened.cfg.data, opened.cfg.train

    def check_tokenizer(record: dict, where: str) -> None:
        checkpoint_match.check_tokenizer(opened.meta, record, d.allow_tokenizer_mismatch, where)

    return evalsets.open_set(
        name,
        directory,
        split=split,
        data_cfg=d,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        seed=t.seed,
        vocab_size=cfg.model.vocab_size,
        sharding=sharding,
        where=f"eval: --data {name}={directory}",
        check_tokenizer=check_tokenizer,
        other_split_hint="--split all, " if split == "eval" else "",
    )


def make_eval_parser() -> ArgParser:
    parser = command_parser(
        "python -m train eval", "Mean loss and perplexity of a checkpoint on prepared datasets."
    )
    # --data names a set here (repeatable), not --data.source: this --data takes the run flag's
    # alias (a group copies its parser's conflict handler when it is made)
    parser.conflict_handler = "resolve"
    g = parser.add_argument_group("evaluation")
    g.add_argument(
        "--data",
        action="append",
        metavar="[NAME=]DIR",
        help="a prepared dataset to evaluate on, named NAME (default: DIR's base name); repeatable",
    )
    g.add_argument(
        "--split",
        choices=SPLITS,
        default="eval",
        help="eval: the held-out documents (--data.eval_fraction); all: every document",
    )
    g.add_argument(
        "--eval-batches",
        type=number(int, ">=0"),
        default=0,
        metavar="N",
        help="evaluate at most N batches of --batch-size windows per set; 0 = every window",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


@one_line_errors
def main(argv: list[str]) -> int:
    ns = make_eval_parser().parse_args(argv)
    if "data.source" in vars(ns):
        raise UserError(
            "eval: --data.source is the training data; name the sets to evaluate with --data"
            " [NAME=]DIR"
        )
    sets = parse_sets(ns.data)
    opened = open_model(ns.ckpt, ns, EVAL_SETTINGS)
    s = opened.setup()
    # every set opened and checked before the parameters are read
    pipelines = [set_pipeline(opened, name, d, ns.split, s.batch_sharding) for name, d in sets]
    params, evaluator = opened.params(s), Evaluator(s)
    t, results = opened.cfg.train, {}
    for (name, directory), pipeline in zip(sets, pipelines):
        batches, windows = evalsets.split_batches(pipeline, ns.eval_batches, s.batch_sharding)
        loss = evaluator.loss(params, batches)
        results[name] = {
            "data": os.path.abspath(directory),
            "loss": loss,
            "perplexity": math.exp(min(loss, 709.0)),
            "windows": windows,
            "of_windows": pipeline.eval[0].n,
            "batches": len(batches),
        }
    if jax.process_index() == 0:
        print(
            json.dumps(
                {
                    "checkpoint": opened.src.step_dir(opened.step),
                    "step": opened.step,
                    "split": ns.split,
                    "batch_size": t.batch_size,
                    "seq_len": t.seq_len,
                    "sets": results,
                }
            )
            if ns.json
            else "\n".join(_line(name, r, ns.split, t.seq_len) for name, r in results.items()),
            flush=True,
        )
    return 0


def _line(name: str, r: dict, split: str, seq_len: int) -> str:
    part = (
        f"{r['windows']}"
        if r["windows"] == r["of_windows"]
        else f"{r['windows']} of {r['of_windows']}"
    )
    what = "eval split" if split == "eval" else "all documents"
    return (
        f"{name}: loss {r['loss']:.4f}, perplexity {r['perplexity']:.2f} ({what} of {r['data']}:"
        f" {part} windows of {seq_len} tokens, {r['batches']} batches)"
    )
