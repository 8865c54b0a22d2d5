"""The per-device memory of a LoRA or QLoRA fine-tune from the formulas (`plan --devices`,
`plan --search`): what trains are the adapters (their gradients and optimizer state alone); the
frozen base is held beside them, at --lora.base_dtype or quantised (train/core/qlora.py), and the
step forms the weights it multiplies by from the base and the adapters:

- one layer's weights at a time, inside the layer scan, each multiplied by factored with its
  adapters, x W + scale (x A) B (models/adapters.py: no merged weight and no gradient of W's
  size): a bfloat16/float32 base's adapted weights cast to the compute dtype, a quantised base's
  weights dequantised to it; gathered over the axes that shard d_model (FSDP gathers a layer's
  weights before its matmuls), the forward's and the backward's layer both live: 2 x one layer;
  with --lora.quantize_embeddings the LM head dequantised once, gathered on d_model as FSDP
  gathers it and split on the vocabulary as the rules split it (a vocab-parallel head: the
  device's own vocabulary shard; the embedding only in its looked-up rows; a tied one is the
  head).

The stage's base bytes follow the same rule table as a full fine-tune's parameters (codes as the
weights, scales on the matching axes where the reduced dim still divides).
"""

from __future__ import annotations

import functools
import math
import types

import jax
import numpy as np

from mesh.rules import logical_to_spec
from mesh.shard import is_axis_names
from models import model as model_lib
from train.core import lora, qlora


@functools.lru_cache(maxsize=16)
def _abstract(stage, lora_cfg) -> tuple[dict, dict, dict, dict]:
    """(the base's abstract params, their logical axes, the base as the step holds it, the
    adapters' abstract arrays and axes) of one stage's model config."""
    full = model_lib.abstract_params(stage)
    axes = model_lib.param_axes(stage)
    run = types.SimpleNamespace(model=stage, lora=lora_cfg)
    if qlora.enabled(lora_cfg):
        held = qlora.abstract_base(run, lora.TARGET_WEIGHTS, full)
    else:
        dtype = lora.base_dtype(stage, lora_cfg)
        held = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), full)
    adapters = (lora.abstract_adapters(stage, lora_cfg), lora.adapter_axes(stage, lora_cfg))
    return full, axes, held, adapters


def _shard_bytes(shape, dtype, spec, mesh) -> int:
    """One device's bytes of an array `shape` split by `spec` (an undivided dim stays whole)."""
    elems = 1
    for i, n in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        k = 1 if entry is None else math.prod(mesh.shape[a] for a in np.atleast_1d(entry))
        elems *= n // k if n % k == 0 else n
    return elems * np.dtype(dtype).itemsize


def _specs(axes: dict, rules: dict, stage: bool = True) -> dict:
    # `stage`: the arrays of one pipeline stage, which holds its own layers whole
    rules = {**rules, "layers": ()} if stage else rules
    return jax.tree.map(lambda names: logical_to_spec(names, rules), axes, is_leaf=is_axis_names)


def lora_parts(stage, lora_cfg, mesh, rules, compute_dtype: str, whole: bool = True) -> dict:
    """{"base", "adapters", "merge"} bytes per device of one pipeline stage (see the module
    docstring); `whole` False: of the whole model, its layer stack split over `pipeline` as the
    rules say (a compiled plan's)."""
    full, axes, held, (adapters, adapter_axes) = _abstract(stage, lora_cfg)
    specs = _specs(axes, rules, whole)
    quantised = (
        {w.path: w for w in qlora.weights(stage, lora.TARGET_WEIGHTS, lora_cfg.quantize_embeddings)}
        if qlora.enabled(lora_cfg)
        else {}
    )
    base = 0
    flat_full = dict(_flat(full))
    for key, spec in _flat(specs):
        node = _at(held, key)
        if key in quantised:
            weight_shape = flat_full[key].shape
            for part in jax.tree.leaves(node):
                layers = quantised[key].layers
                part_spec = qlora.part_spec(spec, part.shape, weight_shape, mesh, layers)
                base += _shard_bytes(part.shape, part.dtype, part_spec, mesh)
        else:  # a quantised base holds the rest in the target's compute dtype
            dtype = compute_dtype if quantised else node.dtype
            base += _shard_bytes(node.shape, dtype, spec, mesh)
    adapter_specs = _specs(adapter_axes, rules, whole)
    adapter_bytes = sum(
        _shard_bytes(_at(adapters, key).shape, _at(adapters, key).dtype, spec, mesh)
        for key, spec in _flat(adapter_specs)
    )
    merge = _merge_bytes(
        stage, lora_cfg, flat_full, dict(_flat(specs)), dict(_flat(axes)), quantised, mesh,
        compute_dtype,
    )  # fmt: skip
    return {"base": base, "adapters": adapter_bytes, "merge": merge}


def _merge_bytes(stage, lora_cfg, flat_full, specs, axes, quantised, mesh, compute_dtype) -> int:
    """The weights the step forms from the base (and multiplies by with the adapters), per device
    (module docstring): a quantised base's quantised weights, a plain base's adapted ones."""
    formed = quantised or {tuple(k[:-1]) for k, _ in _flat(lora.adapter_axes(stage, lora_cfg))}
    layer = whole = 0
    for key in formed:
        if key == ("embed_VD",) and not stage.tie_embeddings:
            continue  # looked up by rows: only those are dequantised
        stacked = len(key) > 1  # a layer stack's weight [L, ...]; else the embedding or head
        shape, spec = flat_full[key].shape, tuple(specs[key])
        spec = spec + (None,) * (len(shape) - len(spec))
        # FSDP gathers the d_model dim; the others stay split (the vocabulary of a vocab-parallel
        # head: its dequantised shard is the device's own)
        spec = tuple(
            None if name in qlora.FSDP_AXES else e for name, e in zip(axes[key], spec, strict=True)
        )
        gathered, shape = (spec[1:], shape[1:]) if stacked else (spec, shape)
        size = _shard_bytes(shape, compute_dtype, gathered, mesh)
        layer, whole = (layer + size, whole) if stacked else (layer, whole + size)
    return 2 * layer + whole


def _flat(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """[(path of names, leaf)] of a nested dict (a leaf: anything not a dict)."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _flat(v, (*prefix, k))
        else:
            out.append(((*prefix, k), v))
    return out


def _at(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def lora_memory(parts: dict, ratio: float, on_device: float, on_host: float) -> dict:
    """The memory row of a LoRA run (estimate._memory's keys, `params` the adapters), its base and
    merged weights apart."""
    memory = {
        "params": parts["adapters"],
        "grads": parts["adapters"],
        "optimizer": parts["adapters"] * ratio,
        "activations": on_device,
        "base": parts["base"],
        "merge": parts["merge"],
    }
    memory["total"] = sum(memory.values())
    memory["host_activations"], memory["host_optimizer"] = on_host, 0.0
    return memory
