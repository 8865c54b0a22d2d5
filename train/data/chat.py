"""Supervised records for `prepare --format chat|prompt_completion`: each JSON record (or Parquet
row) becomes one document of tokens and a per-token loss mask, 1 where the model is trained to
predict the token, 0 elsewhere (stored next to the tokens; the pipeline multiplies the loss
weight of each target token by it).

  text               (default) the --text-field string; every token weighs 1 (no mask is stored)
  prompt_completion  `prompt` and `completion` strings: the prompt's tokens weigh 0, the
                     completion's and the EOS after it 1. Each is tokenised on its own, so the
                     prompt's tokens are exactly those a model is given at inference.
  chat               `messages`: [{role, content}, ...], rendered with the model directory's chat
                     template as transformers' `apply_chat_template` renders it, and tokenised
                     whole (the ids `apply_chat_template(..., tokenize=True)` gives): the tokens of
                     each assistant turn weigh 1 (its content, its end-of-turn token, and whatever
                     else the template writes for that message), all others 0, including the
                     EOS that `prepare` appends after the conversation.

Finding the assistant turns. For assistant message i the template renders messages[:i] with the
generation prompt (P) and messages[:i+1] without (F); F must start with P and the rendering of
the whole conversation must start with F, and then its characters [len(P), len(F)) are that turn.
A token weighs 1 when its character span (the tokenizer's offsets) overlaps a turn. Character
offsets into the one tokenisation of the whole, not the token difference of separately tokenised
prefixes: a merge across the prompt/turn boundary makes a prefix's tokens differ from the
whole's, and training must see the whole's. A template that renders a prefix differently from
the start of the whole (one that rewrites earlier turns, e.g. drops past reasoning) is refused,
naming the record: its turns cannot be located in the tokens trained on.
"""

from __future__ import annotations

import datetime
import functools
import json

import numpy as np

from errors import UserError
from train.data.formats import line_where

# preference: train/data/preference_records.py; prompts: train/data/prompt_records.py
FORMATS = ("text", "prompt_completion", "chat", "preference", "prompts")
FIELDS = {
    "prompt_completion": ("prompt", "completion"),
    "chat": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
    "prompts": ("prompt", "answer"),
}
ROLES = ("system", "developer", "user", "assistant", "tool")


def record_messages(value, name: str, where: str, bad) -> list[dict]:
    """A record's field `name` as a chat message list, checked: a non-empty list of messages each
    with a string 'content' and a role of ROLES (None-valued keys dropped). `bad(where, problem)`
    makes the refusal (each record format names its own shape)."""
    if not isinstance(value, list) or not value:
        raise bad(where, f"field '{name}' is {type(value).__name__}, not a string or messages")
    out = []
    for i, m in enumerate(value):
        m = {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise bad(where, f"{name}[{i}] has no string 'content'")
        if m.get("role") not in ROLES:
            raise bad(where, f"{name}[{i}].role is {m.get('role')!r}; valid: {ROLES}")
        out.append(m)
    return out


_SHAPE = {
    "prompt_completion": '{"prompt": "...", "completion": "..."}',
    "chat": '{"messages": [{"role": "user", "content": "..."},'
    ' {"role": "assistant", "content": "..."}]}',
}


def check_options(tok, input_format: str, text_field: str) -> str | tuple[str, ...]:
    """Before anything is read: --text-field only for text, and --format chat needs a model
    directory whose chat template compiles. -> what the readers take from each record
    (train/data/formats.py): the text field, or a record format's fields."""
    if input_format not in FORMATS:
        raise UserError(f"prepare: --format {input_format!r}; valid: {', '.join(FORMATS)}")
    if input_format == "text":
        return text_field
    if text_field != "text":
        raise UserError(
            f"prepare: --text-field is for --format text; --format {input_format} records hold"
            f" {' and '.join(FIELDS[input_format])}"
        )
    if input_format == "chat":
        _check_chat_tokenizer(tok)
    return FIELDS[input_format]


def _check_chat_tokenizer(tok) -> None:
    if tok.model_dir is None:
        raise UserError(
            "prepare: --format chat needs --tokenizer HF_MODEL_DIR, a HuggingFace model directory"
            f" with tokenizer.json and a chat template; got --tokenizer {tok.path or tok.kind}"
        )
    if not tok.chat_template:
        raise UserError(
            f"prepare: --format chat: the model directory '{tok.model_dir}' has no chat template"
            f" (chat_template.jinja or tokenizer_config.json's chat_template); use --format"
            f" prompt_completion or text"
        )
    compile_template(tok.chat_template, tok.model_dir)


# ------------------------------------------------------ the template, as transformers renders it


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own: jinja's default tojson escapes HTML characters, which templates do not
    # expect
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=4)
def compile_template(source: str, model_dir: str):
    """The chat template compiled in transformers' environment: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`, and the
    `{% generation %}` tag (which marks assistant text for transformers' mask; here its body is
    rendered as is: the turns are found by rendering prefixes)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise UserError(
            "prepare: --format chat renders the chat template with jinja2: pip install jinja2"
        ) from None

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(
            f"prepare: --tokenizer {model_dir}: the chat template does not compile (line"
            f" {e.lineno}: {e.message})"
        ) from None


def render(
    tok, messages: list[dict], add_generation_prompt: bool, where: str = "the conversation"
) -> str:
    """The template's text for `messages`, with the variables transformers gives it: the
    messages, add_generation_prompt, tools and documents (none), and the special tokens by name."""
    template = compile_template(tok.chat_template, tok.model_dir)
    try:
        return template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **tok.special,
        )
    # the template is the model's code: anything it raises is about this record
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"prepare: {line_where(where)}: the chat template fails on this conversation ({first})"
        ) from None


# ------------------------------------------------------------------ records -> tokens and mask


def _bad(where: str, input_format: str, problem: str) -> UserError:
    return UserError(
        f"prepare: {line_where(where)}: {problem}; --format {input_format} records look like"
        f" {_SHAPE[input_format]}"
    )


def check_record(input_format: str, record: dict, where: str) -> dict:
    """The record, or UserError naming its file:line and the field that is missing or wrong."""
    for name in FIELDS[input_format]:
        if name not in record:
            raise _bad(where, input_format, f"no field '{name}'")
    if input_format == "prompt_completion":
        for name in FIELDS[input_format]:
            if not isinstance(record[name], str):
                raise _bad(
                    where,
                    input_format,
                    f"field '{name}' is {type(record[name]).__name__}, not a string",
                )
        return record
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _bad(where, input_format, "field 'messages' is not a non-empty list")
    # keys whose value is null are dropped, as transformers does (a Parquet struct has every key in
    # every row)
    messages = [
        {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
        for m in messages
    ]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise _bad(where, input_format, f"messages[{i}] has no string 'content'")
        if m.get("role") not in ROLES:
            raise _bad(
                where,
                input_format,
                f"messages[{i}].role is {m.get('role')!r}; valid: {', '.join(ROLES)}",
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise _bad(where, input_format, "no assistant message (nothing to train on)")
    return {**record, "messages": messages}


def assistant_spans(tok, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, the character span of each assistant turn in it)."""
    whole = render(tok, messages, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt, through = (
            render(tok, messages[:i], True, where),
            render(tok, messages[: i + 1], False, where),
        )
        if not (through.startswith(prompt) and whole.startswith(through)):
            raise UserError(
                f"prepare: {line_where(where)}: the chat template renders messages[:{i}] (with the"
                f" generation prompt) or messages[:{i + 1}] as other than the start of the whole"
                f" conversation, so assistant message {i} cannot be located in its tokens"
            )
        spans.append((len(prompt), len(through)))
    return whole, spans


def chat_tokens(tok, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids [N] of the rendered conversation, uint8 mask [N]: 1 on tokens overlapping an
    assistant turn)."""
    text, spans = assistant_spans(tok, messages, where)
    ids, offsets = tok.encode_offsets(text)
    # a token of no characters has a place
    start, end = (offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1))
    mask = np.zeros(len(ids), bool)
    for a, b in spans:
        mask |= (start < b) & (end > a)
    return ids, mask.astype(np.uint8)


def encode_records(
    tok, input_format: str, docs: list[tuple[str, dict]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(where, record) pairs -> (tokens [N] int64, document lengths [D], loss mask [N] uint8);
    each document ends with the tokenizer's EOS."""
    records = [check_record(input_format, r, where) for where, r in docs]
    if input_format == "prompt_completion":
        prompts = tok.encode([r["prompt"] for r in records]) if records else []
        completions = tok.encode([r["completion"] for r in records]) if records else []
        pieces = [
            (
                np.concatenate([p, c, [tok.eos_id]]),
                np.repeat(np.uint8([0, 1]), [len(p), len(c) + 1]),
            )
            for p, c in zip(prompts, completions)
        ]
    else:
        pieces = []
        for (where, _), r in zip(docs, records):
            ids, mask = chat_tokens(tok, r["messages"], where)
            pieces.append((np.append(ids, tok.eos_id), np.append(mask, 0).astype(np.uint8)))
    if not pieces:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8)
    return (
        np.concatenate([t for t, _ in pieces]).astype(np.int64),
        np.array([len(t) for t, _ in pieces], np.int64),
        np.concatenate([m for _, m in pieces]),
    )
