"""Tokenizers from local files: the built-in byte tokenizer, a HuggingFace `tokenizers` JSON,
a SentencePiece `.model` and a tiktoken BPE rank file. Nothing is ever downloaded.

A spec is `byte`, `KIND:PATH` (KIND one of hf, sentencepiece, tiktoken), a PATH whose suffix
says the kind (.json, .model, .tiktoken), or a HuggingFace model directory (`hf:DIR` or DIR): its
tokenizer.json, with the special tokens of its tokenizer_config.json (and special_tokens_map.json)
and its chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`, the order
transformers reads them in). Every tokenizer has an end-of-document id (`eos_id`): `prepare`
appends it to each document, so packed windows keep document boundaries.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

import numpy as np

from checkpoint import storage
from errors import UserError
from train.data import corpus

KINDS = ("byte", "hf", "sentencepiece", "tiktoken")
_SUFFIX = {".json": "hf", ".model": "sentencepiece", ".tiktoken": "tiktoken"}
# End-of-document tokens looked up in a HuggingFace vocabulary, in this order, unless --eos-token
# says.
EOS_CANDIDATES = (
    "<|endoftext|>",
    "</s>",
    "<eos>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|im_end|>",
    "[SEP]",
)
# tiktoken rank files carry no split regex: use cl100k_base's (a pre-tokenizer only; any works for
# round trips)
TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_PACKAGE = {"hf": "tokenizers", "sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}


class Tokenizer:
    """encode(list[str]) -> list[np.ndarray]; decode(ids) -> str; ids < vocab_size. `path` is what
    loads it again (the spec's path); `file` the file whose sha256 identifies its vocabulary."""

    kind: str
    path: str
    vocab_size: int
    eos_id: int
    model_dir: str | None = None
    chat_template: str | None = None  # a model directory's, for `prepare --format chat`

    @property
    def file(self) -> str:
        return self.path

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def describe(self) -> dict:
        """What the dataset index records; `id` decides whether two datasets can be mixed."""
        digest = file_sha256(self.file) if self.file else ""
        info = {
            "kind": self.kind,
            "path": os.path.abspath(self.path) if self.path else "",
            "sha256": digest,
            "id": f"{self.kind}:{digest[:16]}" if digest else self.kind,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
        }
        # the id stays the tokenizer.json's: the same vocabulary, however it was named
        if self.model_dir:
            info["model_dir"] = os.path.basename(os.path.abspath(self.model_dir))
        return info


class ByteTokenizer(Tokenizer):
    kind, path, vocab_size, eos_id = "byte", "", corpus.BYTE_VOCAB, corpus.EOS

    def encode(self, texts):
        return [corpus.encode(t) for t in texts]

    def decode(self, ids):
        return corpus.decode(ids)


class HFTokenizer(Tokenizer):
    """A tokenizer.json, or a model directory holding one (then `special` holds its special tokens
    by name, e.g. bos_token, and the end of document is its eos_token unless --eos-token says)."""

    kind = "hf"

    def __init__(self, path: str, eos_token: str | None):
        from tokenizers import Tokenizer as HF

        self.path, self.special = path, {}
        if os.path.isdir(path):
            self.model_dir = path
            if not os.path.isfile(self.file):
                raise UserError(
                    f"--tokenizer {path}: no tokenizer.json in this directory (a HuggingFace model"
                    f" directory holds tokenizer.json and tokenizer_config.json)"
                )
            self.special, self.chat_template = model_dir_config(path)
        self._tok = HF.from_file(self.file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        default = (self.special["eos_token"],) if "eos_token" in self.special else EOS_CANDIDATES
        names = (eos_token,) if eos_token else default
        ids = [i for i in (self._tok.token_to_id(n) for n in names) if i is not None]
        if not ids:
            raise UserError(
                f"--tokenizer {path}: no end-of-document token {' / '.join(names)} in its"
                " vocabulary; name one with --eos-token"
            )
        self.eos_id = ids[0]

    @property
    def file(self) -> str:
        return os.path.join(self.path, "tokenizer.json") if self.model_dir else self.path

    def encode(self, texts):
        return [
            np.asarray(e.ids, np.int64)
            for e in self._tok.encode_batch(texts, add_special_tokens=False)
        ]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """-> (ids [N], character spans [N, 2] of `text` each token came from)."""
        e = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, np.int64), np.asarray(e.offsets, np.int64).reshape(-1, 2)

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str, eos_token: str | None):
        import sentencepiece as spm

        self.path, self._sp = path, spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.piece_to_id(eos_token) if eos_token else self._sp.eos_id()
        if self.eos_id < 0 or (eos_token and self._sp.id_to_piece(self.eos_id) != eos_token):
            raise UserError(
                f"--tokenizer {path}: no end-of-document token"
                f" {eos_token or '(eos_id is -1)'}; name one with --eos-token"
            )

    def encode(self, texts):
        return [np.asarray(ids, np.int64) for ids in self._sp.encode(texts)]

    def decode(self, ids):
        return self._sp.decode([int(i) for i in ids])


class TiktokenTokenizer(Tokenizer):
    """A local `.tiktoken` rank file (base64 token, rank per line); EOS `<|endoftext|>` = the next
    id."""

    kind = "tiktoken"

    def __init__(self, path: str, eos_token: str | None):
        import tiktoken

        ranks = {}
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
        # tiktoken encodes a piece by merging its single bytes: a byte without a rank loads fine and
        # then panics (in Rust, with a long backtrace) on the first text that holds it
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise UserError(
                f"--tokenizer {path}: not a usable tiktoken rank file: {len(missing)} of the 256"
                f" single bytes have no rank (first: 0x{missing[0]:02x}), so text holding them"
                " cannot be encoded"
            )
        self.path, self.eos_id = path, max(ranks.values()) + 1
        self.vocab_size = self.eos_id + 1
        self._enc = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={eos_token or "<|endoftext|>": self.eos_id},
        )

    def encode(self, texts):
        return [
            np.asarray(ids, np.int64)
            for ids in self._enc.encode_ordinary_batch(texts, num_threads=1)
        ]

    def decode(self, ids):
        return self._enc.decode([int(i) for i in ids])


def model_dir_config(directory: str) -> tuple[dict[str, str], str | None]:
    """A HuggingFace model directory's special tokens (name -> text, e.g. bos_token -> '<s>') and
    chat template (None if it has none), read as transformers reads them."""
    config: dict = {}
    # the latter wins, as in transformers
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise UserError(
                f"--tokenizer {directory}: cannot read {name} ({str(e).splitlines()[0]})"
            ) from None
        if not isinstance(loaded, dict):
            raise UserError(f"--tokenizer {directory}: {name} is not a JSON object")
        config.update(loaded)
    # a special token is its text, or an AddedToken object {"content": TEXT, ...} in older files
    text = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
    special = {
        k: text(v) for k, v in config.items() if k.endswith("_token") and isinstance(text(v), str)
    }
    template_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(template_file):  # transformers 5 writes the template here; it takes priority
        with open(template_file, encoding="utf-8") as f:
            return special, f.read()
    template = config.get("chat_template")
    # named templates [{name, template}]: the default one is the chat's
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise UserError(
                f"--tokenizer {directory}: tokenizer_config.json has named chat templates"
                f" ({', '.join(map(str, named))}) but none named 'default'"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise UserError(
            f"--tokenizer {directory}: tokenizer_config.json's chat_template is not a string"
        )
    return special, template


def parse_spec(spec: str) -> tuple[str, str]:
    """'byte' | 'KIND:PATH' | PATH with a known suffix | a model directory -> (kind, path)."""
    if spec == "byte":
        return "byte", ""
    kind, sep, path = spec.partition(":")
    if sep and kind in KINDS[1:]:
        return kind, path
    if os.path.isdir(spec):
        return "hf", spec
    suffix = os.path.splitext(spec)[1]
    if suffix in _SUFFIX:
        return _SUFFIX[suffix], spec
    raise UserError(
        f"--tokenizer {spec!r}: unknown kind; valid: byte, hf:PATH, sentencepiece:PATH,"
        f" tiktoken:PATH, a PATH ending in {', '.join(_SUFFIX)}, or a HuggingFace model directory"
    )


def load(spec: str, eos_token: str | None = None) -> Tokenizer:
    """A Tokenizer from its spec; any failure to load is one UserError naming the file."""
    kind, path = parse_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if not (os.path.isfile(path) or kind == "hf" and os.path.isdir(path)):
        raise UserError(f"--tokenizer {spec}: no such file")
    cls = {
        "hf": HFTokenizer,
        "sentencepiece": SentencePieceTokenizer,
        "tiktoken": TiktokenTokenizer,
    }[kind]
    try:
        return cls(path, eos_token)
    except UserError:
        raise
    except ImportError:
        raise UserError(
            f"--tokenizer {spec}: the {kind} tokenizer needs `pip install {_PACKAGE[kind]}`"
        ) from None
    except Exception as e:  # each library has its own exception types for a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"--tokenizer {spec}: not a loadable {kind} tokenizer file ({first})"
        ) from None


def file_sha256(path: str) -> str:
    """A file's sha256, local or on an object store (checkpoint/storage.py), read in blocks."""
    h = hashlib.sha256()
    with storage.open_file(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
