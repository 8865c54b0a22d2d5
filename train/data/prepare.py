"""`python -m train.data prepare INPUTS... --tokenizer TOK --out DIR`: text files, globs, directories,
JSONL (plain, .gz, .zst), Parquet and HuggingFace `datasets` directories (train/data/formats.py)
-> memory-mapped token shards with document boundaries and a JSON index.

Layout of DIR:
  index.json                  tokenizer (kind, path, sha256, id), vocab_size, eos_id, dtype, token and
                              document counts, and per shard its file names, counts, sha256 and largest
                              token id (`max_token`); its schema is train/data/index.py
  shard-00000.bin             tokens, raw little-endian uint16 (vocabulary <= 65536) or uint32
  shard-00000.offsets.npy     int64 [n_documents + 1]: document d is tokens[offsets[d]:offsets[d+1]]
  shard-00000.mask.bin        (--format chat|prompt_completion) uint8 per token: 1 = trained on
                              (train/data/chat.py)
Each document ends with the tokenizer's EOS id. Documents keep input order (files sorted inside a
directory or glob; JSONL lines in file order), whatever the number of workers. Everything is written
into `DIR.tmp-<random>` and renamed to DIR only on success, so a failed run leaves nothing behind.
`--overwrite` replaces only a directory that holds a prepared dataset and nothing else (check_out).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import glob
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile

import numpy as np

from checkpoint import storage
from errors import ArgParser, UserError, number, one_line_errors
from train.data import chat, formats, tokenizers
from train.data.formats import JSONL_SUFFIXES
from train.data.index import (
    FORMAT,
    INDEX,
    MASKED_FORMAT,
    ShardWriter,
    listed_files,
    read_index,
    token_dtype,
)

TASK_BYTES = 4 << 20  # input bytes per worker task at most: amortises the IPC, keeps the bar moving
MIN_TASK_BYTES = 16 << 10  # ... and at least (small inputs are still spread over the workers)


def make_parser() -> argparse.ArgumentParser:
    p = ArgParser(
        prog="python -m train.data prepare",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Tokenise text files, globs, directories, JSONL, Parquet and HuggingFace datasets"
        " into memory-mapped token shards.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text file, JSONL file (.jsonl, .jsonl.gz, .jsonl.zst), Parquet file, HuggingFace datasets"
        " directory (save_to_disk), other directory, or glob",
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte | hf:FILE.json | sentencepiece:FILE.model | tiktoken:FILE.tiktoken (kind from the suffix"
        " if omitted)",
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
        help="text: documents; prompt_completion: records {prompt, completion}, trained on the completion;"
        " chat: records {messages: [{role, content}, ...]} rendered with --tokenizer HF_MODEL_DIR's chat"
        " template, trained on the assistant turns",
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


# ------------------------------------------------------------------ inputs -> tasks


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files in a stable order: each input in command-line order; a directory's or glob's files sorted."""
    files: list[str] = []
    for spec in inputs:
        shards = formats.dataset_files(spec) if os.path.isdir(spec) else None
        if shards is not None:
            files += shards
        elif os.path.isdir(spec):
            for dirpath, dirnames, names in os.walk(spec):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                files += [os.path.join(dirpath, n) for n in sorted(names) if not n.startswith(".")]
        elif os.path.exists(spec):
            files.append(spec)
        elif glob.has_magic(spec):
            matched = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f))
            if not matched:
                raise UserError(f"prepare: input glob '{spec}' matches no file")
            files += matched
        else:
            raise UserError(f"prepare: input '{spec}' is not a file, directory or glob")
    if not files:
        raise UserError(f"prepare: no input files in {' '.join(inputs)}")
    for f in files:
        if not os.access(f, os.R_OK):
            raise UserError(f"prepare: cannot read input file '{f}' (permission denied)")
    return files


def make_tasks(files: list[str], workers: int = 1) -> list[list[tuple[str, int, int]]]:
    """Work units of (path, start, end) byte ranges, about 8 per worker within [MIN_TASK_BYTES,
    TASK_BYTES]; JSONL files are split at arbitrary offsets (a line belongs to the range it starts
    in), text files stay whole, and a streamed file (formats.is_streamed) is a task of its own,
    read in chunks by `chunked`."""
    sizes = [os.path.getsize(f) for f in files]
    task_bytes = min(TASK_BYTES, max(MIN_TASK_BYTES, sum(sizes) // (8 * workers)))
    tasks, current, size = [], [], 0
    for path, n in zip(files, sizes):
        if formats.is_streamed(path):
            tasks += [current] * bool(current) + [[(path, 0, n)]]
            current, size = [], 0
            continue
        step = task_bytes if path.endswith(JSONL_SUFFIXES) else max(n, 1)
        for start in range(0, max(n, 1), step):
            current.append((path, start, min(start + step, n)))
            size += min(step, n - start)
            if size >= task_bytes:
                tasks.append(current)
                current, size = [], 0
    return tasks + ([current] if current else [])


# ------------------------------------------------------------------ workers

_TOKENIZER: tokenizers.Tokenizer | None = None


def _init_worker(spec: str, eos_token: str | None, pool: bool) -> None:
    global _TOKENIZER
    if pool:  # HF tokenizers' own thread pool in every worker would oversubscribe the cores
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER = tokenizers.load(spec, eos_token)


def chunked(tasks: list, text_field: str):
    """The tasks, with each streamed file's task replaced by the Chunks of documents read from it
    here, in the main process (a compressed stream cannot be split among workers)."""
    for task in tasks:
        path = task[0][0]
        if formats.is_streamed(path):  # make_tasks gives such a file a task of its own
            yield from formats.read_chunks(path, text_field, TASK_BYTES)
        else:
            yield task


def _work(task, text_field, on_bad_utf8: str, dtype: str, input_format: str = "text"):
    """-> (tokens [N] of dtype, doc lengths int64 [D], input bytes, skipped names, loss mask uint8 [N]
    or None for text). Documents end with EOS. `task`: byte ranges of text/JSONL files to read, or a
    Chunk of documents already read; `text_field`: the records' fields for a record format."""
    if isinstance(task, formats.Chunk):
        docs, n_bytes = task.docs, task.n_bytes
    else:
        docs = [
            d for path, start, end in task for d in formats.read_range(path, start, end, text_field)
        ]
        n_bytes = sum(end - start for _, start, end in task)
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


# ------------------------------------------------------------------ output directory


def _within(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or lies inside it (both already real paths)."""
    return os.path.commonpath([path, directory]) == directory


def check_out(out: str, inputs: list[str], files: list[str], overwrite: bool) -> None:
    """Refuses (UserError, before anything is written or deleted) an --out whose replacement would
    lose data: one that is or contains an input, the current directory, the home directory or /;
    one inside an input directory (the next run would read the dataset as input); an existing one
    without --overwrite; and, with it, anything but a directory that holds a prepared dataset and
    nothing else, so that the only files --overwrite deletes are ones `prepare` wrote."""
    local = storage.is_local(out)  # an object store holds no input, no current or home directory
    real = os.path.realpath(out) if local else out
    if local and os.path.lexists(out):  # a new directory cannot hold anything yet
        guarded = {
            "the current directory": os.getcwd(),
            "the home directory": os.path.expanduser("~"),
            "/": os.sep,
        }
        guarded |= {
            f"the input '{p}'": p for p in [*(i for i in inputs if os.path.exists(i)), *files]
        }
        for what, path in guarded.items():
            if _within(os.path.realpath(path), real):
                raise UserError(
                    f"prepare: --out '{out}' is or contains {what}; name a new directory for the dataset"
                )
    for spec in inputs:
        if local and os.path.isdir(spec) and _within(real, os.path.realpath(spec)):
            raise UserError(
                f"prepare: --out '{out}' is inside the input directory '{spec}', whose files are all"
                f" read as input; name a directory outside it"
            )
    if not storage.lexists(out):
        return
    if not overwrite:
        raise UserError(
            f"prepare: --out '{out}' already exists; choose another directory or pass --overwrite"
        )
    only = "--overwrite replaces only a directory that holds a prepared dataset and nothing else"
    if (local and os.path.islink(out)) or not storage.isdir(out):
        raise UserError(
            f"prepare: --out '{out}' is {'a symbolic link' if os.path.islink(out) else 'not a directory'};"
            f" {only}"
        )
    listed = listed_files(
        read_index(out, f"prepare: --out '{out}'", f"{only}; name a new directory")
    )
    present = set(storage.listdir(out))
    foreign = sorted(present - listed)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(
            f"prepare: --out '{out}' holds '{foreign[0]}'{more}, which prepare did not write; {only}"
        )
    # prepare writes plain files only: a listed name that is a directory or a link holds (or points
    # at) something else, which deleting the old shards must not touch
    for name in sorted(present & listed):
        target = storage.join(out, name)
        if (local and os.path.islink(target)) or storage.isdir(target):
            kind = "a symbolic link" if local and os.path.islink(target) else "a directory"
            raise UserError(
                f"prepare: --out '{out}': '{name}', which its index names as a file of the dataset,"
                f" is {kind}; {only}"
            )


def _replace(out: str, tmp: str) -> None:
    """Moves the finished `tmp` to `out`; an existing `out` (a dataset check_out accepted) goes only
    once the new one is in place, and only the files its index lists: anything that appeared since
    the check is kept, with a warning."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    listed = listed_files(
        read_index(out, f"prepare: --out '{out}'", "it changed while prepare ran")
    )
    trash = tempfile.mkdtemp(prefix=f"{os.path.basename(out)}.old-", dir=os.path.dirname(out))
    old = os.path.join(trash, "dataset")
    os.rename(out, old)
    os.rename(tmp, out)
    for name in listed:
        path = os.path.join(old, name)
        if os.path.isfile(path) and not os.path.islink(path):  # what prepare wrote: plain files
            os.remove(path)
    try:
        os.rmdir(old)
        os.rmdir(trash)
    except OSError:
        print(f"prepare: kept {old}: it holds files that prepare did not write", file=sys.stderr)


def _make_tmp(out: str) -> str:
    """An empty directory next to `out` for the new dataset (renamed to `out` once complete)."""
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"{os.path.basename(out)}.tmp-", dir=parent)
    except OSError as e:
        raise UserError(
            f"prepare: cannot create a directory next to --out '{out}': {e.strerror}"
        ) from None


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
    """Tokenise `inputs` into `out`; returns the index. Raises UserError (nothing left on disk) on bad input."""
    if workers < 1 or shard_tokens < 1:
        raise UserError(
            f"prepare: --workers and --shard-tokens must be >= 1, got {workers} and {shard_tokens}"
        )
    files = expand_inputs(inputs)
    check_out(out, inputs, files, overwrite)
    tok = tokenizers.load(tokenizer, eos_token)  # fails here, once, rather than in every worker
    fields = chat.check_options(
        tok, input_format, text_field
    )  # what the readers take from each record
    info = tok.describe()
    dtype = token_dtype(tok.vocab_size)
    tasks = make_tasks(files, workers)
    out = storage.absolute(out)
    tmp = (
        _make_tmp(out) if storage.is_local(out) else tempfile.mkdtemp(prefix="brigade-prepare-")
    )  # then uploaded
    from tqdm import tqdm

    bar = tqdm(
        total=sum(e - s for t in tasks for _, s, e in t),
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not progress,
        file=sys.stderr,
    )
    try:
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
        n_docs = sum(s["n_documents"] for s in writer.shards)
        if not n_docs:
            raise UserError(
                f"prepare: no non-empty documents in {' '.join(inputs)}"
                + (f" ({len(skipped)} skipped as not UTF-8)" if skipped else "")
            )
        index = {
            "format": MASKED_FORMAT if writer.masked else FORMAT,
            "input_format": input_format,
            "tokenizer": info,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": dtype.name,
            "n_tokens": sum(s["n_tokens"] for s in writer.shards),
            "n_documents": n_docs,
            "input_bytes": n_bytes,
            "skipped_not_utf8": len(skipped),
            "inputs": list(inputs),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "shards": writer.shards,
        }
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump(index, f, indent=1)
        if storage.is_local(out):
            _replace(out, tmp)
        else:
            storage.upload_dir(tmp, out, last=INDEX)
    except BaseException:
        bar.leave = False  # the error line stands alone
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(
        tmp, ignore_errors=True
    )  # what an upload left behind (a local dataset was renamed away)
    if skipped:
        print(
            f"prepare: skipped {len(skipped)} documents that are not UTF-8 (first: {skipped[0]})",
            file=sys.stderr,
        )
    return index


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
    print(
        f"{args.out}: {index['n_documents']} {'documents' if args.input_format == 'text' else 'records'},"
        f" {index['n_tokens']} tokens ({index['dtype']}) in {len(index['shards'])} shards, tokenizer"
        f" {index['tokenizer']['id']} (vocab {index['vocab_size']})"
    )
    return 0
