"""What a checkpoint holds besides the arrays: the `meta` JSON, readable without JAX.

The arrays (`state`: step, params, optimizer state with the schedule's count) need nothing else to
continue exactly: there is no RNG state in the step, and batch `s` depends only on (seed, s), so
the data position is the step itself.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
from typing import Any

import jax

from checkpoint.integrity import UnreadableCheckpoint


def versions() -> dict[str, str]:
    out = {}
    for name in ("brigade", "jax", "orbax-checkpoint", "flax", "optax"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def make_meta(step: int, config: dict, mesh: jax.sharding.Mesh, seed: int) -> dict:
    """config: the full resolved config (Config.to_dict()); its `model` section is the model config."""
    return {
        "step": step,
        "data": {"next_step": step, "seed": seed, "source": config.get("data", {}).get("source")},
        "seed": seed,
        "mesh": {name: int(size) for name, size in mesh.shape.items()},
        "devices": int(mesh.size), "processes": jax.process_count(),
        "model": config.get("model", {}),
        "config": config,
        "versions": versions(),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# The shape of `meta/metadata`, as make_meta writes it, field -> spec: a type (`float` takes any
# number; `bool` is never an int), a tuple of choices (`None` for null), a dict (an object with
# those fields; "*" covers the fields it does not name) or a one-item list (an array of those).
# Only `step` is required: exports, imports and older checkpoints omit fields. Resume, `inspect`
# and the model loader read these fields, so a wrong type must stop at the check, not deep inside
# them; fields that are only compared (the rest of the config and of the loader) may hold anything.
_COMM = {"compression": str, "topk_fraction": float, "error_feedback": str, "sync_every": int,
         "outer_lr": float, "outer_momentum": float}
META_SCHEMA = {
    "step": int, "seed": int, "devices": int, "processes": int, "mesh": {"*": int},
    "data": {"next_step": int, "seed": int, "source": (str, None),
             "loader": {"next_step": int, "sources": [dict]}},
    "model": dict, "config": {"*": dict, "comm": _COMM}, "versions": {"*": str},
    "saved_at": str, "contents": str, "exported_from": str, "imported_from": dict,
}
_REQUIRED_META = ("step",)
_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean", type(None): "null"}


def check_meta(meta: Any, step_dir: str) -> dict:
    """`meta` (the parsed meta/metadata of the step in `step_dir`) if it has META_SCHEMA's shape;
    else UnreadableCheckpoint naming the file and the first wrong field."""
    if not isinstance(meta, dict):
        problem = _mismatch(meta, dict)
    else:
        missing = [k for k in _REQUIRED_META if k not in meta]
        problem = f"field {missing[0]}: missing" if missing else _mismatch(meta, META_SCHEMA)
    if problem:
        raise UnreadableCheckpoint(step_dir, "meta/metadata", problem)
    return meta


def _mismatch(value: Any, spec: Any, name: str = "") -> str:
    """'' if `value` fits `spec` (see META_SCHEMA), else 'field NAME: expected ..., got ...'."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return _mismatch(value, dict, name)
        for key, item in value.items():
            sub = spec.get(key, spec.get("*"))
            found = "" if sub is None else _mismatch(item, sub, f"{name}.{key}" if name else str(key))
            if found:
                return found
        return ""
    if isinstance(spec, list):
        if not isinstance(value, list):
            return _mismatch(value, list, name)
        return next((m for i, item in enumerate(value) if (m := _mismatch(item, spec[0], f"{name}[{i}]"))), "")
    choices = spec if isinstance(spec, tuple) else (spec,)
    choices = tuple(type(None) if c is None else c for c in choices)
    ok = any(isinstance(value, (int, float)) if c is float else isinstance(value, c) for c in choices)
    if ok and not (isinstance(value, bool) and bool not in choices):
        return ""
    shown = json.dumps(value)
    shown = "" if value is None else f" ({shown if len(shown) <= 40 else shown[:37] + '...'})"
    where = f"field {name}: " if name else ""
    got = _JSON_NAMES.get(type(value), type(value).__name__)
    return f"{where}expected {' or '.join(_JSON_NAMES[c] for c in choices)}, got {got}{shown}"

