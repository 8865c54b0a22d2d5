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
import sys
from typing import Callable, NamedTuple

import numpy as np

from mesh.errors import ArgParser, UserError, one_line_errors
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
def config_from_hf(hf: dict, dtype: str = "float32", where: str = "config.json") -> tuple[str, ModelConfig]:
    """An HF config dict -> (model_type, ModelConfig). Anything Brigade would compute differently
    is refused with one line naming the key."""
    def bad(key, value, supported):
        raise UserError(f"{where}: {key}={json.dumps(value)} is not supported (supported: {supported})")

    mtype = hf.get("model_type")
    if mtype not in ROWS:
        bad("model_type", mtype, ", ".join(ROWS))
    if dtype not in DTYPES:
        raise UserError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(hf.get(key), int):
            raise UserError(f"{where}: {key} is missing or not an integer")
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
            if not isinstance(scaling.get(key), (int, float)):
                raise UserError(f"{where}: {where_rope}.{key} is missing or not a number (rope_type llama3 needs it)")
            rope_fields[field] = type(getattr(ModelConfig, field))(scaling[key])
    elif rope_type != "default":
        bad(f"{where_rope}.rope_type", rope_type, "default (no scaling)" + (", llama3" if _LLAMA3_ROPE else ""))
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        bad("sliding_window", hf["sliding_window"], "null (full causal attention)")
    moe = {}
    if mtype == "mixtral":
        for key in ("num_local_experts", "num_experts_per_tok"):
            if not isinstance(hf.get(key), int):
                raise UserError(f"{where}: {key} is missing or not an integer")
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
class Model:
    """A ModelConfig and its params: `model(tokens_BT)` -> logits [B,T,V] float32."""

    def __init__(self, cfg: ModelConfig, params: dict):
        self.cfg, self.params = cfg, params

    @property
    def model_type(self) -> str:
        return model_type_of(self.cfg)

    @functools.cached_property
    def _forward(self):
        import jax
        from models import model as M
        return jax.jit(lambda params, tokens_BT: M.apply(self.cfg, params, tokens_BT)[0])

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


class _Tensors:
    """Lazy access to the safetensors of an HF directory (one file, or shards listed by an index)."""

    def __init__(self, path: str):
        safe_open = _safetensors().safe_open
        index, single = os.path.join(path, INDEX), os.path.join(path, SAFETENSORS)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
        elif os.path.isfile(single):
            weight_map = None
        else:
            found = ", ".join(sorted(os.listdir(path))) or "nothing"
            raise UserError(f"'{path}' has neither {SAFETENSORS} nor {INDEX} (found: {found}); pickled"
                            f" pytorch_model.bin checkpoints are not read: re-save them with safetensors")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SAFETENSORS]
        self._open, self.where = {}, {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise UserError(f"{index}: lists shard '{name}', which does not exist")
            self._open[name] = safe_open(file, framework="numpy")
            for key in self._open[name].keys():
                self.where[key] = name

    def get(self, name: str) -> np.ndarray:
        return self._open[self.where[name]].get_tensor(name)


def _names(template: str, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
    """Every (index into the Brigade array's stacked dims, HF name) of a row: the template's
    placeholders, layer then expert, enumerate the leading dims of `shape`."""
    keys = [k for k in ("l", "e") if "{" + k + "}" in template]
    return [(idx, template.format(**dict(zip(keys, idx)))) for idx in np.ndindex(*shape[:len(keys)])]


def _rows(model_type: str, cfg: ModelConfig) -> list[Row]:
    return [r for r in ROWS[model_type] if not (cfg.tie_embeddings and r.brigade == "lm_head_DV")]


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from mesh.shard import path_names
    from models import model as M
    return {n: tuple(s.shape) for n, s in path_names(M.abstract_params(cfg), is_leaf=lambda x: hasattr(x, "shape"))}


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _get(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def load_params(path: str, model_type: str, cfg: ModelConfig) -> dict:
    """HF tensors -> Brigade params (numpy, cfg.param_dtype), checking every name and shape."""
    tensors = _Tensors(path)
    want = _expected_shapes(cfg)
    dtype = np.dtype(_np_dtype(cfg.param_dtype))
    params, used = {}, set()
    for row in _rows(model_type, cfg):
        layout, shape = LAYOUTS[row.layout], want[row.brigade]
        names = _names(row.hf, shape)
        stack = shape[:len(names[0][0])]
        hf_shape = tuple(layout.to_hf(np.empty(shape[len(stack):], np.int8), cfg.head_dim).shape)
        out = np.empty(shape, dtype)
        for idx, name in names:
            if name not in tensors.where:
                raise UserError(f"'{path}': tensor {name} is missing (needed for {row.brigade})")
            t = tensors.get(name)
            if t.shape != hf_shape:
                raise UserError(f"'{path}': tensor {name} has shape {tuple(t.shape)}, config.json implies {hf_shape}")
            out[idx] = layout.to_brigade(t, cfg.head_dim).astype(dtype)
            used.add(name)
        _set(params, row.brigade, out)
    uncovered = sorted(set(want) - {r.brigade for r in _rows(model_type, cfg)})
    if uncovered:  # a parameter the table does not fill would be left uninitialised
        raise UserError(f"the {model_type} conversion has no HF tensor for Brigade parameters {', '.join(uncovered)}")
    extra = sorted(n for n in tensors.where if n not in used and not n.endswith(IGNORED_SUFFIXES)
                   and not (cfg.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise UserError(f"'{path}': {len(extra)} tensors this {model_type} conversion does not know: "
                        + ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""))
    return params


def _np_dtype(name: str):
    import jax.numpy as jnp
    return jnp.dtype(name)  # bfloat16 via ml_dtypes


def read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise UserError(f"'{path}': no such HuggingFace checkpoint directory")
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"'{path}' has no config.json (expected a HuggingFace checkpoint directory)") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: not valid JSON ({e})") from None


def from_pretrained(path: str, dtype: str = "float32", *, mesh=None, rules=None) -> Model:
    """A local HF checkpoint directory -> Model (params and compute in `dtype`). With `mesh`, every
    parameter is placed sharded by the logical-axis rules (default: mesh/rules.py)."""
    import jax
    model_type, cfg = config_from_hf(read_config(path), dtype, os.path.join(path, "config.json"))
    params = load_params(path, model_type, cfg)
    if mesh is None:
        return Model(cfg, jax.device_put(params))
    from mesh.rules import make_rules
    from mesh.shard import tree_shardings
    from models import model as M
    shardings = tree_shardings(mesh, M.param_axes(cfg), rules or make_rules())
    return Model(cfg, jax.device_put(params, shardings))


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
    `max_shard_bytes`), loadable by transformers' `AutoModelForCausalLM.from_pretrained(path)`."""
    save_file = _safetensors().numpy.save_file
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    tensors = hf_tensors(model, dtype)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(model.cfg, dtype), f, indent=2)
    shards, size = [{}], 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    meta = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SAFETENSORS), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map},
                  f, indent=2)


# -- Brigade checkpoints --------------------------------------------------------------------------
def import_checkpoint(hf_dir: str, out: str, dtype: str = "float32") -> str:
    """HF directory -> a params-only Brigade checkpoint `out/0/` (what `--init-from` starts from),
    plus `out/model.yaml`, the model section to train it with (`--config out/model.yaml`)."""
    import yaml
    from checkpoint.items import versions
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
    meta = ck.meta(step)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in meta.get("model", {}).items() if k in fields})
    return Model(cfg, ck.restore_params_to_host(step))


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
