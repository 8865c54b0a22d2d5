"""The rewards of --objective grpo, by name (`--post.reward NAME`), as models are: a registry of
Python callables `fn(completion: str, *, answer: str, prompt: str) -> float`, one call per sampled
completion (its text up to the EOS), with the record's `answer` ("" when the record has none) and
the prompt's text. Built in:

- `exact_match`: 1.0 when the completion's final answer equals the record's answer, both stripped,
  else 0.0. The final answer is the text after the completion's last `####` (GSM8K's marker) when
  it has one, else the whole completion.
- `format`: 1.0 when the whole stripped completion matches `--post.reward_pattern` (a regular
  expression; by default DeepSeek-R1's `<think>...</think> <answer>...</answer>` template).

A user's own: `train.core.rewards.register("name", fn)` before the run's config is built
(docs/extending.md), then `--post.reward name`; `python -m train` finds the rewards of installed
packages through the `brigade.rewards` entry-point group (modules that call `register`), as it
finds models. A reward that raises, or returns anything but a finite number, stops
the run in one line naming the reward and the prompt (`score`)."""

from __future__ import annotations

import functools
import importlib.metadata
import math
import numbers
import re
from collections.abc import Callable

from errors import UserError

Reward = Callable[..., float]
ENTRY_POINTS = "brigade.rewards"
_loaded = False


def final_answer(completion: str) -> str:
    """The text after the last `####`, else the whole completion; stripped."""
    return completion.rsplit("####", 1)[-1].strip()


def exact_match(completion: str, *, answer: str, prompt: str = "") -> float:
    return float(final_answer(completion) == answer.strip())


def format_match(completion: str, *, answer: str = "", prompt: str = "", pattern: str) -> float:
    return float(re.fullmatch(pattern, completion.strip()) is not None)


REWARDS: dict[str, Reward] = {"exact_match": exact_match, "format": format_match}


def register(name: str, fn: Reward) -> None:
    """Make `fn(completion, *, answer, prompt) -> float` the reward `--post.reward name`. A
    built-in name cannot be taken."""
    if not isinstance(name, str) or not name:
        raise UserError(f"rewards.register: the name {name!r} is not a non-empty string")
    if not callable(fn):
        raise UserError(f"rewards.register({name!r}, ...): {type(fn).__name__} is not callable")
    if name in ("exact_match", "format"):
        raise UserError(f"rewards.register: '{name}' is a built-in reward; pick another name")
    REWARDS[name] = fn


def resolve(name: str, pattern: str) -> Reward:
    """The reward `--post.reward name`, `format`'s with `--post.reward_pattern` bound."""
    global _loaded
    if name not in REWARDS and not _loaded:  # installed packages' rewards, imported once
        _loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
            ep.load()
    if name not in REWARDS:
        raise UserError(
            f"--post.reward '{name}': valid: {', '.join(sorted(REWARDS))} (or one registered with"
            " train.core.rewards.register, docs/extending.md)"
        )
    if name == "format":
        return functools.partial(format_match, pattern=pattern)
    return REWARDS[name]


def score(name: str, fn: Reward, completion: str, answer: str, prompt: str, where: str) -> float:
    """fn's reward of one completion as a float; one line naming the reward and the prompt
    (`where`: its record) when it raises or returns no finite number."""
    try:
        value = fn(completion, answer=answer, prompt=prompt)
    except Exception as e:  # a user's callable: any failure is the reward's
        raise UserError(
            f"--post.reward {name}: raised {type(e).__name__}: {e} on {where} (prompt"
            f" {prompt[:60]!r}, completion {completion[:60]!r})"
        ) from None
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise UserError(
            f"--post.reward {name}: returned {value!r}, not a finite number, on {where} (prompt"
            f" {prompt[:60]!r}, completion {completion[:60]!r})"
        )
    return float(value)
