"""`python -m train.data prepare INPUTS... --tokenizer TOK --out DIR`: text files, globs,
directories, JSONL (plain, .gz, .zst), Parquet and HuggingFace `datasets` directories
(train/data/formats.py) -> memory-mapped token shards with document boundaries and a JSON index.

Layout of DIR:
  index.json               tokenizer (kind, path, sha256, id), vocab_size, eos_id, dtype, token and
                           document counts, and per shard its file names, counts, sha256 and
                           largest token id (`max_token`); its schema is train/data/index.py
  shard-00000.bin          tokens, raw little-endian uint16 (vocabulary <= 65536) or uint32
  shard-00000.offsets.npy  int64 [n_documents + 1]: document d is tokens[offsets[d]:offsets[d+1]]
  shard-00000.mask.bin     (--format chat|prompt_completion|preference|prompts) uint8 per
                           token: 1 = trained on (train/data/chat.py, preference_records.py),
                           for prompts the answer (train/data/prompt_records.py)
Each document ends with the tokenizer's EOS id. Documents keep input order (files sorted inside a
directory or glob; JSONL lines in file order), whatever the number of workers. Everything is
written into `DIR.tmp-<random>` and renamed to DIR only on success, so a failed run leaves nothing
behind. `--overwrite` replaces only a directory that holds a prepared dataset and nothing else
(train/data/prepare_output.py check_out).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile

import numpy as np

from checkpoint import storage
from errors import ArgParser, UserError, number, one_line_errors
from train.data import chat, formats, preference_records, prompt_records, tokenizers
from train.data.index import (
    FORMAT,
    INDEX,
    MASKED_FORMAT,
    ShardWriter,
    token_dtype,
)
from train.data.prepare_inputs import chunked, expand_inputs, make_tasks
from train.data.prepare_output import check_out, make_tmp, replace_with


def make_parser() -> argparse.ArgumentParser:
    # One function on purpose (~65 lines): the command's flags, one add_argument each, in the order
    # --help lists them.
    p = ArgParser(
        prog="python -m train.data prepare",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Tokenise text files, globs, directories, JSONL, Parquet and HuggingFace"
        " datasets into memory-mapped token shards.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text file, JSONL file (.jsonl, .jsonl.gz, .jsonl.zst), Parquet file, HuggingFace"
        " datasets directory (save_to_disk), other directory, or glob",
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte | hf:FILE.json | sentencepiece:FILE.model | tiktoken:FILE.tiktoken (kind from"
        " the suffix if omitted)",
    )
    p.add_argument(
        "--out", required=True, help="output directory (must not exist unless --overwrite)"
    )
    p.add_argument(
        "--text-field",
        default="text",
        help="JSONL field, or Parquet/datasets column, holding the document text (--format text)",
    )
    p.add_argument(
        "--format",
        dest="input_format",
        choices=chat.FORMATS,
        default="text",
        help="text: documents; prompt_completion: records {prompt, completion}, trained on the"
        " completion; chat: records {messages: [{role, content}, ...]} rendered with --tokenizer"
        " HF_MODEL_DIR's chat template, trained on the assistant turns; preference: records"
        " {prompt, chosen, rejected} (strings or chat message lists) for --objective"
        " dpo|ipo|orpo|simpo, two documents each, the responses masked in; prompts: records"
        " {prompt, answer} (answer optional) for --objective grpo",
    )
    p.add_argument(
        "--workers",
        type=number(int, ">=1"),
        default=os.cpu_count() or 1,
        help="tokenising processes; 1 = in-process",
    )
    p.add_argument(
        "--on-bad-utf8",
        choices=("fail", "skip"),
        default="fail",
        help="a document that is not UTF-8: stop with its name, or skip it and report the count",
    )
    p.add_argument(
        "--eos-token", default=None, help="end-of-document token (default: found in the vocabulary)"
    )
    p.add_argument(
        "--shard-tokens",
        type=number(int, ">=1"),
        default=1 << 28,
        help="start a new shard after this many tokens",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out directory, if it holds a prepared dataset and nothing else",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ------------------------------------------------------------------ workers

_TOKENIZER: tokenizers.Tokenizer | None = None


def _init_worker(spec: str, eos_token: str | None, pool: bool) -> None:
    global _TOKENIZER
    if pool:  # HF tokenizers' own thread pool in every worker would oversubscribe the cores
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER = tokenizers.load(spec, eos_token)


def _work(task, text_field, on_bad_utf8: str, dtype: str, input_format: str = "text"):
    """-> (tokens [N] of dtype, doc lengths int64 [D], input bytes, skipped names, loss mask uint8
    [N] or None for text). Documents end with EOS. `task`: byte ranges of text/JSONL files to read,
    or a Chunk of documents already read; `text_field`: the records' fields for a record format."""
    if isinstance(task, formats.Chunk):
        docs, n_bytes = task.docs, task.n_bytes
    else:
        docs = [
            d for path, start, end in task for d in formats.read_range(path, start, end, text_field)
        ]
        n_bytes = sum(end - start for _, start, end in task)
    if input_format == "preference":  # two documents per record: prompt + chosen, + rejected
        tokens, lengths, mask = preference_records.encode_pairs(_TOKENIZER, docs)
        return _checked(tokens).astype(dtype), lengths, n_bytes, [], mask
    if input_format == "prompts":  # one document per record: prompt + answer, the answer masked
        tokens, lengths, mask = prompt_records.encode_prompts(_TOKENIZER, docs)
        return _checked(tokens).astype(dtype), lengths, n_bytes, [], mask
    if input_format != "text":
        tokens, lengths, mask = chat.encode_records(_TOKENIZER, input_format, docs)
        return _checked(tokens).astype(dtype), lengths, n_bytes, [], mask
    texts, skipped = [], []
    for where, raw in docs:
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if on_bad_utf8 == "fail":
                    raise UserError(
                        f"prepare: {where} is not UTF-8 text (byte {e.start}); pass --on-bad-utf8"
                        f" skip to skip such documents"
                    ) from None
                skipped.append(where)
                continue
        if raw:
            texts.append(raw)
    ids = _TOKENIZER.encode(texts) if texts else []
    eos = np.array([_TOKENIZER.eos_id], np.int64)
    tokens = np.concatenate([x for t in ids for x in (t, eos)]) if ids else np.zeros(0, np.int64)
    return (
        _checked(tokens).astype(dtype),
        np.array([len(t) + 1 for t in ids], np.int64),
        n_bytes,
        skipped,
        None,
    )


def _checked(tokens: np.ndarray) -> np.ndarray:
    if len(tokens) and int(tokens.max()) >= _TOKENIZER.vocab_size:
        raise UserError(
            f"prepare: the tokenizer produced id {int(tokens.max())} >= its vocab_size"
            f" {_TOKENIZER.vocab_size}"
        )
    return tokens


def prepare(
    inputs: list[str],
    out: str,
    tokenizer: str = "byte",
    *,
    text_field: str = "text",
    workers: int = 1,
    on_bad_utf8: str = "fail",
    eos_token: str | None = None,
    shard_tokens: int = 1 << 28,
    overwrite: bool = False,
    progress: bool = True,
    input_format: str = "text",
) -> dict:
    """Tokenise `inputs` into `out`; returns the index. Raises UserError (nothing left on disk) on
    bad input."""
    if workers < 1 or shard_tokens < 1:
        raise UserError(
            f"prepare: --workers and --shard-tokens must be >= 1, got {workers} and {shard_tokens}"
        )
    files = expand_inputs(inputs)
    check_out(out, inputs, files, overwrite)
    tok = tokenizers.load(tokenizer, eos_token)  # fails here, once, rather than in every worker
    # what the readers take from each record
    fields = chat.check_options(tok, input_format, text_field)
    tasks = make_tasks(files, workers)
    out = storage.absolute(out)
    # an object store's dataset is written here first, then uploaded
    tmp = make_tmp(out) if storage.is_local(out) else tempfile.mkdtemp(prefix="brigade-prepare-")
    bar = _progress_bar(sum(e - s for t in tasks for _, s, e in t), progress)
    try:
        work = (tokenizer, eos_token, fields, on_bad_utf8, workers, input_format)
        writer, skipped, n_bytes = _write_shards(tmp, tasks, bar, tok, shard_tokens, work)
        index = _index(inputs, writer, tok, input_format, n_bytes, skipped)
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump(index, f, indent=1)
        if storage.is_local(out):
            replace_with(out, tmp)
        else:
            storage.upload_dir(tmp, out, last=INDEX)
    except BaseException:
        bar.leave = False  # the error line stands alone
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # what an upload left behind (a local dataset was renamed away)
    shutil.rmtree(tmp, ignore_errors=True)
    if skipped:
        print(
            f"prepare: skipped {len(skipped)} documents that are not UTF-8 (first: {skipped[0]})",
            file=sys.stderr,
        )
    return index


def _progress_bar(total_bytes: int, progress: bool):
    """tqdm's bar over the input bytes, on stderr (`progress` false: a bar that draws nothing)."""
    from tqdm import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not progress,
        file=sys.stderr,
    )


def _write_shards(tmp: str, tasks: list, bar, tok, shard_tokens: int, work: tuple):
    """The tasks tokenised (by `work`'s workers: tokenizer spec, EOS token, fields, --on-bad-utf8,
    worker count, input format) into shards in `tmp` -> (the writer, the documents skipped as not
    UTF-8, the input bytes read)."""
    tokenizer, eos_token, fields, on_bad_utf8, workers, input_format = work
    dtype = token_dtype(tok.vocab_size)
    writer = ShardWriter(tmp, dtype, shard_tokens, masked=input_format != "text")
    skipped: list[str] = []
    n_bytes = 0
    with _results(
        chunked(tasks, fields),
        len(tasks),
        tokenizer,
        eos_token,
        fields,
        on_bad_utf8,
        dtype.name,
        workers,
        input_format,
    ) as results:
        for tokens, lengths, nb, skip, mask in results:
            writer.add(tokens, lengths, mask)
            skipped += skip
            n_bytes += nb
            bar.update(nb)
    writer.close()
    bar.close()
    return writer, skipped, n_bytes


def _index(inputs: list[str], writer, tok, input_format: str, n_bytes: int, skipped: list) -> dict:
    """The dataset's index.json (its schema: train/data/index.py); no document at all is refused."""
    n_docs = sum(s["n_documents"] for s in writer.shards)
    if not n_docs:
        raise UserError(
            f"prepare: no non-empty documents in {' '.join(inputs)}"
            + (f" ({len(skipped)} skipped as not UTF-8)" if skipped else "")
        )
    return {
        "format": MASKED_FORMAT if writer.masked else FORMAT,
        "input_format": input_format,
        "tokenizer": tok.describe(),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": token_dtype(tok.vocab_size).name,
        "n_tokens": sum(s["n_tokens"] for s in writer.shards),
        "n_documents": n_docs,
        "input_bytes": n_bytes,
        "skipped_not_utf8": len(skipped),
        "inputs": list(inputs),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shards": writer.shards,
    }


class _results:
    """Task results in task order: in-process for one worker, else a pool of spawned processes
    (fork is unsafe once JAX's or a tokenizer's threads exist; spawning costs ~1 s once). The pool
    is fed at most two tasks per worker ahead: `tasks` is a generator that reads streamed files
    as it goes, so their documents are held a few chunks at a time."""

    def __init__(
        self, tasks, n_tasks, spec, eos_token, text_field, on_bad_utf8, dtype, workers, input_format
    ):
        self.tasks, self.spec, self.eos_token = tasks, spec, eos_token
        self.work = functools.partial(
            _work,
            text_field=text_field,
            on_bad_utf8=on_bad_utf8,
            dtype=dtype,
            input_format=input_format,
        )
        self.workers, self.pool = min(workers, n_tasks), None

    def __enter__(self):
        if self.workers <= 1:
            _init_worker(self.spec, self.eos_token, pool=False)
            return map(self.work, self.tasks)
        self.pool = mp.get_context("spawn").Pool(
            self.workers, initializer=_init_worker, initargs=(self.spec, self.eos_token, True)
        )
        return self._in_order()

    def _in_order(self):
        pending = collections.deque()
        for task in self.tasks:
            pending.append(self.pool.apply_async(self.work, (task,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    index = prepare(
        args.inputs,
        args.out,
        args.tokenizer,
        text_field=args.text_field,
        workers=args.workers,
        on_bad_utf8=args.on_bad_utf8,
        eos_token=args.eos_token,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        input_format=args.input_format,
    )
    pairs = args.input_format == "preference"  # two documents a record
    count = index["n_documents"] // 2 if pairs else index["n_documents"]
    print(
        f"{args.out}: {count}"
        f" {'documents' if args.input_format == 'text' else 'pairs' if pairs else 'records'},"
        f" {index['n_tokens']} tokens"
        f" ({index['dtype']}) in {len(index['shards'])} shards, tokenizer"
        f" {index['tokenizer']['id']} (vocab {index['vocab_size']})"
    )
    return 0
