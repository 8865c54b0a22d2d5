"""HuggingFace checkpoints (Llama, Mistral, Mixtral, Qwen2/2.5, Qwen3) <-> Brigade:
`from_pretrained`, `save_pretrained`, and Brigade checkpoints to and from HF directories, with their
CLI under `python -m checkpoint`:

    python -m checkpoint hf import HF_DIR --out CKPT [--dtype float32]   # a params-only checkpoint
    python -m checkpoint hf export CKPT --out HF_DIR [--dtype bfloat16]  # any checkpoint -> HF

What converts to what is models/hf.py's (the tables) and models/hf_config.py's (config.json <->
ModelConfig); the HF files and their tensors are checkpoint/hf_files.py's; this module joins them
to Brigade checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import shutil
import tempfile
import typing
from typing import Any

from checkpoint.hf_files import hf_tensors, load_params, read_config, write_files
from checkpoint.layout import fingerprint, lora_base, merged
from errors import ArgParser, UserError, expect
from models.config import ModelConfig
from models.hf import Model
from models.hf_config import (
    ARCHITECTURES,
    DTYPES,
    config_from_hf,
    config_to_hf,
    is_int,
    is_number,
    short_json,
)


# -- HF directories -------------------------------------------------------------------------------
def from_pretrained(
    path: str, dtype: str = "float32", *, mesh=None, rules=None, allow_nonfinite: bool = False
) -> Model:
    """A local HF checkpoint directory -> Model (params and compute in `dtype`). With `mesh`, every
    parameter is placed sharded by the logical-axis rules (default: mesh/rules.py). A tensor
    holding NaN or infinity is one line naming it, unless `allow_nonfinite`."""
    import jax

    expect("from_pretrained", "path", path, (str, os.PathLike), "an HF directory's path")
    path = os.fspath(path)

    model_type, cfg = config_from_hf(read_config(path), dtype, os.path.join(path, "config.json"))
    params = load_params(path, model_type, cfg, allow_nonfinite)
    if mesh is None:
        return Model(cfg, jax.device_put(params), path)
    from mesh.rules import make_rules
    from mesh.shard import tree_shardings
    from models import model as model_lib

    shardings = tree_shardings(mesh, model_lib.param_axes(cfg), rules or make_rules())
    return Model(cfg, jax.device_put(params, shardings), path)


def save_pretrained(
    model: Model, path: str, *, dtype: str | None = None, max_shard_bytes: int = 5 << 30
) -> None:
    """Write `path/config.json` and safetensors in HF layout (sharded with an index past
    `max_shard_bytes`), loadable by transformers' `AutoModelForCausalLM.from_pretrained(path)`.
    The files are written beside `path` first and moved in once all are complete, so a refusal or
    a failed write leaves `path` as it was (not created, when it did not exist)."""
    expect("save_pretrained", "model", model, Model, "a Model (from_pretrained, load_checkpoint)")
    expect("save_pretrained", "path", path, (str, os.PathLike), "a directory's path")
    path = os.fspath(path)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    tensors = hf_tensors(model, dtype)
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
        try:
            write_files(staging, config_to_hf(model.cfg, dtype), tensors, max_shard_bytes)
            os.makedirs(path, exist_ok=True)
            for name in os.listdir(staging):
                os.replace(os.path.join(staging, name), os.path.join(path, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise UserError(
            f"'{path}': writing the HuggingFace files failed ({e.strerror or e})"
        ) from None


# -- Brigade checkpoints --------------------------------------------------------------------------
def import_checkpoint(
    hf_dir: str, out: str, dtype: str = "float32", allow_nonfinite: bool = False
) -> str:
    """HF directory -> a params-only Brigade checkpoint `out/0/` (what `--init-from` starts from),
    plus `out/model.yaml`, the model section to train it with (`--config out/model.yaml`). Weights
    holding NaN or infinity are refused (nothing written) unless `allow_nonfinite`."""
    import yaml

    for name, value in (("hf_dir", hf_dir), ("out", out)):
        expect("import_checkpoint", name, value, (str, os.PathLike), "a directory's path")
    hf_dir, out = os.fspath(hf_dir), os.fspath(out)

    from checkpoint.layout import params_only_meta
    from checkpoint.manager import Checkpointer

    _check_new_dir(out)
    model_type, cfg = config_from_hf(
        read_config(hf_dir), dtype, os.path.join(hf_dir, "config.json")
    )
    params = load_params(hf_dir, model_type, cfg, allow_nonfinite)
    # The model section as the training config writes it (its preset, then every field), so that
    # `--config out/model.yaml` rebuilds exactly this ModelConfig.
    model_section = {"preset": "default", **dataclasses.asdict(cfg)}
    tokenizer = _tokenizer_record(hf_dir)
    meta = params_only_meta(
        0,
        {"model": model_section},
        imported_from={"path": os.path.abspath(hf_dir), "model_type": model_type},
        **({"tokenizer": tokenizer} if tokenizer else {}),
    )
    ck = Checkpointer(out, keep=0, async_save=False)
    ck.save(0, {"params": params}, meta)
    ck.close()
    with open(os.path.join(out, "model.yaml"), "w") as f:
        yaml.safe_dump({"model": model_section}, f, sort_keys=False)
    return ck.step_dir(0)


def _tokenizer_record(hf_dir: str) -> dict | None:
    """The model directory's tokenizer.json as `prepare --tokenizer HF_DIR` records it in a
    dataset's index (train/data/tokenizers.py describe: the same `id`, kind and the file's sha256),
    so that --init-from and `eval` can tell data of another tokenizer; None without a
    tokenizer.json."""
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {
        "kind": "hf",
        "path": os.path.abspath(hf_dir),
        "sha256": digest,
        "id": f"hf:{digest[:16]}",
        "model_dir": os.path.basename(os.path.abspath(hf_dir)),
    }


def load_checkpoint(path: str) -> Model:
    """The params of any Brigade checkpoint (a run, a step, an export) as a Model in host memory;
    a LoRA run's adapters merged into its base (W + alpha/r A B): a plain model."""
    from checkpoint.manager import open_checkpoint

    ck, step = open_checkpoint(path)
    source = f"checkpoint '{ck.step_dir(step)}'"
    meta = ck.meta(step)
    cfg = config_from_meta(meta, source)
    params = ck.restore_params_to_host(step)
    lora = lora_base(meta)
    return Model(cfg, params if lora is None else _lora_merged(cfg, params, lora, source), source)


def _lora_merged(cfg: ModelConfig, adapters: dict, lora: dict, source: str) -> dict:
    """A LoRA checkpoint's adapters merged into the base its meta points at, which must still have
    the fingerprint the run recorded (one line otherwise), in the model's param_dtype."""
    import jax
    import numpy as np

    from checkpoint.manager import open_checkpoint

    if not lora["path"]:
        raise UserError(
            f"{source}: a LoRA run on a random base (--lora.allow_random_base), which was never"
            " saved; nothing to merge its adapters into"
        )
    ck, step = open_checkpoint(lora["path"])
    base = jax.tree.map(lambda x: np.asarray(x, cfg.param_dtype), ck.restore_params_to_host(step))
    if fingerprint(base) != lora["fingerprint"]:
        raise UserError(
            f"{source}: its LoRA base {ck.step_dir(step)} changed since the run (fingerprint"
            f" {fingerprint(base)}, recorded {lora['fingerprint']}); export needs the original base"
        )
    return jax.tree.map(np.asarray, merged(base, adapters, lora["scale"], dtype=cfg.param_dtype))


def config_from_meta(meta: Any, source: str) -> ModelConfig:
    """The ModelConfig a checkpoint's metadata records, every field checked for its type (a string
    where a number belongs is refused, never converted) and validated."""
    model = meta.get("model") if isinstance(meta, dict) else None
    if not isinstance(model, dict):
        raise UserError(
            f'{source}: its metadata has no model config (a "model" object), so its arrays'
            f" cannot be named"
        )
    hints, fields = typing.get_type_hints(ModelConfig), {}
    for f in dataclasses.fields(ModelConfig):
        if f.name not in model:
            # a field newer than the checkpoint: its default; check_params catches a wrong one
            continue
        value, kind = model[f.name], hints[f.name]
        ok = (
            isinstance(value, bool)
            if kind is bool
            else is_int(value)
            if kind is int
            else is_number(value)
            if kind is float
            else isinstance(value, kind)
        )
        if not ok:
            raise UserError(
                f"{source}: metadata model.{f.name} must be {kind.__name__},"
                f" got {short_json(value)}"
            )
        fields[f.name] = kind(value)
    try:
        return ModelConfig(**fields).validate()
    except UserError as e:
        raise UserError(f"{source}: metadata {e}") from None


def _check_new_dir(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UserError(f"--out: '{out}' already exists and is not empty; choose a new directory")


# -- CLI: python -m checkpoint hf import|export ---------------------------------------------------
def add_commands(sub) -> None:
    """The `hf` command, with `import` and `export` under it, on `python -m checkpoint`'s
    subparsers."""
    h = sub.add_parser(
        "hf",
        help="convert between HuggingFace and Brigade checkpoints (import, export)",
        description="Convert between HuggingFace and Brigade checkpoints.",
    )
    hf_sub = h.add_subparsers(dest="hf_command", required=True, parser_class=ArgParser)
    i = hf_sub.add_parser(
        "import", help="HF directory (config.json + safetensors) -> params-only Brigade checkpoint"
    )
    i.add_argument("hf_dir", metavar="HF_DIR")
    i.add_argument(
        "--out", required=True, metavar="CKPT", help="new directory for the Brigade checkpoint"
    )
    i.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="parameter dtype (default: float32)"
    )
    i.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="import tensors that hold NaN or infinity (refused by default; --init-from refuses"
        " them whatever this says)",
    )
    e = hf_sub.add_parser(
        "export", help="Brigade checkpoint (run, checkpoint or step directory) -> HF directory"
    )
    e.add_argument("ckpt", metavar="CKPT")
    e.add_argument(
        "--out", required=True, metavar="HF_DIR", help="new directory for config.json + safetensors"
    )
    e.add_argument(
        "--dtype", default=None, choices=DTYPES, help="tensor dtype (default: the checkpoint's)"
    )


def run(args: argparse.Namespace) -> None:
    """`python -m checkpoint hf import|export` with its parsed arguments; prints what it wrote."""
    if args.hf_command == "import":
        step_dir = import_checkpoint(args.hf_dir, args.out, args.dtype, args.allow_nonfinite)
        print(
            f"imported {args.hf_dir} to {step_dir} (parameters only); train from it with:"
            f" python -m train --config {os.path.join(args.out, 'model.yaml')}"
            f" --init-from {args.out}"
        )
        return
    _check_new_dir(args.out)
    import jax

    model = load_checkpoint(args.ckpt)
    save_pretrained(model, args.out, dtype=args.dtype)
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(model.params))
    print(
        f"exported {args.ckpt} ({n / 1e6:.2f}M parameters) to {args.out}"
        f" ({ARCHITECTURES[model.model_type]})"
    )
