"""Prompt records for `prepare --format prompts` (--objective grpo): each JSON record (or Parquet
row) holds `prompt`, a string or a chat message list, and optionally `answer`, a string (what a
verifiable reward such as exact_match compares the completion with). A record becomes one
document: the prompt's tokens (mask 0), then the answer's (mask 1), then the tokenizer's EOS
(mask 1); the run reads the prompt back as the tokens before the mask's first 1 and the answer as
the masked tokens before the EOS, decoded (train/data/prompts.py).

A string prompt is tokenised on its own, as `prompt_completion` does; a message list is rendered
with the model directory's chat template with the generation prompt appended (the assistant's
turn opened: the completion is sampled from there), then tokenised.

Refused, naming the record: no `prompt`, an empty prompt, an answer that is not a string, a
message without string content or with an unknown role, message lists without a chat template."""

from __future__ import annotations

import numpy as np

from errors import UserError
from train.data import chat
from train.data.formats import line_where

FIELDS = ("prompt", "answer")
SHAPE = (
    '{"prompt": "2+3=", "answer": "5"} or {"prompt": [{"role": "user", "content": "..."}],'
    ' "answer": "..."}'
)


def _bad(where: str, problem: str) -> UserError:
    return UserError(
        f"prepare: {line_where(where)}: {problem}; --format prompts records look like {SHAPE}"
    )


def _prompt_tokens(tok, prompt, where: str) -> np.ndarray:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad(where, "'prompt' is empty")
        return tok.encode([prompt])[0]
    messages = chat.record_messages(prompt, "prompt", where, _bad)
    if not tok.chat_template:
        raise _bad(
            where,
            "message lists need --tokenizer HF_MODEL_DIR with a chat template"
            f" (got --tokenizer {tok.path or tok.kind}); or give the prompt as a string",
        )
    text = chat.render(tok, messages, add_generation_prompt=True, where=where)
    return tok.encode([text])[0]


def encode_prompts(tok, docs: list[tuple[str, dict]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(where, record) pairs -> (tokens [N] int64, document lengths [R], mask [N] uint8): one
    document per record, prompt + answer + EOS, the mask 1 on the answer and the EOS."""
    pieces = []
    for where, record in docs:
        if "prompt" not in record:
            raise _bad(where, "no field 'prompt'")
        answer = record.get("answer", "")
        if not isinstance(answer, str):
            raise _bad(where, f"field 'answer' is {type(answer).__name__}, not a string")
        prompt = _prompt_tokens(tok, record["prompt"], where)
        answer_ids = tok.encode([answer])[0] if answer else np.zeros(0, np.int64)
        pieces.append(
            (
                np.concatenate([prompt, answer_ids, [tok.eos_id]]),
                np.repeat(np.uint8([0, 1]), [len(prompt), len(answer_ids) + 1]),
            )
        )
    if not pieces:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8)
    return (
        np.concatenate([t for t, _ in pieces]).astype(np.int64),
        np.array([len(t) for t, _ in pieces], np.int64),
        np.concatenate([m for _, m in pieces]),
    )
