"""HuggingFace config.json <-> Brigade's ModelConfig, for the Llama, Mistral, Mixtral, Qwen2/2.5,
Qwen3 and Gemma 1/2/3 families: every key's JSON type checked, anything Brigade would compute
differently refused in one line naming the key, and the reverse for export (which family a
ModelConfig converts to). The Gemma families' own keys are models/hf_gemma.py's; the tensors'
tables are models/hf.py's.
"""

from __future__ import annotations

import dataclasses
import json

from errors import UserError
from models import hf_gemma, hf_moe_config
from models.config import ModelConfig
from models.fields import is_int, is_number

DTYPES = ("float32", "bfloat16", "float16")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **hf_gemma.ARCHITECTURES,
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# config.json keys each family's HF model reads that add tensors Brigade has no place
# for (true is refused)
_BIAS_KEYS = {
    "llama": ("attention_bias", "mlp_bias"),
    "qwen3": ("attention_bias",),
    "qwen3_moe": ("attention_bias",),
    "deepseek_v3": ("attention_bias",),
}
# families whose config.json may set head_dim apart from hidden_size / num_attention_heads
# (DeepSeek-V3's is its rotary width: latent attention has its own head widths)
_FREE_HEAD_DIM = ("mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", *hf_gemma.ARCHITECTURES)
_QWEN3_TYPES = ("qwen3", "qwen3_moe")
# multimodal configs: the text model inside is supported, the towers that feed it are not
_TOWERS = {"gemma3": ("vision_config", "gemma3_text")}
# Llama 3.1's "llama3" RoPE scaling, where this ModelConfig has its fields.
_LLAMA3_ROPE = "rope_scaling_factor" in {f.name for f in dataclasses.fields(ModelConfig)}
_LLAMA3_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_len",
}
# Tensors some checkpoints carry that hold nothing to convert (recomputed from the config).


_KINDS = {
    "a positive integer": lambda v: is_int(v) and v > 0,
    "a non-negative integer": lambda v: is_int(v) and v >= 0,
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "a list of non-negative integers": lambda v: (
        isinstance(v, list) and all(is_int(x) and x >= 0 for x in v)
    ),
    "a positive number": lambda v: is_number(v) and v > 0,
    "a non-negative number": lambda v: is_number(v) and v >= 0,
    "true or false": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
# The JSON type of every config.json key read here (null = absent for all but _REQUIRED): a string
# or a bool where a number belongs would otherwise reach int()/float()/bool() and convert silently.
_KEY_KINDS = {
    **dict.fromkeys(
        _REQUIRED
        + (
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "sliding_window",
            "num_local_experts",
            "num_experts_per_tok",
        ),
        "a positive integer",
    ),
    "max_window_layers": "a non-negative integer",
    "layer_types": "a list of strings",
    "rope_theta": "a positive number",
    "rms_norm_eps": "a positive number",
    "router_aux_loss_coef": "a non-negative number",
    **dict.fromkeys(
        ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"), "true or false"
    ),
    "model_type": "a string",
    "hidden_act": "a string",
    "rope_scaling": "an object",
    "rope_parameters": "an object",
    **hf_gemma.KEY_KINDS,
    **hf_moe_config.KEY_KINDS,
}
_ROPE_KINDS = {"rope_theta": "a positive number", "rope_type": "a string", "type": "a string"}


def short_json(value) -> str:
    """A value from a file as one short line of JSON (a newline in a tensor name stays escaped)."""
    text = json.dumps(value)
    return text if len(text) <= 100 else text[:97] + "..."


def check_config_types(hf, where: str = "config.json") -> None:
    """UserError naming the first config.json key whose JSON type is not the one it must have."""
    if not isinstance(hf, dict):
        raise UserError(f"{where}: expected a JSON object of config keys, got {short_json(hf)}")
    checks = [(key, kind, hf.get(key)) for key, kind in _KEY_KINDS.items()]
    for section in ("rope_scaling", "rope_parameters"):
        if isinstance(hf.get(section), dict):
            checks += [
                (f"{section}.{k}", kind, hf[section].get(k)) for k, kind in _ROPE_KINDS.items()
            ]
    for key, kind, value in checks:
        if value is None and key in _REQUIRED:
            raise UserError(f"{where}: {key} is missing (it must be {kind})")
        if value is not None and not _KINDS[kind](value):
            raise UserError(f"{where}: {key} must be {kind}, got {short_json(value)}")


def _bad(where: str, key: str, value, supported: str):
    raise UserError(f"{where}: {key}={json.dumps(value)} is not supported (supported: {supported})")


def config_from_hf(
    hf: dict, dtype: str = "float32", where: str = "config.json"
) -> tuple[str, ModelConfig]:
    """An HF config dict -> (model_type, ModelConfig). Anything Brigade would compute differently
    is refused with one line naming the key. A multimodal config is refused first: its language
    model's keys (vocab_size ...) are in its text_config, so the key checks would name those."""
    mtype = hf.get("model_type") if isinstance(hf, dict) else None
    if isinstance(mtype, str) and mtype in _TOWERS:
        key, text = _TOWERS[mtype]
        raise UserError(
            f"{where}: model_type={json.dumps(mtype)} is a multimodal model: its tower"
            f" ({key}{' set' if key in hf else ''}) has no place in Brigade's decoder; its"
            f" language model converts as model_type {text} (its text_config)"
        )
    check_config_types(hf, where)
    if mtype not in ARCHITECTURES:
        _bad(where, "model_type", mtype, ", ".join(ARCHITECTURES))
    if dtype not in DTYPES:
        raise UserError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    gemma = mtype in hf_gemma.ARCHITECTURES
    if not gemma and hf.get("hidden_act", "silu") != "silu":
        _bad(where, "hidden_act", hf["hidden_act"], "silu")
    for key in _BIAS_KEYS.get(mtype, ()):
        if hf.get(key):
            _bad(where, key, hf[key], "false")
    d, n = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if mtype not in _FREE_HEAD_DIM and (head_dim not in (None, d // n) or d % n):
        _bad(where, "head_dim", head_dim, f"hidden_size/num_attention_heads = {d / n:g}")
    free_head_dim = (
        mtype != "deepseek_v3" and head_dim is not None and (head_dim != d // n or d % n)
    )
    rope = hf.get("rope_parameters") or {}  # transformers >= 5; before: rope_theta + rope_scaling
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        n_heads=n,
        n_kv_heads=hf.get("num_key_value_heads") or n,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attn_head_dim=head_dim if free_head_dim else 0,
        qkv_bias=mtype == "qwen2",
        qk_norm=mtype in _QWEN3_TYPES,
        sliding_window=_sliding_window(hf, mtype, where),
        dtype=dtype,
        param_dtype=dtype,
    )
    if mtype == "mixtral":
        fields.update(_mixtral(hf, where))
    if mtype in hf_moe_config.MOE_TYPES:
        fields.update(hf_moe_config.fields_from_hf(hf, mtype, where))
    fields.update(hf_gemma.fields_from_hf(hf, mtype, where) if gemma else _rope_scaling(hf, where))
    try:
        return mtype, ModelConfig(**fields).validate()
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def _mixtral(hf: dict, where: str) -> dict:
    """Mixtral's MoE fields: every layer MoE, softmax top-k renormalised, dropless."""
    for key in ("num_local_experts", "num_experts_per_tok"):
        if hf.get(key) is None:
            raise UserError(f"{where}: {key} is missing (a mixtral config needs it)")
    return dict(
        n_experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        d_ff_expert=hf["intermediate_size"],
        moe_every=1,
        router="softmax",
        dispatch="dropless",
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.02)),
        z_loss_coef=0.0,
    )


def _rope_scaling(hf: dict, where: str) -> dict:
    """The ModelConfig fields of config.json's RoPE scaling: none, or Llama 3.1's "llama3"."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    where_rope = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope_fields = {}
    if rope_type == "llama3" and _LLAMA3_ROPE:
        for key, field in _LLAMA3_KEYS.items():
            if not is_number(scaling.get(key)):
                raise UserError(
                    f"{where}: {where_rope}.{key} is missing or not a number"
                    " (rope_type llama3 needs it)"
                )
            rope_fields[field] = type(getattr(ModelConfig, field))(scaling[key])
    elif rope_type != "default":
        _bad(
            where,
            f"{where_rope}.rope_type",
            rope_type,
            "default (no scaling)" + (", llama3" if _LLAMA3_ROPE else ""),
        )
    return rope_fields


def _sliding_window(hf: dict, mtype: str, where: str) -> int:
    """The window every layer attends within (0: none), as each family's HF model reads config.json.
    Mistral and Mixtral: `sliding_window` (null = none), every layer. Qwen2/3: only with
    `use_sliding_window`, and only on the layers `layer_types` marks sliding (by default those from
    `max_window_layers` on), so a mix of sliding and full layers is refused. Llama has none."""
    window = hf.get("sliding_window")
    if mtype in ("mistral", "mixtral"):
        return window or 0
    if mtype == "qwen3_moe":  # every layer, with use_sliding_window
        return (window or 0) if hf.get("use_sliding_window") else 0
    if window is None or not hf.get("use_sliding_window", mtype == "llama"):
        return 0
    if mtype == "llama":
        _bad(where, "sliding_window", window, "null (full causal attention)")
    layers = hf["num_hidden_layers"]
    first_sliding = hf.get("max_window_layers", 28)  # transformers' default for Qwen2/3
    kinds = hf.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(layers)
    ]
    key = "layer_types" if hf.get("layer_types") else "max_window_layers"
    if (
        set(kinds) - {"sliding_attention", "full_attention"}
        or len(set(kinds)) > 1
        or len(kinds) != layers
    ):
        _bad(
            where,
            key,
            hf.get(key, first_sliding),
            "every one of the num_hidden_layers layers the same kind:"
            " all sliding_attention, or all full_attention",
        )
    return window if kinds[0] == "sliding_attention" else 0


def model_type_of(cfg: ModelConfig) -> str:
    """The HF architecture a Brigade config converts to; UserError naming the field it cannot
    express. A Gemma field set: that Gemma (models/hf_gemma.py). MoE: DeepSeek-V3 has latent
    attention, Qwen3-MoE the q/k norms, Mixtral neither (models/hf_moe_config.py). Dense: Qwen3
    has the q/k norms, Qwen2 the q/k/v biases, Mistral a sliding window or a free head_dim
    (Qwen2/3 carry those too); plain Llama what is left."""
    gemma = hf_gemma.family_of(cfg)
    if gemma:
        return gemma
    if cfg.n_experts:
        return hf_moe_config.moe_type_of(cfg)
    for field in ("kv_lora_rank", "mtp_layers"):
        if getattr(cfg, field):
            raise UserError(
                f"model.{field}={getattr(cfg, field)} has a HuggingFace equivalent only in"
                " DeepSeek-V3, an MoE model (needs n_experts > 0)"
            )
    if cfg.qkv_bias and cfg.qk_norm:
        raise UserError(
            "model.qkv_bias=True with model.qk_norm=True has no HuggingFace equivalent"
            " (Qwen2 has the biases, Qwen3 the norms); set one of them false"
        )
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window or cfg.attn_head_dim else "llama"


def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict:
    model_type = model_type_of(cfg)
    dtype = dtype or cfg.param_dtype
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # both spellings: transformers < 5 reads rope_theta (+ rope_scaling), >= 5 rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    out.update(dict.fromkeys(_BIAS_KEYS.get(model_type, ()), False))
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling:
        out["rope_scaling"] = {"rope_type": "llama3", **dict(zip(_LLAMA3_KEYS, scaling))}
        rope.update(out["rope_scaling"])
    window = cfg.sliding_window or None
    if model_type in ("mistral", "mixtral"):
        out["sliding_window"] = window
    elif model_type == "qwen3_moe":
        out.update(use_sliding_window=bool(window), sliding_window=window)
    elif model_type in ("qwen2", "qwen3"):  # every layer alike: all sliding or all full
        kind = "sliding_attention" if window else "full_attention"
        out.update(
            use_sliding_window=bool(window),
            sliding_window=window,
            max_window_layers=0 if window else cfg.n_layers,
            layer_types=[kind] * cfg.n_layers,
        )
    if cfg.n_experts:
        out.update(hf_moe_config.config_keys(cfg, model_type))
    if model_type in hf_gemma.ARCHITECTURES:
        out.update(hf_gemma.to_hf(cfg, model_type))
    return out
