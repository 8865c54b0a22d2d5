"""HuggingFace Gemma (1), Gemma 2 and Gemma 3 (text) config.json <-> the ModelConfig fields they
set: the family's math (sqrt(d_model) embedding scale, RMSNorm by 1 + w, GeGLU, sandwich norms,
soft-capping, query_pre_attn_scalar, q/k norms) and its per-layer attention (`layer_types` <->
`model.layer_pattern`, the local and global RoPE bases). models/hf_config.py reads the keys every
family shares and calls in here for these; what Brigade would compute differently is refused in
one line naming the key, as there.

As transformers computes it (5.x): Gemma reads `hidden_act`, Gemma 2/3 `hidden_activation`; Gemma 2
soft-caps attention scores and logits; Gemma 3's attention never applies `attn_logit_softcapping`
(its config carries the key, its attention ignores it), so neither does the import; Gemma 3's
`rope_parameters` has one entry per layer type (`full_attention`, `sliding_attention`), older
configs `rope_theta` (global), `rope_local_base_freq` and `rope_scaling` (global only).
"""

from __future__ import annotations

from errors import UserError
from models.fields import is_number
from models.layer_pattern import GLOBAL, LOCAL, layer_kinds, shortest_period

ARCHITECTURES = {
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
NAMES = {"gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}
# config.json keys read here and their JSON types (models/hf_config.py checks them with its own)
KEY_KINDS = {
    "query_pre_attn_scalar": "a positive number",
    "attn_logit_softcapping": "a positive number",
    "final_logit_softcapping": "a positive number",
    "rope_local_base_freq": "a positive number",
    "sliding_window_pattern": "a positive integer",
    "hidden_activation": "a string",
    "use_bidirectional_attention": "true or false",
}
# HF activation name <-> model.mlp_activation
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}
LAYER_TYPES = {"sliding_attention": LOCAL, "full_attention": GLOBAL}
# each ModelConfig field only a Gemma family expresses, at its default
FIELDS = {
    "embed_scale": False,
    "norm_plus_one": False,
    "mlp_activation": "silu",
    "sandwich_norm": False,
    "attn_softcap": 0.0,
    "final_softcap": 0.0,
    "query_pre_attn_scalar": 0.0,
    "layer_pattern": "",
    "rope_local_theta": 0.0,
    "rope_linear_factor": 1.0,
}


def _bad(where: str, key: str, value, supported: str):
    import json

    raise UserError(f"{where}: {key}={json.dumps(value)} is not supported (supported: {supported})")


def fields_from_hf(hf: dict, mtype: str, where: str) -> dict:
    """The ModelConfig fields of a Gemma config.json beyond those every family shares."""
    if hf.get("use_bidirectional_attention"):
        _bad(where, "use_bidirectional_attention", True, "false (causal attention)")
    if hf.get("attention_bias"):
        _bad(where, "attention_bias", True, "false")
    act_key = "hidden_act" if mtype == "gemma" else "hidden_activation"
    act = hf.get(act_key) or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        _bad(where, act_key, act, ", ".join(ACTIVATIONS))
    out = dict(
        embed_scale=True,
        norm_plus_one=True,
        mlp_activation=ACTIVATIONS[act],
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )
    out.update(_rope(hf, mtype, where))
    if mtype == "gemma":
        return out
    out.update(
        sandwich_norm=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        qk_norm=mtype == "gemma3_text",
        **_pattern(hf, mtype, where),
    )
    if mtype == "gemma2":
        out["attn_softcap"] = float(hf.get("attn_logit_softcapping") or 0.0)
    return out


def _pattern(hf: dict, mtype: str, where: str) -> dict:
    """layer_types (default: Gemma 2 every other layer global, Gemma 3 every
    sliding_window_pattern-th) -> layer_pattern and sliding_window."""
    layers = hf["num_hidden_layers"]
    every = 2 if mtype == "gemma2" else hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
    ]
    if len(types) != layers or set(types) - set(LAYER_TYPES):
        _bad(
            where,
            "layer_types",
            types,
            f"num_hidden_layers={layers} entries, each one of {', '.join(LAYER_TYPES)}",
        )
    kinds = [LAYER_TYPES[t] for t in types]
    window = hf.get("sliding_window", 4096)
    if LOCAL in kinds and not window:
        _bad(where, "sliding_window", window, "a positive integer: layer_types has sliding layers")
    if set(kinds) == {GLOBAL}:
        return dict(layer_pattern="", sliding_window=0)
    return dict(layer_pattern=shortest_period(kinds), sliding_window=window)


def _rope(hf: dict, mtype: str, where: str) -> dict:
    """RoPE bases and scaling: one for every layer (Gemma, Gemma 2), or the global and the local
    layers' (Gemma 3)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if mtype != "gemma3_text":
        section = params or {**scaling, "rope_theta": hf.get("rope_theta", 10000.0)}
        name = "rope_parameters" if params else "rope_scaling"
        theta, factor = _one_rope(section, name, where, linear=True)
        return dict(rope_theta=theta, rope_linear_factor=factor)
    full = params.get("full_attention") or {**scaling, "rope_theta": hf.get("rope_theta", 1e6)}
    local = params.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    prefix = "rope_parameters." if params.get("full_attention") else ""
    theta, factor = _one_rope(full, prefix + "full_attention", where, linear=True)
    local_theta, _ = _one_rope(local, prefix + "sliding_attention", where, linear=False)
    return dict(rope_theta=theta, rope_linear_factor=factor, rope_local_theta=local_theta)


def _one_rope(section, name: str, where: str, *, linear: bool) -> tuple[float, float]:
    """(theta, linear factor) of one RoPE section: rope_type default, or linear where allowed."""
    if not isinstance(section, dict):
        _bad(where, name, section, "an object with rope_type and rope_theta")
    kind = section.get("rope_type", section.get("type", "default"))
    if kind not in ("default", "linear") or (kind == "linear" and not linear):
        _bad(where, f"{name}.rope_type", kind, "default" + (", linear" if linear else ""))
    theta = section.get("rope_theta", 10000.0)
    factor = section.get("factor", 1.0) if kind == "linear" else 1.0
    for key, value, ok, want in (
        ("rope_theta", theta, lambda v: v > 0, "a positive number"),
        ("factor", factor, lambda v: v >= 1, "a number >= 1"),
    ):
        if not is_number(value) or not ok(value):
            raise UserError(f"{where}: {name}.{key} must be {want}, got {value!r}")
    return float(theta), float(factor)


# -- export ----------------------------------------------------------------------------------------
def family_of(cfg) -> str | None:
    """The Gemma architecture a ModelConfig converts to, None where it sets no Gemma field;
    UserError naming the first field the family cannot express."""
    changed = [f for f, default in FIELDS.items() if getattr(cfg, f) != default]
    if not changed:
        return None
    if cfg.qk_norm:
        mtype = "gemma3_text"
    elif cfg.sandwich_norm or cfg.attn_softcap or cfg.final_softcap or cfg.layer_pattern:
        mtype = "gemma2"
    else:
        mtype = "gemma"
    plain = mtype == "gemma"
    needs = [
        ("embed_scale", True),
        ("norm_plus_one", True),
        ("n_experts", 0),
        ("qkv_bias", False),
        ("rope_scaling_factor", 1.0),
        ("sandwich_norm", not plain),
    ]
    if plain:
        needs += [("sliding_window", 0), ("query_pre_attn_scalar", 0.0)]
    if mtype != "gemma3_text":
        needs += [("rope_local_theta", 0.0)]
    if mtype == "gemma3_text":
        needs += [("attn_softcap", 0.0)]
    for field, want in needs:
        if getattr(cfg, field) != want:
            raise UserError(
                f"model.{changed[0]}={getattr(cfg, changed[0])!r} converts only to HuggingFace"
                f" {NAMES[mtype]}, which has no model.{field}={getattr(cfg, field)!r} (needs"
                f" {want!r})"
            )
    return mtype


def to_hf(cfg, mtype: str) -> dict:
    """The Gemma keys of config.json (added to the keys every family shares)."""
    act = {v: k for k, v in ACTIVATIONS.items()}[cfg.mlp_activation]
    out = {"hidden_act": act, "hidden_activation": act}
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_linear_factor != 1.0:
        full.update(rope_type="linear", factor=cfg.rope_linear_factor)
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_linear_factor}
    out["rope_parameters"] = full
    if mtype == "gemma":
        return out
    kinds = layer_kinds(cfg)
    local = cfg.rope_local_theta or cfg.rope_theta
    out.update(
        # transformers types it an int (Gemma's are: 256, 144, 168)
        query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
        final_logit_softcapping=cfg.final_softcap or None,
        attn_logit_softcapping=cfg.attn_softcap or None,
        sliding_window=cfg.sliding_window or None,
        layer_types=[
            "sliding_attention"
            if k == LOCAL or (not k and cfg.sliding_window)
            else "full_attention"
            for k in kinds
        ],
    )
    if mtype == "gemma3_text":
        out["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
        out["rope_local_base_freq"] = local
    return out


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x
