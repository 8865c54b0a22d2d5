"""HuggingFace Llama and Mixtral checkpoints <-> Brigade: `from_pretrained`, `save_pretrained`, a CLI.

    python -m models.hf import HF_DIR --out CKPT [--dtype float32]   # a params-only Brigade checkpoint
    python -m models.hf export CKPT --out HF_DIR [--dtype bfloat16]  # any Brigade checkpoint -> HF layout

The conversion is a table per architecture (`ROWS`): each row names a Brigade parameter (its '/'
path in the params dict), the HF tensor it comes from (a name template over layer `{l}`, and
expert `{e}` for MoE layers) and the layout change between the two. A template's placeholders
are the leading stacked dims of the Brigade array, in order ([L, ...] or [L, E, ...]), so adding
an architecture is adding rows. Reading needs neither torch nor transformers: config.json plus
safetensors (one file or a sharded index), tensor by tensor through safetensors' numpy API;
pickled `pytorch_model.bin` files are never loaded.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import typing
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from errors import ArgParser, UserError, one_line_errors
from models.config import ModelConfig

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16", "float16")


# -- layouts ------------------------------------------------------------------------------------
# HF nn.Linear stores weight [out, in]; Brigade stores [in, out] and keeps heads as their own dim.
# Head h's features are rows h*H..(h+1)*H-1 of q/k/v_proj (columns of o_proj), and HF's rotary
# embedding pairs feature i with i + H/2 (rotate_half), which is Brigade's split-halves layout, so
# no permutation is needed. GQA: query head n reads kv head n // (N/K) in both.
class Layout(NamedTuple):
    to_brigade: Callable[[np.ndarray, int], np.ndarray]   # (hf tensor, head_dim) -> Brigade slice
    to_hf: Callable[[np.ndarray, int], np.ndarray]        # (Brigade slice, head_dim) -> hf tensor


LAYOUTS = {
    "same": Layout(lambda w, h: w, lambda w, h: w),
    "T": Layout(lambda w, h: w.T, lambda w, h: w.T),                                       # [out,in] <-> [in,out]
    "in_heads": Layout(lambda w, h: w.T.reshape(w.shape[1], -1, h),                        # [N*H,D] <-> [D,N,H]
                       lambda w, h: w.reshape(w.shape[0], -1).T),
    "out_heads": Layout(lambda w, h: w.T.reshape(-1, h, w.shape[0]),                       # [D,N*H] <-> [N,H,D]
                        lambda w, h: w.reshape(-1, w.shape[-1]).T),
}


class Row(NamedTuple):
    brigade: str      # '/' path in the params dict
    hf: str           # tensor name; {l} = layer, {e} = expert: the leading stacked dims, in order
    layout: str       # key of LAYOUTS


_LAYER = "model.layers.{l}."


def _attention_rows(stack: str) -> tuple[Row, ...]:
    """The norms and attention of every layer; `stack` is the Brigade layer stack holding them."""
    return (
        Row(f"{stack}/attn_norm/scale", _LAYER + "input_layernorm.weight", "same"),
        Row(f"{stack}/attn/wq_DNH", _LAYER + "self_attn.q_proj.weight", "in_heads"),
        Row(f"{stack}/attn/wk_DKH", _LAYER + "self_attn.k_proj.weight", "in_heads"),
        Row(f"{stack}/attn/wv_DKH", _LAYER + "self_attn.v_proj.weight", "in_heads"),
        Row(f"{stack}/attn/wo_NHD", _LAYER + "self_attn.o_proj.weight", "out_heads"),
        Row(f"{stack}/mlp_norm/scale", _LAYER + "post_attention_layernorm.weight", "same"),
    )


_OUTER = (
    Row("embed_VD", "model.embed_tokens.weight", "same"),
    Row("final_norm/scale", "model.norm.weight", "same"),
    Row("lm_head_DV", "lm_head.weight", "T"),                      # absent with tie_word_embeddings
)
LLAMA_ROWS = _OUTER + _attention_rows("blocks") + (
    Row("blocks/mlp/w_gate_DF", _LAYER + "mlp.gate_proj.weight", "T"),
    Row("blocks/mlp/w_up_DF", _LAYER + "mlp.up_proj.weight", "T"),
    Row("blocks/mlp/w_down_FD", _LAYER + "mlp.down_proj.weight", "T"),
)
# Every Mixtral layer is MoE: Brigade's `moe_blocks` stack ([L, ...]; experts [L, E, ...]). HF
# Mixtral's router is softmax -> top-k -> renormalise, Brigade's `router=softmax`.
_MOE = _LAYER + "block_sparse_moe."
MIXTRAL_ROWS = _OUTER + _attention_rows("moe_blocks") + (
    Row("moe_blocks/moe/router_DE", _MOE + "gate.weight", "T"),
    Row("moe_blocks/moe/w_gate_EDF", _MOE + "experts.{e}.w1.weight", "T"),
    Row("moe_blocks/moe/w_up_EDF", _MOE + "experts.{e}.w3.weight", "T"),
    Row("moe_blocks/moe/w_down_EFD", _MOE + "experts.{e}.w2.weight", "T"),
)

ROWS = {"llama": LLAMA_ROWS, "mixtral": MIXTRAL_ROWS}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
# Llama 3.1's "llama3" RoPE scaling, where this ModelConfig has its fields.
_LLAMA3_ROPE = "rope_scaling_factor" in {f.name for f in dataclasses.fields(ModelConfig)}
_LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_len"}
# Tensors some checkpoints carry that hold nothing to convert (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# -- config.json <-> ModelConfig ----------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)   # JSON true is a Python int


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # json reads NaN


_KINDS = {"a positive integer": lambda v: _is_int(v) and v > 0,
          "a positive number": lambda v: _is_number(v) and v > 0,
          "a non-negative number": lambda v: _is_number(v) and v >= 0,
          "true or false": lambda v: isinstance(v, bool),
          "a string": lambda v: isinstance(v, str), "an object": lambda v: isinstance(v, dict)}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# The JSON type of every config.json key read here (null = absent for all but _REQUIRED): a string
# or a bool where a number belongs would otherwise reach int()/float()/bool() and convert silently.
_KEY_KINDS = {
    **dict.fromkeys(_REQUIRED + ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                                 "num_local_experts", "num_experts_per_tok"), "a positive integer"),
    "rope_theta": "a positive number", "rms_norm_eps": "a positive number",
    "router_aux_loss_coef": "a non-negative number",
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"), "true or false"),
    "model_type": "a string", "hidden_act": "a string", "rope_scaling": "an object", "rope_parameters": "an object",
}
_ROPE_KINDS = {"rope_theta": "a positive number", "rope_type": "a string", "type": "a string"}


def _show(value) -> str:
    """A value from a file as one short line of JSON (a newline in a tensor name stays escaped)."""
    text = json.dumps(value)
    return text if len(text) <= 100 else text[:97] + "..."


def check_config_types(hf, where: str = "config.json") -> None:
    """UserError naming the first config.json key whose JSON type is not the one it must have."""
    if not isinstance(hf, dict):
        raise UserError(f"{where}: expected a JSON object of config keys, got {_show(hf)}")
    checks = [(key, kind, hf.get(key)) for key, kind in _KEY_KINDS.items()]
    for section in ("rope_scaling", "rope_parameters"):
        if isinstance(hf.get(section), dict):
            checks += [(f"{section}.{k}", kind, hf[section].get(k)) for k, kind in _ROPE_KINDS.items()]
    for key, kind, value in checks:
        if value is None and key in _REQUIRED:
            raise UserError(f"{where}: {key} is missing (it must be {kind})")
        if value is not None and not _KINDS[kind](value):
            raise UserError(f"{where}: {key} must be {kind}, got {_show(value)}")


def config_from_hf(hf: dict, dtype: str = "float32", where: str = "config.json") -> tuple[str, ModelConfig]:
    """An HF config dict -> (model_type, ModelConfig). Anything Brigade would compute differently
    is refused with one line naming the key."""
    def bad(key, value, supported):
        raise UserError(f"{where}: {key}={json.dumps(value)} is not supported (supported: {supported})")

    check_config_types(hf, where)
    mtype = hf.get("model_type")
    if mtype not in ROWS:
        bad("model_type", mtype, ", ".join(ROWS))
    if dtype not in DTYPES:
        raise UserError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        bad("hidden_act", hf["hidden_act"], "silu")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            bad(key, hf[key], "false")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // n) or d % n:
        bad("head_dim", hf.get("head_dim"), f"hidden_size/num_attention_heads = {d / n:g}")
    rope = hf.get("rope_parameters") or {}   # transformers >= 5; older configs: rope_theta + rope_scaling
    scaling = hf.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    where_rope = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope_fields = {}
    if rope_type == "llama3" and _LLAMA3_ROPE:
        for key, field in _LLAMA3_KEYS.items():
            if not _is_number(scaling.get(key)):
                raise UserError(f"{where}: {where_rope}.{key} is missing or not a number (rope_type llama3 needs it)")
            rope_fields[field] = type(getattr(ModelConfig, field))(scaling[key])
    elif rope_type != "default":
        bad(f"{where_rope}.rope_type", rope_type, "default (no scaling)" + (", llama3" if _LLAMA3_ROPE else ""))
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        bad("sliding_window", hf["sliding_window"], "null (full causal attention)")
    moe = {}
    if mtype == "mixtral":
        for key in ("num_local_experts", "num_experts_per_tok"):
            if hf.get(key) is None:
                raise UserError(f"{where}: {key} is missing (a mixtral config needs it)")
        moe = dict(n_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                   d_ff_expert=hf["intermediate_size"], moe_every=1, router="softmax", dispatch="dropless",
                   aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.02)), z_loss_coef=0.0)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=n,
        n_kv_heads=hf.get("num_key_value_heads") or n, d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype, param_dtype=dtype, **moe, **rope_fields)
    try:
        return mtype, cfg.validate()
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def model_type_of(cfg: ModelConfig) -> str:
    """The HF architecture a Brigade config converts to; UserError naming the field it cannot express."""
    if not cfg.n_experts:
        return "llama"
    for field, want in (("moe_every", 1), ("n_shared_experts", 0), ("router", "softmax"), ("router_bias_rate", 0)):
        if getattr(cfg, field) != want:
            raise UserError(f"model.{field}={getattr(cfg, field)} has no HuggingFace Mixtral equivalent (needs {want})")
    return "mixtral"


def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict:
    model_type = model_type_of(cfg)
    dtype = dtype or cfg.param_dtype
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.expert_width if cfg.n_experts else cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        # both spellings: transformers < 5 reads rope_theta (+ rope_scaling), >= 5 rope_parameters
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": dtype, "dtype": dtype,
    }
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling:
        out["rope_scaling"] = {"rope_type": "llama3", **dict(zip(_LLAMA3_KEYS, scaling))}
        rope.update(out["rope_scaling"])
    if model_type == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.aux_loss_coef, sliding_window=None)
    return out


# -- the model object ---------------------------------------------------------------------------
def check_params(cfg: ModelConfig, params: dict, source: str = "params") -> None:
    """UserError naming the first array whose path or shape differs from what `cfg` implies: the
    layouts reshape by the config's head counts, so a config that does not describe its arrays
    (n_heads 4 read as 2) would convert without complaint into a silently wrong model."""
    from mesh.shard import path_names
    want = _expected_shapes(cfg)
    have = {n: tuple(a.shape) for n, a in path_names(params, is_leaf=lambda x: hasattr(x, "shape"))}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            found = f"shape {have[name]}" if name in have else "no such array"
            implied = f"shape {want[name]}" if name in want else "no such array"
            fields = ", ".join(f"{f}={getattr(cfg, f)}" for f in _SHAPE_FIELDS)
            raise UserError(f"{source}: params/{name} has {found}, but its model config ({fields}) implies {implied};"
                            f" the config does not describe these arrays")


_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "n_experts", "d_ff_expert",
                 "tie_embeddings")


class Model:
    """A ModelConfig and its params: `model(tokens_BT)` -> logits [B,T,V] float32."""

    def __init__(self, cfg: ModelConfig, params: dict, source: str = "params"):
        check_params(cfg, params, source)
        self.cfg, self.params = cfg, params

    @property
    def model_type(self) -> str:
        return model_type_of(self.cfg)

    @functools.cached_property
    def _forward(self):
        import jax
        from models import model as model_lib
        return jax.jit(lambda params, tokens_BT: model_lib.apply(self.cfg, params, tokens_BT)[0])

    def __call__(self, tokens_BT) -> "jax.Array":  # noqa: F821
        import jax.numpy as jnp
        return self._forward(self.params, jnp.asarray(tokens_BT, jnp.int32))

    def generate(self, prompt_BT, max_new: int, *, temperature: float = 0.0, top_k: int = 0, seed: int = 0):
        """prompt [B,T0] int32 -> [B, max_new] new tokens (greedy by default), with a KV cache."""
        import jax
        import jax.numpy as jnp
        from models.sample import generate
        return generate(self.cfg, self.params, jnp.asarray(prompt_BT, jnp.int32), jax.random.key(seed),
                        max_new=max_new, temperature=temperature, top_k=top_k)


# -- reading ------------------------------------------------------------------------------------
def _safetensors():
    try:
        import safetensors.numpy
        return safetensors
    except ImportError:
        raise UserError("models.hf needs the safetensors package: pip install 'brigade[hf]'") from None


# Bytes per element of the safetensors dtypes this converter reads (all floating point).
ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 100 << 20   # safetensors' own limit on a header's length


def _read_json(file: str):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:   # JSONDecodeError and UnicodeDecodeError alike
        raise UserError(f"{file}: not valid JSON ({e})") from None
    except OSError as e:
        raise UserError(f"{file}: cannot be read ({e.strerror or e})") from None


def read_header(file: str) -> dict[str, dict]:
    """A safetensors file's header {tensor: {dtype, shape, data_offsets}}, checked against the file
    before a byte of tensor data is read: what it claims must lie within the file, tightly packed."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < n <= min(size - 8, _MAX_HEADER):
            raise UserError(f"{file}: not a safetensors file (its 8-byte header length says {n},"
                            f" the file has {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise UserError(f"{file}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise UserError(f"{file}: the safetensors header is not a JSON object of tensors (got {_show(header)})")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise UserError(f"{file}: the safetensors __metadata__ must be an object of strings, got {_show(meta)}")
    data, spans = size - 8 - n, []
    for name, entry in header.items():
        spans.append((*_check_entry(f"{file}: tensor {_show(name)}", entry, data), name))
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            raise UserError(f"{file}: tensor {_show(name)} starts at data byte {start}, expected {end} (tensors must be"
                            f" packed without gaps or overlaps)")
        end = stop
    if end != data:
        raise UserError(f"{file}: its tensors end at data byte {end} but the file holds {data} data bytes")
    return header


def _check_entry(where: str, entry, data_bytes: int) -> tuple[int, int]:
    """One header entry's (start, stop) data offsets, after checking its dtype, shape and extent."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise UserError(f"{where}: expected {{dtype, shape, data_offsets}}, got {_show(entry)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in ST_DTYPES:
        raise UserError(f"{where}: dtype {_show(dtype)} is not supported (supported: {', '.join(ST_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise UserError(f"{where}: shape {_show(shape)} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise UserError(f"{where}: data_offsets {_show(offsets)} do not lie within the file's {data_bytes} data bytes")
    if offsets[1] - offsets[0] != math.prod(shape) * ST_DTYPES[dtype]:
        raise UserError(f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype}"
                        f" {tuple(shape)} needs {math.prod(shape) * ST_DTYPES[dtype]}")
    return offsets[0], offsets[1]


def _read_index(path: str) -> dict[str, str] | None:
    """The index's weight_map {tensor: shard file}, every shard a file inside `path`; None when the
    directory holds one model.safetensors instead."""
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        if os.path.isfile(os.path.join(path, SAFETENSORS)):
            return None
        found = ", ".join(sorted(os.listdir(path))) or "nothing"
        raise UserError(f"'{path}' has neither {SAFETENSORS} nor {INDEX} (found: {found}); pickled"
                        f" pytorch_model.bin checkpoints are not read: re-save them with safetensors")
    doc = _read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index}: expected {{\"weight_map\": {{tensor: shard file, ...}}}}, got {_show(doc)}")
    for tensor, shard in weight_map.items():
        # the index names files to open: it may not point outside the directory it describes
        if not shard or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise UserError(f"{index}: weight_map[{_show(tensor)}] = {_show(shard)} is outside the checkpoint"
                            f" directory (shard files are named relative to it, without '..')")
        if not os.path.isfile(os.path.join(path, shard)):
            raise UserError(f"{index}: lists shard {_show(shard)} (for {_show(tensor)}), which does not exist")
    return weight_map


class _Tensors:
    """Lazy access to the safetensors of an HF directory (one file, or shards listed by an index);
    every file's header is checked first, so names and shapes are known before any data is read."""

    def __init__(self, path: str):
        self.path = path
        weight_map = _read_index(path)
        files = sorted(set(weight_map.values())) if weight_map is not None else [SAFETENSORS]
        self.headers = {name: read_header(os.path.join(path, name)) for name in files}
        if weight_map is None:
            weight_map = dict.fromkeys(self.headers[SAFETENSORS], SAFETENSORS)
        for tensor, name in weight_map.items():
            if tensor not in self.headers[name]:
                raise UserError(f"{os.path.join(path, INDEX)}: lists {_show(tensor)} in {_show(name)}, which does"
                                f" not hold it")
        self.where, self._open = weight_map, {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[self.where[name]][name]["shape"])

    def get(self, name: str) -> np.ndarray:
        file = self.where[name]
        safetensors = _safetensors()
        try:  # the header was checked; this guards only against a file changed since
            if file not in self._open:
                self._open[file] = safetensors.safe_open(os.path.join(self.path, file), framework="numpy")
            return self._open[file].get_tensor(name)
        except safetensors.SafetensorError as e:
            raise UserError(f"{os.path.join(self.path, file)}: {name}: {e}") from None


def _names(template: str, shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
    """Every (index into the Brigade array's stacked dims, HF name) of a row: the template's
    placeholders, layer then expert, enumerate the leading dims of `shape`."""
    keys = [k for k in ("l", "e") if "{" + k + "}" in template]
    return ((idx, template.format(**dict(zip(keys, idx)))) for idx in _indices(shape[:len(keys)]))


def _indices(dims: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """np.ndindex, lazily: a config.json claiming a billion layers fails at the first missing tensor
    (np.ndindex and itertools.product first build every range)."""
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _indices(dims[1:]):
            yield (i, *rest)


def _rows(model_type: str, cfg: ModelConfig) -> list[Row]:
    return [r for r in ROWS[model_type] if not (cfg.tie_embeddings and r.brigade == "lm_head_DV")]


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from mesh.shard import path_names
    from models import model as model_lib
    return {n: tuple(s.shape) for n, s in path_names(model_lib.abstract_params(cfg), is_leaf=lambda x: hasattr(x, "shape"))}


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _get(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def _hf_shape(row: Row, shape: tuple[int, ...], head_dim: int) -> tuple[int, ...]:
    """The HF tensor shape of one slice of a Brigade array of `shape` (traced: nothing allocated)."""
    import jax
    stacked = sum("{" + k + "}" in row.hf for k in ("l", "e"))
    piece = jax.ShapeDtypeStruct(shape[stacked:], np.int8)
    return tuple(jax.eval_shape(lambda w: LAYOUTS[row.layout].to_hf(w, head_dim), piece).shape)


def _plan(path: str, tensors: _Tensors, model_type: str, cfg: ModelConfig) -> list[tuple[Row, tuple, list]]:
    """Every row with its Brigade shape and (index, HF name) pairs, each tensor checked present with
    the shape config.json implies from the file headers alone: nothing is allocated before the
    files are known to hold it."""
    want = _expected_shapes(cfg)
    uncovered = sorted(set(want) - {r.brigade for r in _rows(model_type, cfg)})
    if uncovered:  # a parameter the table does not fill would be left uninitialised
        raise UserError(f"the {model_type} conversion has no HF tensor for Brigade parameters {', '.join(uncovered)}")
    plan, used = [], set()
    for row in _rows(model_type, cfg):
        shape = want[row.brigade]
        hf_shape, names = _hf_shape(row, shape, cfg.head_dim), []
        for idx, name in _names(row.hf, shape):
            if name not in tensors.where:
                raise UserError(f"'{path}': tensor {name} is missing (needed for {row.brigade})")
            if tensors.shape(name) != hf_shape:
                raise UserError(f"'{path}': tensor {name} has shape {tensors.shape(name)},"
                                f" config.json implies {hf_shape}")
            names.append((idx, name))
        used.update(name for _, name in names)
        plan.append((row, shape, names))
    extra = sorted(n for n in tensors.where if n not in used and not n.endswith(IGNORED_SUFFIXES)
                   and not (cfg.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise UserError(f"'{path}': {len(extra)} tensors this {model_type} conversion does not know: "
                        + ", ".join(map(_show, extra[:5])) + (" ..." if len(extra) > 5 else ""))
    return plan


def load_params(path: str, model_type: str, cfg: ModelConfig) -> dict:
    """HF tensors -> Brigade params (numpy, cfg.param_dtype), checking every name and shape first."""
    tensors = _Tensors(path)
    dtype = np.dtype(_np_dtype(cfg.param_dtype))
    params = {}
    for row, shape, names in _plan(path, tensors, model_type, cfg):
        out = np.empty(shape, dtype)
        for idx, name in names:
            out[idx] = LAYOUTS[row.layout].to_brigade(tensors.get(name), cfg.head_dim).astype(dtype)
        _set(params, row.brigade, out)
    return params


def _np_dtype(name: str):
    import jax.numpy as jnp
    return jnp.dtype(name)  # bfloat16 via ml_dtypes


def read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise UserError(f"'{path}': no such HuggingFace checkpoint directory")
    if not os.path.exists(file):
        raise UserError(f"'{path}' has no config.json (expected a HuggingFace checkpoint directory)")
    return _read_json(file)   # its types are checked by config_from_hf


def from_pretrained(path: str, dtype: str = "float32", *, mesh=None, rules=None) -> Model:
    """A local HF checkpoint directory -> Model (params and compute in `dtype`). With `mesh`, every
    parameter is placed sharded by the logical-axis rules (default: mesh/rules.py)."""
    import jax
    model_type, cfg = config_from_hf(read_config(path), dtype, os.path.join(path, "config.json"))
    params = load_params(path, model_type, cfg)
    if mesh is None:
        return Model(cfg, jax.device_put(params), path)
    from mesh.rules import make_rules
    from mesh.shard import tree_shardings
    from models import model as model_lib
    shardings = tree_shardings(mesh, model_lib.param_axes(cfg), rules or make_rules())
    return Model(cfg, jax.device_put(params, shardings), path)


# -- writing ------------------------------------------------------------------------------------
def hf_tensors(model: Model, dtype: str | None = None) -> dict[str, np.ndarray]:
    """Brigade params -> {HF name: array} (host memory)."""
    import jax
    cfg = model.cfg
    dt = np.dtype(_np_dtype(dtype or cfg.param_dtype))
    out = {}
    for row in _rows(model.model_type, cfg):
        arr = np.asarray(jax.device_get(_get(model.params, row.brigade)))
        for idx, name in _names(row.hf, arr.shape):
            out[name] = np.ascontiguousarray(LAYOUTS[row.layout].to_hf(arr[idx], cfg.head_dim).astype(dt))
    return out


def save_pretrained(model: Model, path: str, *, dtype: str | None = None, max_shard_bytes: int = 5 << 30) -> None:
    """Write `path/config.json` and safetensors in HF layout (sharded with an index past
    `max_shard_bytes`), loadable by transformers' `AutoModelForCausalLM.from_pretrained(path)`.
    The files are written beside `path` first and moved in once all are complete, so a refusal or
    a failed write leaves `path` as it was (not created, when it did not exist)."""
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    tensors = hf_tensors(model, dtype)
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
        try:
            _write_files(staging, config_to_hf(model.cfg, dtype), tensors, max_shard_bytes)
            os.makedirs(path, exist_ok=True)
            for name in os.listdir(staging):
                os.replace(os.path.join(staging, name), os.path.join(path, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        raise UserError(f"'{path}': writing the HuggingFace files failed ({e.strerror or e})") from None


def _write_files(folder: str, config: dict, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> None:
    save_file = _safetensors().numpy.save_file
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards, size = [{}], 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    meta = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, SAFETENSORS), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map},
                  f, indent=2)


# -- Brigade checkpoints --------------------------------------------------------------------------
def import_checkpoint(hf_dir: str, out: str, dtype: str = "float32") -> str:
    """HF directory -> a params-only Brigade checkpoint `out/0/` (what `--init-from` starts from),
    plus `out/model.yaml`, the model section to train it with (`--config out/model.yaml`)."""
    import yaml
    from checkpoint.layout import versions
    from checkpoint.manager import Checkpointer
    from train.config import Config
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UserError(f"--out: '{out}' already exists and is not empty; choose a new directory")
    model_type, cfg = config_from_hf(read_config(hf_dir), dtype, os.path.join(hf_dir, "config.json"))
    params = load_params(hf_dir, model_type, cfg)
    config = Config(model=cfg, model_preset="default").to_dict()
    meta = {"step": 0, "contents": "params", "model": config["model"], "config": config, "mesh": {},
            "devices": 1, "processes": 1, "versions": versions(),
            "imported_from": {"path": os.path.abspath(hf_dir), "model_type": model_type}}
    ck = Checkpointer(out, keep=0, async_save=False)
    ck.save(0, {"params": params}, meta)
    ck.close()
    with open(os.path.join(out, "model.yaml"), "w") as f:
        yaml.safe_dump({"model": config["model"]}, f, sort_keys=False)
    return ck.step_dir(0)


def load_checkpoint(path: str) -> Model:
    """The params of any Brigade checkpoint (a run, a step, an export) as a Model in host memory."""
    from checkpoint.manager import open_checkpoint
    ck, step = open_checkpoint(path)
    source = f"checkpoint '{ck.step_dir(step)}'"
    cfg = config_from_meta(ck.meta(step), source)
    return Model(cfg, ck.restore_params_to_host(step), source)


def config_from_meta(meta: Any, source: str) -> ModelConfig:
    """The ModelConfig a checkpoint's metadata records, every field checked for its type (a string
    where a number belongs is refused, never converted) and validated."""
    model = meta.get("model") if isinstance(meta, dict) else None
    if not isinstance(model, dict):
        raise UserError(f"{source}: its metadata has no model config (a \"model\" object), so its arrays"
                        f" cannot be named")
    hints, fields = typing.get_type_hints(ModelConfig), {}
    for f in dataclasses.fields(ModelConfig):
        if f.name not in model:
            continue   # a field newer than the checkpoint: its default; check_params catches a wrong one
        value, kind = model[f.name], hints[f.name]
        ok = (isinstance(value, bool) if kind is bool else _is_int(value) if kind is int else
              _is_number(value) if kind is float else isinstance(value, kind))
        if not ok:
            raise UserError(f"{source}: metadata model.{f.name} must be {kind.__name__}, got {_show(value)}")
        fields[f.name] = kind(value)
    try:
        return ModelConfig(**fields).validate()
    except UserError as e:
        raise UserError(f"{source}: metadata {e}") from None


# -- CLI ----------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="python -m models.hf", description="Convert between HuggingFace and Brigade checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgParser)
    i = sub.add_parser("import", help="HF directory (config.json + safetensors) -> params-only Brigade checkpoint")
    i.add_argument("hf_dir", metavar="HF_DIR")
    i.add_argument("--out", required=True, metavar="CKPT", help="new directory for the Brigade checkpoint")
    i.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter dtype (default: float32)")
    e = sub.add_parser("export", help="Brigade checkpoint (run, checkpoint or step directory) -> HF directory")
    e.add_argument("ckpt", metavar="CKPT")
    e.add_argument("--out", required=True, metavar="HF_DIR", help="new directory for config.json + safetensors")
    e.add_argument("--dtype", default=None, choices=DTYPES, help="tensor dtype (default: the checkpoint's)")
    return p


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    import absl.logging
    absl.logging.set_verbosity(absl.logging.ERROR)
    if args.command == "import":
        step_dir = import_checkpoint(args.hf_dir, args.out, args.dtype)
        print(f"imported {args.hf_dir} to {step_dir} (parameters only); train from it with:"
              f" python -m train --config {os.path.join(args.out, 'model.yaml')} --init-from {args.out}")
    else:
        if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
            raise UserError(f"--out: '{args.out}' already exists and is not empty; choose a new directory")
        import jax
        model = load_checkpoint(args.ckpt)
        save_pretrained(model, args.out, dtype=args.dtype)
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(model.params))
        print(f"exported {args.ckpt} ({n / 1e6:.2f}M parameters) to {args.out} ({ARCHITECTURES[model.model_type]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
