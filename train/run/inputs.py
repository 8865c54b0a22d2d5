"""What a run reads: the batches it trains on (the built-in pipeline of --data, or the Trainer's
own iterable behind the same interface) and the --data.eval_source sets it also evaluates on,
each checked against the model's vocabulary and tokenizer before anything compiles."""

from __future__ import annotations

from checkpoint.manager import open_checkpoint
from errors import UserError
from train.core.setup import RunSetup
from train.data import make_pipeline
from train.data.evalsets import EvalSet, open_eval_source
from train.data.external import IterableData
from train.data.pairs import make_pair_pipeline
from train.data.prompts import make_prompt_pipeline
from train.run import checkpoint_match


def open_data(s: RunSetup, data=None, eval_data=None):
    """The built-in pipeline of --data, or `data` (an iterable of batches, train/data/external.py)
    with its `eval_data`."""
    cfg, t = s.cfg, s.cfg.train
    if cfg.post.objective != "lm" and data is not None:
        raise UserError(
            f"Trainer(data=...): --objective {cfg.post.objective} reads a dataset prepared with"
            f" `prepare --format {'prompts' if cfg.post.grpo else 'preference'}` (--data DIR)"
        )
    if cfg.post.grpo:  # batches of prompts, completed by the rollouts (train/run/rollouts.py)
        return make_prompt_pipeline(
            cfg.data,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            max_new=cfg.post.max_new_tokens,
            seed=t.seed,
            per_rollout=cfg.post.updates_per_rollout,
            vocab_size=cfg.model.vocab_size,
        )
    if cfg.post.preference:  # batches of pairs (train/data/pairs.py)
        return make_pair_pipeline(
            cfg.data,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            seed=t.seed,
            batch_sharding=s.batch_sharding,
            vocab_size=cfg.model.vocab_size,
        )
    if data is not None:
        return IterableData(
            data,
            eval_data,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            packing_mask=cfg.data.packing_mask,
            batch_sharding=s.batch_sharding,
            vocab_size=cfg.model.vocab_size,
        )
    return make_pipeline(
        cfg.data,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        seed=t.seed,
        batch_sharding=s.batch_sharding,
        vocab_size=cfg.model.vocab_size,
    )


def open_eval_sets(s: RunSetup, data) -> list[EvalSet]:
    """--data.eval_source, opened and checked against the model's vocabulary and tokenizer: the
    training data's (the ids the model learns), or for a user's iterable, which records none, the
    --init-from checkpoint's; with neither there is nothing to compare."""
    cfg, t = s.cfg, s.cfg.train
    if not cfg.data.eval_source:
        return []
    sources = getattr(data, "sources", None)
    if sources:
        meta, whose = {"tokenizer": sources[0].tokenizer}, "the training data's"
    elif cfg.checkpoint.init_from:
        src, at = open_checkpoint(cfg.checkpoint.init_from)
        meta, whose = src.meta(at), "the --init-from checkpoint's"
    else:
        meta, whose = {}, ""

    def check_tokenizer(record: dict, where: str) -> None:
        checkpoint_match.check_tokenizer(
            meta, record, cfg.data.allow_tokenizer_mismatch, where, whose
        )

    return open_eval_source(
        cfg.data,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        seed=t.seed,
        eval_batches=t.eval_batches,
        vocab_size=cfg.model.vocab_size,
        sharding=s.batch_sharding,
        check_tokenizer=check_tokenizer,
    )
