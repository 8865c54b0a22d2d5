"""Typed config sections meet the command line and YAML: a field's `--help` line read from the field
itself (its default, valid range and help text), values coerced to the field's type without ever
truncating, a YAML file read as a mapping of sections. Dataclasses only: which sections a
run has is train/core/config.py's table; the flags' names (short aliases, public names) are here."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

from errors import UserError
from train.data.yaml_load import load as load_bounded


def parse_bool(s: str) -> bool:
    v = str(s).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{s}'")


def converter(tp: type):
    """What turns a flag's text into a field of type `tp` (argparse's `type=`)."""
    return {bool: parse_bool, int: int, float: float, str: str}[tp]


def typed_fields(cls) -> list[tuple[dataclasses.Field, type]]:
    """Each field of a config dataclass with its resolved type (the annotations are strings)."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def coerce(key: str, tp: type, value: Any) -> Any:
    """A YAML/dict/CLI value -> the field's type; never truncates (2.5 or true for an int is an
    error)."""
    if tp is str and isinstance(value, bool):  # YAML `true` for an auto|true|false option
        value = str(value).lower()
    if isinstance(value, str):
        try:
            return converter(tp)(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise UserError(f"{key}: expected {tp.__name__}, got {value!r}") from None
    ok = (
        isinstance(value, bool)
        if tp is bool
        else isinstance(value, int) and not isinstance(value, bool)
        if tp is int
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if tp is float
        else False
    )
    if not ok:
        raise UserError(f"{key}: expected {tp.__name__}, got {value!r}")
    return tp(value)


def help_line(key: str, field: dataclasses.Field, shown_default: Any) -> str:
    """`(default: 0.9) valid: [0, 1). AdamW's ...` for option `key`: the default and the range
    first, where a reader of --help looks for them, then the field's own text."""
    text = field.metadata.get("help")
    if not text:  # a programming error, like a numeric field without a range
        raise TypeError(
            f"option {key} has no help text; declare its field with ranged() or option()"
        )
    rng = field.metadata.get("range")
    valid = f" valid: {rng.spec}" if rng else ""
    # argparse %-formats help
    return f"(default: {shown_default}){valid}. {text}".replace("%", "%%")


def load_yaml(path: str, sections: Iterable[str]) -> dict[str, dict]:
    """`--config FILE`: a mapping of `sections` (each a mapping of options); UserError otherwise."""
    data = load_bounded(path, "--config") or {}  # size, UTF-8, aliases, keys given twice
    if not isinstance(data, dict):
        raise UserError(f"--config: '{path}' must be a mapping of sections")
    sections = list(sections)
    for section, values in data.items():
        if section not in sections:
            raise UserError(
                f"--config {path}: unknown section '{section}'; valid: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise UserError(f"--config {path}: section '{section}' must be a mapping")
    return data


# Option names that differ from their dataclass field: "section.field" -> public name.
PUBLIC_NAMES = {"checkpoint.async_save": "async", "post.orpo_lambda": "lambda"}
# Defaults that --help describes rather than prints.
SHOWN_DEFAULTS = {"checkpoint.dir": "<run_dir>/checkpoints"}

# The stable short flags (README) and the field each one sets.
ALIASES = {
    "--model": "model.preset",
    "--mesh": "parallelism.mesh",
    "--mesh-dcn": "parallelism.mesh_dcn",
    "--steps": "train.steps",
    "--batch-size": "train.batch_size",
    "--seq-len": "train.seq_len",
    "--micro-batches": "train.micro_batches",
    "--lr": "train.lr",
    "--seed": "train.seed",
    "--eval-every": "train.eval_every",
    "--data": "data.source",
    "--run-dir": "logging.run_dir",
    "--log-every": "logging.log_every",
    "--peak-tflops": "logging.peak_tflops",
    "--coordinator": "parallelism.coordinator",
    "--num-processes": "parallelism.num_processes",
    "--process-id": "parallelism.process_id",
    "--resume": "checkpoint.resume",
    "--max-restarts": "train.max_restarts",
    "--init-from": "checkpoint.init_from",
    "--optim.name": "train.optimizer",
    "--objective": "post.objective",
}
SHORT = {key: alias for alias, key in ALIASES.items()}


def public_flag(section: str, field: str) -> str:
    """How a user types the option of a dataclass field: its short alias (--lr) where there is one,
    else --section.name (with its public name: --checkpoint.async)."""
    key = f"{section}.{PUBLIC_NAMES.get(f'{section}.{field}', field)}"
    return SHORT.get(key, f"--{key}")
