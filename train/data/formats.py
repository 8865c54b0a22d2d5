"""What `prepare` reads from each kind of input file: documents as (where, text) pairs.

  text file                  one document (raw bytes: prepare decodes them, --on-bad-utf8)
  .jsonl .ndjson             one document per line, text in --text-field; split across workers by
                             byte range (a line belongs to the range it starts in)
  .jsonl.gz .jsonl.zst       the same, compressed (gzip; Zstandard via `zstandard`)
  (.ndjson.gz .ndjson.zst)
  .parquet                   one document per row, text in the --text-field column (`pyarrow`)
  .arrow                     the same, an Arrow IPC stream: the shards of a HuggingFace `datasets`
                             directory (`save_to_disk`), which `dataset_files` lists in order

`--format chat|prompt_completion` (train/data/chat.py) reads records instead of texts: `text_field`
is then the tuple of the fields it needs, and a document is the dict of those a record holds.

A compressed stream cannot be entered in the middle, and a Parquet or Arrow file is read by record
batches, so these are read in the main process, streamed, and handed to the tokenising workers as
`Chunk`s of documents (~`chunk_bytes` of text each): memory holds a few chunks, never a whole file.
The optional packages are imported only when such a file is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterator

from errors import UserError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED = {".gz": "gzip", ".zst": "Zstandard"}
STREAMED_SUFFIXES = tuple(j + c for j in JSONL_SUFFIXES for c in COMPRESSED) + (
    ".parquet",
    ".arrow",
)
INSTALL = "pip install 'brigade[data]'"


@dataclasses.dataclass
class Chunk:
    """Documents read from a streamed file, and the file bytes they took (for the progress bar)."""

    docs: list[tuple[str, str]]
    n_bytes: int


def is_streamed(path: str) -> bool:
    return path.endswith(STREAMED_SUFFIXES)


def line_where(where: str) -> str:
    """`PATH (byte N)` (a plain JSONL record) -> `PATH:LINE`, counting the lines before byte N; a
    record's line number is worked out only for an error message, never while reading."""
    found = re.fullmatch(r"(.*) \(byte (\d+)\)", where)
    if not found:
        return re.sub(r" \(line (\d+)\)$", r":\1", where)
    path, pos, lines = found[1], int(found[2]), 1
    with open(path, "rb") as f:
        while pos > 0:
            block = f.read(min(pos, 1 << 22))
            if not block:
                break
            lines, pos = lines + block.count(b"\n"), pos - len(block)
    return f"{path}:{lines}"


def json_text(line: bytes, where: str, text_field: str | tuple[str, ...]) -> str | dict:
    """The text of one JSONL record (or, for a tuple of fields, the dict of those it holds);
    UserError naming `where` if the line is not a record with it."""
    try:
        record = json.loads(line)
    except ValueError:
        raise UserError(
            f"prepare: {where}: not a JSON line; JSONL inputs need one object per line"
        ) from None
    if isinstance(text_field, tuple):  # chat.py checks the fields, naming the record's line
        if not isinstance(record, dict):
            raise UserError(
                f"prepare: {line_where(where)}: not a JSON object; JSONL inputs need one object"
                " per line"
            )
        return {k: record[k] for k in text_field if k in record}
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise UserError(
            f"prepare: {where}: no string field '{text_field}'; set --text-field"
            f" (fields here: {', '.join(record) if isinstance(record, dict) else 'none'})"
        )
    return text


def read_range(path: str, start: int, end: int, text_field: str) -> list[tuple[str, str | bytes]]:
    """The documents of a text or JSONL file that start in bytes [start, end)."""
    try:
        with open(path, "rb") as f:
            if not path.endswith(JSONL_SUFFIXES):
                return [(path, f.read())]
            if start:
                f.seek(start - 1)
                f.readline()  # the line that straddles `start` belongs to the previous range
            docs = []
            while f.tell() < end:
                pos, line = f.tell(), f.readline()
                if not line:
                    break
                if line.strip():
                    where = f"{path} (byte {pos})"
                    docs.append((where, json_text(line, where, text_field)))
            return docs
    except OSError as e:
        raise UserError(f"prepare: cannot read input file '{path}': {e.strerror}") from None


def read_chunks(path: str, text_field: str, chunk_bytes: int) -> Iterator[Chunk]:
    """A streamed file's documents in file order, as Chunks of about `chunk_bytes` of text."""
    rows = (
        _records(path, text_field)
        if path.endswith((".parquet", ".arrow"))
        else _lines(path, text_field)
    )
    docs, size, done = [], 0, 0
    for where, text, position in rows:
        docs.append((where, text))
        size += len(text) if isinstance(text, str) else len(str(text))
        if size >= chunk_bytes:
            yield Chunk(docs, position - done)
            docs, size, done = [], 0, position
    yield Chunk(docs, os.path.getsize(path) - done)


def _open(path: str):
    """The input file, opened for reading; UserError naming it otherwise."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise UserError(f"prepare: cannot read input file '{path}': {e.strerror}") from None


def _lines(path: str, text_field: str) -> Iterator[tuple[str, str, int]]:
    """(where, text, compressed bytes read so far) per record of a compressed JSONL file."""
    kind = COMPRESSED[os.path.splitext(path)[1]]
    errors: tuple[type[Exception], ...] = (OSError, EOFError, zlib.error)
    with _open(path) as raw:
        if kind == "gzip":
            stream = gzip.GzipFile(fileobj=raw)
        else:
            zstandard = _optional("zstandard", path)
            errors += (zstandard.ZstdError,)
            stream = io.BufferedReader(_ZstdFrames(raw, zstandard))
        try:
            for n, line in enumerate(stream, 1):
                if line.strip():
                    where = f"{path} (line {n})"
                    yield where, json_text(line, where, text_field), raw.tell()
        except errors as e:
            raise UserError(
                f"prepare: {path}: not valid {kind} data ({e or type(e).__name__}); the file is"
                f" corrupt or truncated"
            ) from None


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a Zstandard file (one frame or several in a row). zstandard's own
    stream reader ends quietly where a truncated file ends, so a cut file's half line would reach
    the JSON parser (or a cut at a line break would pass unnoticed): here a file that ends inside a
    frame raises EOFError, which `_lines` reports as gzip's truncation is reported."""

    def __init__(self, raw, zstandard):
        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._frame, self._in_frame, self._pending = self._new(), False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            block = self._raw.read(1 << 16)
            if not block:
                if self._in_frame:
                    raise EOFError("the file ends inside a Zstandard frame")
                return 0
            self._pending = self._decompress(block)
        n = min(len(buffer), len(self._pending))
        buffer[:n], self._pending = self._pending[:n], self._pending[n:]
        return n

    def _decompress(self, block: bytes) -> bytes:
        out = []
        while block:
            self._in_frame = True
            out.append(self._frame.decompress(block))
            if not self._frame.eof:
                break
            # a frame ended: what follows it in the block starts the next one
            block, self._frame, self._in_frame = self._frame.unused_data, self._new(), False
        return b"".join(out)


def _records(path: str, text_field: str) -> Iterator[tuple[str, str, int]]:
    """(where, text, file bytes read so far) per row of a Parquet or Arrow IPC stream file."""
    pa = _optional("pyarrow", path)
    parquet = path.endswith(".parquet")
    try:
        with contextlib.ExitStack() as stack:
            schema, batches, position = (_parquet if parquet else _arrow)(path, text_field, stack)
            # a record format: rows as dicts of its fields (chat.py checks them)
            if isinstance(text_field, tuple):
                yield from _rows(path, text_field, schema, batches, position)
                return
            if text_field not in schema.names:
                raise UserError(
                    f"prepare: {path}: no column '{text_field}'; set --text-field (columns:"
                    f" {', '.join(schema.names)})"
                )
            kind = schema.field(text_field).type
            if not (
                pa.types.is_string(kind)
                or pa.types.is_large_string(kind)
                or pa.types.is_string_view(kind)
            ):
                raise UserError(
                    f"prepare: {path}: column '{text_field}' holds {kind}, not text; set"
                    " --text-field to a string column"
                )
            for i, text in _numbered(batches, lambda batch: batch.column(text_field).to_pylist()):
                if text is None:
                    raise UserError(
                        f"prepare: {path} (row {i}): no text in column '{text_field}' (null)"
                    )
                yield f"{path} (row {i})", text, position(i + 1)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"prepare: {path}: not a readable {'Parquet' if parquet else 'Arrow IPC stream'} file"
            f" ({str(e).splitlines()[0]})"
        ) from None


def _rows(
    path: str, fields: tuple[str, ...], schema, batches, position
) -> Iterator[tuple[str, dict, int]]:
    """(where, the row's `fields` present in the file, bytes read so far) per row."""
    present = [f for f in fields if f in schema.names]
    if not present:
        raise UserError(
            f"prepare: {path}: none of the record columns {', '.join(map(repr, fields))} (columns:"
            f" {', '.join(schema.names)})"
        )
    for i, record in _numbered(batches, lambda batch: batch.select(present).to_pylist()):
        yield (
            f"{path} (row {i})",
            {k: v for k, v in record.items() if v is not None},
            position(i + 1),
        )


def _numbered(batches, read) -> Iterator[tuple[int, object]]:
    """(row number in the file, value) for every value `read(batch)` lists, batch after batch."""
    row = 0
    for batch in batches():
        values = read(batch)
        yield from enumerate(values, row)
        row += len(values)


def _parquet(path: str, text_field: str | tuple[str, ...], stack: contextlib.ExitStack):
    """-> (schema, the record batches of the text column(s), bytes read after n rows)."""
    import pyarrow.parquet as pq

    f = stack.enter_context(pq.ParquetFile(path))
    total, size = max(f.metadata.num_rows, 1), os.path.getsize(path)
    columns = [
        c
        for c in (text_field if isinstance(text_field, tuple) else (text_field,))
        if c in f.schema_arrow.names
    ]
    # small batches: a batch of rows is held whole (the reader's default is 65,536 rows)
    # row groups hold about equal bytes per row
    return (
        f.schema_arrow,
        lambda: f.iter_batches(batch_size=1024, columns=columns),
        lambda rows: size * rows // total,
    )


def _arrow(path: str, text_field: str, stack: contextlib.ExitStack):
    """-> (schema, its record batches, bytes read so far): an Arrow IPC stream, memory-mapped."""
    import pyarrow as pa

    source = stack.enter_context(pa.memory_map(path))
    reader = pa.ipc.open_stream(source)
    return reader.schema, lambda: reader, lambda rows: source.tell()


def _optional(module: str, path: str):
    try:
        return __import__(module)
    except ImportError:
        raise UserError(f"prepare: reading {path} needs the {module} package: {INSTALL}") from None


def dataset_files(directory: str) -> list[str] | None:
    """The Arrow shards of a HuggingFace `datasets` directory (`save_to_disk`: state.json lists them
    in order), or None if `directory` is not one. A DatasetDict's directory is refused: the user
    names the split."""
    splits = os.path.join(directory, "dataset_dict.json")
    if os.path.isfile(splits):
        try:
            names = json.load(open(splits))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            names = ["?"]
        raise UserError(
            f"prepare: '{directory}' is a datasets DatasetDict; name one split's directory, e.g."
            f" {os.path.join(directory, str(names[0]))} (splits: {', '.join(map(str, names))})"
        )
    state = os.path.join(directory, "state.json")
    if not os.path.isfile(state):
        return None
    try:
        files = [
            os.path.join(directory, f["filename"]) for f in json.load(open(state))["_data_files"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"prepare: '{directory}' has a state.json that is not a datasets listing of its"
            f" _data_files"
        ) from None
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise UserError(
            f"prepare: '{directory}': {os.path.basename(missing[0])}, listed in its state.json, is"
            f" missing"
        )
    return files
