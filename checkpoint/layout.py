"""What a Brigade checkpoint contains: the one definition that save, restore, inspect, export and
the HuggingFace converter share.

A checkpoint directory holds one directory per committed step:

    <dir>/<step>/state/   STATE_ITEM: the arrays, an Orbax PyTree (OCDBT/tensorstore; every
                          process writes only its own shards). A full checkpoint holds the
                          TrainState: `step`, `params`, `opt_state` (with the schedule's count)
                          and, by the data-parallel sync layout, `residual` (error feedback) or
                          `drift` + `outer_opt` (DiLoCo); those per-replica arrays carry a leading
                          [R] dim (R data-parallel replicas). A parameters-only checkpoint
                          (export, HF import) holds `{"params": ...}`. A LoRA run's
                          (--lora.rank > 0) `params` are its adapters only (`lora_base`).
    <dir>/<step>/meta/    META_ITEM: JSON (META_SCHEMA): the format version, the resolved config,
                          the model section, the mesh, the data position, the library versions.

Orbax writes a step under `<step>` + TMP_SUFFIX and renames it when complete, so only committed
steps are listed. The arrays need nothing else to continue exactly: there is no RNG state in the
step, and batch `s` depends only on (seed, s), so the data position is the step itself (plus the
loader's record of its sources, checked on resume).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpoint.integrity import UnreadableCheckpoint
from errors import UserError

# Bumped when what a step holds changes so that an older Brigade would misread it. Steps written
# before the field existed are format 1.
FORMAT_VERSION = 1
STATE_ITEM, META_ITEM = "state", "meta"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
RUN_SUBDIR = "checkpoints"  # a run directory's checkpoints, unless --checkpoint.dir says otherwise
PARAMS_ONLY = "params"  # meta["contents"] of a parameters-only checkpoint
PER_REPLICA = ("residual", "drift")  # state fields with a leading [R] data-parallel replica dim


def versions() -> dict[str, str]:
    out = {}
    for name in ("brigade", "jax", "orbax-checkpoint", "flax", "optax"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def make_meta(step: int, config: dict, mesh: jax.sharding.Mesh, seed: int) -> dict:
    """config: the full resolved config (Config.to_dict()); its `model` section is the model
    config."""
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "data": {"next_step": step, "seed": seed, "source": config.get("data", {}).get("source")},
        "seed": seed,
        "mesh": {name: int(size) for name, size in mesh.shape.items()},
        "devices": int(mesh.size),
        "processes": jax.process_count(),
        "model": config.get("model", {}),
        "config": config,
        "versions": versions(),
        "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# The shape of `meta/metadata`, as make_meta writes it, field -> spec: a type (`float` takes any
# number; `bool` is never an int), a tuple of choices (`None` for null), a dict (an object with
# those fields; "*" covers the fields it does not name) or a one-item list (an array of those).
# Only `step` is required: exports, imports and older checkpoints omit fields. Resume, `inspect`
# and the model loader read these fields, so a wrong type must stop at the check, not deep inside
# them; fields that are only compared (the rest of the config and of the loader) may hold anything.
_COMM = {
    "compression": str,
    "topk_fraction": float,
    "error_feedback": str,
    "sync_every": int,
    "outer_lr": float,
    "outer_momentum": float,
}
_LORA = {"rank": int, "alpha": float, "targets": str, "base_fingerprint": str}
META_SCHEMA = {
    "format": int,
    "step": int,
    "seed": int,
    "devices": int,
    "processes": int,
    "mesh": {"*": int},
    "data": {
        "next_step": int,
        "seed": int,
        "source": (str, None),
        "loader": {"next_step": int, "sources": [dict]},
    },
    "model": dict,
    "config": {"*": dict, "comm": _COMM, "lora": _LORA},
    "versions": {"*": str},
    "saved_at": str,
    "contents": str,
    "exported_from": str,
    "imported_from": dict,
    "tokenizer": {
        "kind": str,
        "path": str,
        "sha256": str,
        "id": str,
    },  # an HF import's (tokenizer_record)
    "local": {
        "process": int,
        "processes": int,
        "device_ids": [int],
    },  # a local-tier copy (checkpoint/tiers.py)
}
_REQUIRED_META = ("step",)
_JSON_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def params_only_meta(step: int, config: dict, **origin) -> dict:
    """The meta of a parameters-only checkpoint of the model in `config` (a resolved Config dict);
    `origin`: where the parameters came from (`exported_from=<step dir>`, `imported_from={...}`)."""
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "contents": PARAMS_ONLY,
        "model": config.get("model", {}),
        "config": config,
        "mesh": {},
        "devices": 1,
        "processes": 1,
        "versions": versions(),
        **origin,
    }


def is_params_only(meta: dict) -> bool:
    return meta.get("contents") == PARAMS_ONLY


# -- LoRA: a run's checkpoint holds its adapters; the frozen base is a pointer ---------------------
def lora_base(meta: dict) -> dict | None:
    """A LoRA run's base, from its step's meta: {"path": the --init-from checkpoint ("" for a random
    base), "fingerprint": `fingerprint` of its parameters, "scale": alpha / rank}; None when the
    step is no LoRA run's."""
    config = meta.get("config", {})
    lora = config.get("lora", {})
    if not lora.get("rank"):
        return None
    return {
        "path": config.get("checkpoint", {}).get("init_from", ""),
        "fingerprint": lora.get("base_fingerprint", ""),
        "scale": lora["alpha"] / lora["rank"],
    }


_ADAPTER = ("/lora_a", "/lora_b")  # the leaf names of a LoRA run's adapters


def lora_mismatch(meta: dict, saved: dict, wanted: dict, step_dir: str) -> str:
    """Why a checkpoint's arrays (`saved`: name -> shape) cannot become the tree a reader wants
    (`wanted`, alike), when the reason is LoRA: a LoRA run's adapters given where a whole
    model's arrays are wanted, a whole model's given to a LoRA run, or adapters of another rank
    or targets. The line names the base and the flags that would read it; "" when LoRA is not
    the reason (the caller lists the arrays that differ)."""
    held = {n: s for n, s in saved.items() if n.endswith(_ADAPTER)}
    want = {n: s for n, s in wanted.items() if n.endswith(_ADAPTER)}
    if held == want:  # none on either side, or the same: the difference is elsewhere
        return ""
    lora = meta.get("config", {}).get("lora", {}) if isinstance(meta.get("config"), dict) else {}
    flags = (
        f"--lora.rank {lora.get('rank')} --lora.alpha {lora.get('alpha')} --lora.targets"
        f" {lora.get('targets')}"
    )
    base = (lora_base(meta) or {}).get("path") or "a random init (--lora.allow_random_base)"
    if held and not want:
        return (
            f"checkpoint {step_dir} holds LoRA adapters ({flags.replace('--lora.', '')}) trained"
            f" on the base {base}, not a whole model's parameters: to train them on, pass {flags}"
            f" (the base comes from the checkpoint); to train new adapters on that base, pass"
            f" --init-from {base} with --lora.rank; to use them as a whole model, merge them into"
            f" the base first: python -m checkpoint hf export {step_dir} --out HF_DIR, then"
            f" python -m checkpoint hf import HF_DIR --out CKPT and --init-from CKPT"
        )
    if want and not held:
        what = "parameters" if is_params_only(meta) else "training state"
        return (
            f"checkpoint {step_dir} holds a whole model's {what}, not LoRA adapters: to train"
            f" adapters on it as the frozen base, start a new run with --init-from {step_dir}"
            f" and --lora.rank; to continue training it whole, leave --lora.rank at 0"
        )
    return (
        f"checkpoint {step_dir} holds LoRA adapters of other shapes than this run's ({flags}"
        f" when saved): pass those to read them"
    )


def _bit_sums(x: jax.Array) -> jax.Array:
    """[2] uint32: the sum of `x`'s bit patterns and their sum weighted by (2 x flat index + 1),
    modulo 2^32. Integer sums are exact in any order, so they do not depend on the sharding."""
    width = {2: jnp.uint16, 1: jnp.uint8}.get(x.dtype.itemsize, jnp.uint32)
    bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)
    weight = 2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)])


_tree_bit_sums = jax.jit(lambda tree: jax.tree.map(_bit_sums, tree))


def fingerprint(params) -> str:
    """A short hex digest of a parameter tree's names, shapes, dtypes and values, computed where
    the arrays are (sharded device arrays on any mesh and process count, or host arrays) with the
    same result; what a LoRA checkpoint records of its base."""
    sums = _tree_bit_sums(params)
    digest = hashlib.sha256()
    for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(sums)):
        held = np.asarray(s.addressable_data(0))  # replicated: every process holds it whole
        name = jax.tree_util.keystr(path)
        digest.update(f"{name} {tuple(x.shape)} {np.dtype(x.dtype).name} {held.tolist()};".encode())
    return digest.hexdigest()[:16]


def merged(base, adapters, scale: float, dtype=None):
    """`base` with each adapted weight W replaced by W + scale x A B: `adapters` mirrors the base's
    tree down to the weights it adapts, each a {"lora_a": A [lead..., in..., r],
    "lora_b": B [lead..., r, out...]} (lead: the dims W shares with both, the layer stack). In
    float32, then `dtype` (default: W's). Jittable; the HF export calls it on host (numpy)
    arrays."""

    def walk(node, adapter):
        if isinstance(adapter, dict) and set(adapter) == {"lora_a", "lora_b"}:
            a, b = adapter["lora_a"], adapter["lora_b"]
            lead = a.ndim + b.ndim - 2 - node.ndim
            letters = "abcdefghijklmnopqstuvwxyz"  # r is the rank
            n_in, n_out = a.ndim - 1 - lead, b.ndim - 1 - lead
            lead_s, in_s, out_s = (
                letters[:lead],
                letters[lead : lead + n_in],
                letters[lead + n_in : lead + n_in + n_out],
            )
            delta = jnp.einsum(
                f"{lead_s}{in_s}r,{lead_s}r{out_s}->{lead_s}{in_s}{out_s}",
                jnp.asarray(a, jnp.float32),
                jnp.asarray(b, jnp.float32),
            )
            return (jnp.asarray(node, jnp.float32) + scale * delta).astype(dtype or node.dtype)
        return {k: walk(v, adapter[k]) if k in adapter else v for k, v in node.items()}

    return walk(base, adapters)


def tokenizer_record(meta: dict) -> dict | None:
    """The tokenizer a checkpoint's parameters were trained with or imported with, as a prepared
    dataset's index records it (kind, path, sha256, `id`: what must match): an HF import's
    `tokenizer`, else the data loader's; None when the checkpoint records none (older ones)."""
    loader = meta.get("data", {}).get("loader", {}) if isinstance(meta.get("data"), dict) else {}
    for record in (
        meta.get("tokenizer"),
        loader.get("tokenizer") if isinstance(loader, dict) else None,
    ):
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            return record
    return None


def replica_layout(arrays: list[tuple[str, tuple, str]]) -> tuple[int | None, bool]:
    """From a step's (name, shape, dtype) array list: (the data-parallel replica count of its
    per-replica state, the leading dim of its residuals or drift, None when it has none; whether it
    is DiLoCo's, i.e. holds drift)."""
    per_replica = [
        (name, shape)
        for name, shape, _ in arrays
        if name.startswith(tuple(f + "/" for f in PER_REPLICA))
    ]
    dims = {shape[0] for _, shape in per_replica if shape}
    return (dims.pop() if len(dims) == 1 else None), any(
        n.startswith("drift/") for n, _ in per_replica
    )


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
    if meta.get("format", 1) > FORMAT_VERSION:  # readable, but not by this version: never set aside
        raise UserError(
            f"{step_dir}: checkpoint format {meta['format']} was written by a newer Brigade"
            f" ({meta.get('versions', {}).get('brigade', '?')}); this one reads formats up to"
            f" {FORMAT_VERSION}: upgrade Brigade to resume from it"
        )
    return meta


def _mismatch(value: Any, spec: Any, name: str = "") -> str:
    """'' if `value` fits `spec` (see META_SCHEMA), else 'field NAME: expected ..., got ...'."""
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return _mismatch(value, dict, name)
        for key, item in value.items():
            sub = spec.get(key, spec.get("*"))
            found = (
                "" if sub is None else _mismatch(item, sub, f"{name}.{key}" if name else str(key))
            )
            if found:
                return found
        return ""
    if isinstance(spec, list):
        if not isinstance(value, list):
            return _mismatch(value, list, name)
        return next(
            (m for i, item in enumerate(value) if (m := _mismatch(item, spec[0], f"{name}[{i}]"))),
            "",
        )
    choices = spec if isinstance(spec, tuple) else (spec,)
    choices = tuple(type(None) if c is None else c for c in choices)
    ok = any(
        isinstance(value, (int, float)) if c is float else isinstance(value, c) for c in choices
    )
    if ok and not (isinstance(value, bool) and bool not in choices):
        return ""
    shown = json.dumps(value)
    shown = "" if value is None else f" ({shown if len(shown) <= 40 else shown[:37] + '...'})"
    where = f"field {name}: " if name else ""
    got = _JSON_NAMES.get(type(value), type(value).__name__)
    return f"{where}expected {' or '.join(_JSON_NAMES[c] for c in choices)}, got {got}{shown}"
