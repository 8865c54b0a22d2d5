"""Preference records for `prepare --format preference`: each JSON record (or Parquet row) holds
`prompt`, `chosen` and `rejected` and becomes two consecutive documents, prompt + chosen and
prompt + rejected (each ending with the tokenizer's EOS), with a loss mask of 1 on the response's
tokens only (the training objectives read sequence log-probabilities of the responses:
train/core/pair_loss.py). Document 2k is pair k's chosen sequence, 2k + 1 its rejected one.

The fields are either all strings (a plain prompt and two completions: each piece tokenised on its
own, as `prompt_completion` does, so the prompt's tokens are exactly those the model is given) or
chat message lists (TRL's conversational form: `prompt` a list of messages, `chosen` and
`rejected` lists of assistant messages; a string among them is taken as the one user or
assistant message it would be). A conversation is rendered with the model directory's chat
template and tokenised whole, and the mask covers the response's assistant turns
(train/data/chat.py finds them), not the assistant turns of the prompt's history.

Refused, naming the record: a missing field, a response with no text, a role other than
assistant in a response, message lists without a chat template."""

from __future__ import annotations

import numpy as np

from errors import UserError
from train.data import chat
from train.data.formats import line_where

FIELDS = ("prompt", "chosen", "rejected")
SHAPE = (
    '{"prompt": "...", "chosen": "...", "rejected": "..."} or chat message lists'
    ' {"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", ...}], ...}'
)


def _bad(where: str, problem: str) -> UserError:
    return UserError(
        f"prepare: {line_where(where)}: {problem}; --format preference records look like {SHAPE}"
    )


def _messages(value, role: str, name: str, where: str) -> list[dict]:
    """A field as a message list: a string becomes one message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return chat.record_messages(value, name, where, _bad)


def check_record(record: dict, where: str) -> dict:
    """The record with its fields checked: present, of one kind, and non-empty responses."""
    for name in FIELDS:
        if name not in record:
            raise _bad(where, f"no field '{name}'")
    for name in ("chosen", "rejected"):
        value = record[name]
        texts = (
            [value]
            if isinstance(value, str)
            else [m.get("content") for m in value if isinstance(m, dict)]
            if isinstance(value, list)
            else []
        )
        if not any(isinstance(t, str) and t.strip() for t in texts):
            raise _bad(where, f"'{name}' is an empty response (the pair has nothing to compare)")
    return record


def _plain(tok, record: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Strings: prompt, response and EOS tokenised apart; the mask is 1 on the response and EOS."""
    prompt, chosen, rejected = tok.encode([record[name] for name in FIELDS])
    return [
        (
            np.concatenate([prompt, response, [tok.eos_id]]),
            np.repeat(np.uint8([0, 1]), [len(prompt), len(response) + 1]),
        )
        for response in (chosen, rejected)
    ]


def _conversation(tok, record: dict, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Message lists through the chat template: the mask is 1 on the response's turns."""
    if not tok.chat_template:
        raise _bad(
            where,
            "message lists need --tokenizer HF_MODEL_DIR with a chat template"
            f" (got --tokenizer {tok.path or tok.kind}); or give the fields as strings",
        )
    prompt = _messages(record["prompt"], "user", "prompt", where)
    out = []
    for name in ("chosen", "rejected"):
        response = _messages(record[name], "assistant", name, where)
        if any(m["role"] != "assistant" for m in response):
            raise _bad(where, f"'{name}' holds a message whose role is not assistant")
        text, spans = chat.assistant_spans(tok, prompt + response, where)
        ids, offsets = tok.encode_offsets(text)
        start, end = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
        mask = np.zeros(len(ids), bool)
        for a, b in spans[len(spans) - len(response) :]:  # the response's turns, not the prompt's
            mask |= (start < b) & (end > a)
        out.append((np.append(ids, tok.eos_id), np.append(mask, 0).astype(np.uint8)))
    return out


def encode_pairs(tok, docs: list[tuple[str, dict]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(where, record) pairs -> (tokens [N] int64, document lengths [2R], loss mask [N] uint8):
    two documents per record, chosen then rejected."""
    pieces = []
    for where, record in docs:
        check_record(record, where)
        plain = all(isinstance(record[name], str) for name in FIELDS)
        pieces += _plain(tok, record) if plain else _conversation(tok, record, where)
    if not pieces:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8)
    return (
        np.concatenate([t for t, _ in pieces]).astype(np.int64),
        np.array([len(t) for t, _ in pieces], np.int64),
        np.concatenate([m for _, m in pieces]),
    )
