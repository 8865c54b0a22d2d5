"""prepare's inputs: files, directories, globs and `datasets` directories expanded in a stable
order, then cut into worker tasks of byte ranges (a streamed file, read in the main process,
is a task of its own)."""

from __future__ import annotations

import glob
import os

from errors import UserError
from train.data import formats
from train.data.formats import JSONL_SUFFIXES

TASK_BYTES = 4 << 20  # input bytes per worker task at most: amortises the IPC, keeps the bar moving


MIN_TASK_BYTES = 16 << 10  # ... and at least (small inputs are still spread over the workers)


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files in a stable order: each input in command-line order; a directory's or glob's files
    sorted."""
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


def chunked(tasks: list, text_field: str):
    """The tasks, with each streamed file's task replaced by the Chunks of documents read from it
    here, in the main process (a compressed stream cannot be split among workers)."""
    for task in tasks:
        path = task[0][0]
        if formats.is_streamed(path):  # make_tasks gives such a file a task of its own
            yield from formats.read_chunks(path, text_field, TASK_BYTES)
        else:
            yield task
