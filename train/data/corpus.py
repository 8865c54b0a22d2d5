"""Token sources: the embedded default corpus (this interpreter's standard library), a text
file/directory, or synthetic tokens; byte-level tokenizer.

Every source becomes two flat uint16 token arrays (train, eval): documents joined with EOS, the
split made per document by a hash of its name so it is the same on every machine and process.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np

from errors import UserError

BOS, EOS, PAD = 256, 257, 258
BYTE_VOCAB = 259  # bytes + specials; models pad their vocab_size above this


def encode(text: str | bytes) -> np.ndarray:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(raw, np.uint8).astype(np.uint16)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if int(t) < 256).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    name: str
    train: np.ndarray  # uint16 [N]
    eval: np.ndarray  # uint16 [M]
    vocab_size: int  # smallest vocabulary that covers the tokens


def _join(docs: list[bytes]) -> np.ndarray:
    if not docs:
        return np.zeros((0,), np.uint16)
    parts = []
    for d in docs:
        parts.append(np.frombuffer(d, np.uint8).astype(np.uint16))
        parts.append(np.array([EOS], np.uint16))
    return np.concatenate(parts)


def _split(named_docs: list[tuple[str, bytes]], eval_fraction: float, name: str) -> Corpus:
    threshold = int(eval_fraction * 10_000)
    train, held = [], []
    for doc_name, data in named_docs:
        (held if zlib.crc32(doc_name.encode()) % 10_000 < threshold else train).append(data)
    if eval_fraction > 0 and not held and len(train) == 1:  # one document: hold out its tail
        data = train[0]
        cut = int(len(data) * (1 - eval_fraction))
        train, held = [data[:cut]], [data[cut:]]
    return Corpus(name, _join(train), _join(held), BYTE_VOCAB)


def _read_tree(
    root: str, suffix: str | None = None, skip_dirs: tuple[str, ...] = (), strict: bool = False
) -> list[tuple[str, bytes]]:
    """(name relative to root, bytes) of every file under root, sorted, hidden files and directories
    skipped (as `prepare` does); an unreadable file is skipped, or with `strict` refused."""
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        for fname in sorted(f for f in filenames if not f.startswith(".")):
            if suffix and not fname.endswith(suffix):
                continue
            path = os.path.join(dirpath, fname)
            try:
                with open(path, "rb") as f:
                    docs.append((os.path.relpath(path, root), f.read()))
            except OSError as e:
                # the user's data: a file left out silently would be a silent change of corpus
                if strict:
                    raise UserError(f"--data: cannot read '{path}': {e.strerror}") from None
                continue  # unreadable stdlib files (permissions) are simply not part of the corpus
    return docs


def stdlib_corpus(eval_fraction: float) -> Corpus:
    """The .py files of the running interpreter's standard library (~30 MB on CPython 3.11)."""
    root = sysconfig.get_paths()["stdlib"]
    return _split(
        _read_tree(root, ".py", ("site-packages", "dist-packages", "__pycache__")),
        eval_fraction,
        f"stdlib:{root}",
    )


def text_corpus(path: str, eval_fraction: float) -> Corpus:
    """A text file or directory, byte-tokenised. Every file must be UTF-8 text, as `prepare`
    requires: a binary file would otherwise be trained on as bytes without a word."""
    if os.path.isdir(path):
        docs = _read_tree(path, strict=True)
    elif os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                docs = [(os.path.basename(path), f.read())]
        except OSError as e:
            raise UserError(f"--data: cannot read '{path}': {e.strerror}") from None
    else:
        raise UserError(
            f"--data: '{path}' is not a file or directory; valid: default, synthetic, or a path to"
            " text"
        )
    docs = [(n, d) for n, d in docs if d]
    for name, data in docs:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            shown = path if os.path.isfile(path) else os.path.join(path, name)
            raise UserError(
                f"--data: '{shown}' is not UTF-8 text (byte {e.start}); byte-tokenising it would"
                " train on binary data: give text, or `python -m train.data prepare ..."
                " --on-bad-utf8 skip` to leave such files out"
            ) from None
    if not docs:
        raise UserError(f"--data: '{path}' holds no non-empty files")
    return _split(docs, eval_fraction, f"text:{path}")


def synthetic_corpus(seed: int, n_tokens: int = 1 << 22) -> Corpus:
    """Uniform random bytes: no structure to learn, for throughput benchmarks."""
    rng = np.random.default_rng(seed)
    return Corpus(
        "synthetic",
        rng.integers(0, 256, n_tokens, dtype=np.uint16),
        rng.integers(0, 256, n_tokens // 16, dtype=np.uint16),
        BYTE_VOCAB,
    )


def load(source: str, eval_fraction: float, seed: int) -> Corpus:
    if source == "default":
        return stdlib_corpus(eval_fraction)
    if source == "synthetic":
        return synthetic_corpus(seed)
    return text_corpus(source, eval_fraction)
