"""config.json <-> ModelConfig for the MoE families beyond Mixtral: Qwen3-MoE (`qwen3_moe`: Qwen3's
attention, a softmax router with or without renormalisation, dense layers by `mlp_only_layers` and
`decoder_sparse_step`) and DeepSeek-V3 (`deepseek_v3`: latent attention, a sigmoid router with the
aux-loss-free bias, group-limited routing and a scale, shared experts, the first
`first_k_dense_replace` layers dense, multi-token prediction modules). models/hf_config.py calls it
for those two model types; the tensors' tables are models/hf.py's.
"""

from __future__ import annotations

import json

from errors import UserError

MOE_TYPES = ("qwen3_moe", "deepseek_v3")

# the JSON kinds of the keys read here (models/hf_config.py checks them with its own)
KEY_KINDS = {
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "num_experts",
            "n_routed_experts",
            "decoder_sparse_step",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "n_group",
            "topk_group",
        ),
        "a positive integer",
    ),
    **dict.fromkeys(
        ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
        "a non-negative integer",
    ),
    "mlp_only_layers": "a list of non-negative integers",
    "routed_scaling_factor": "a positive number",
    **dict.fromkeys(("norm_topk_prob", "rope_interleave"), "true or false"),
}


def _bad(where: str, key: str, value, supported: str):
    raise UserError(f"{where}: {key}={json.dumps(value)} is not supported (supported: {supported})")


def _need(hf: dict, where: str, mtype: str, *keys: str) -> None:
    for key in keys:
        if hf.get(key) is None:
            raise UserError(f"{where}: {key} is missing (a {mtype} config needs it)")


def fields_from_hf(hf: dict, mtype: str, where: str) -> dict:
    """The ModelConfig fields of a qwen3_moe or deepseek_v3 config.json beyond the common ones."""
    if hf.get("quantization_config") is not None:
        raise UserError(
            f"{where}: quantization_config is set ({short(hf['quantization_config'])}): the"
            " weights are quantized; convert them to bfloat16 first (DeepSeek-V3's FP8 release:"
            " its inference/fp8_cast_bf16.py)"
        )
    return _qwen3_moe(hf, where) if mtype == "qwen3_moe" else _deepseek_v3(hf, where)


def short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _qwen3_moe(hf: dict, where: str) -> dict:
    """Qwen3MoeDecoderLayer: layer i is MoE unless i is in mlp_only_layers, and only where
    (i + 1) % decoder_sparse_step == 0. Brigade's dense layers are the first_dense_layers and, in
    each group of moe_every, all but the last: mlp_only_layers must be the first k layers (or
    none) and the rest must group evenly."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise UserError(f"{where}: num_experts is missing (a qwen3_moe config needs it)")
    _need(hf, where, "qwen3_moe", "num_experts_per_tok", "moe_intermediate_size")
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    only = sorted(set(hf.get("mlp_only_layers") or []))
    first = len(only)
    if only != list(range(first)) or first >= layers or first % step or (layers - first) % step:
        _bad(
            where,
            "mlp_only_layers",
            hf.get("mlp_only_layers"),
            f"the first k layers [0, ..., k-1] (or none), k below num_hidden_layers={layers},"
            f" with k and the {layers} - k layers after them multiples of"
            f" decoder_sparse_step={step}",
        )
    return dict(
        n_experts=experts,
        experts_per_token=hf["num_experts_per_tok"],
        d_ff_expert=hf["moe_intermediate_size"],
        moe_every=step,
        first_dense_layers=first,
        router="softmax",
        router_renorm=bool(hf.get("norm_topk_prob", False)),
        dispatch="dropless",
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        z_loss_coef=0.0,
    )


def _deepseek_v3(hf: dict, where: str) -> dict:
    """DeepseekV3: every layer from first_k_dense_replace on is MoE with shared experts; the router
    is sigmoid + selection bias (e_score_correction_bias, kept as imported: router_bias_rate 0),
    group-limited, renormalised or not, scaled; attention is latent (q_lora_rank null: one query
    projection)."""
    _need(
        hf,
        where,
        "deepseek_v3",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    )
    first = hf.get("first_k_dense_replace", 3)
    if first >= hf["num_hidden_layers"]:
        _bad(where, "first_k_dense_replace", first, "below num_hidden_layers")
    return dict(
        n_experts=hf["n_routed_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        d_ff_expert=hf["moe_intermediate_size"],
        n_shared_experts=hf.get("n_shared_experts", 1),
        moe_every=1,
        first_dense_layers=first,
        router="sigmoid",
        router_bias=True,
        router_bias_rate=0.0,
        router_groups=hf.get("n_group") or 1,
        router_topk_groups=hf.get("topk_group") or 1,
        router_renorm=bool(hf.get("norm_topk_prob", True)),
        router_scale=float(hf.get("routed_scaling_factor", 1.0)),
        dispatch="dropless",
        # DeepSeek-V3's own balance loss is sequence-wise at 1e-4; Brigade's is over the batch
        aux_loss_coef=0.0001,
        z_loss_coef=0.0,
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)),
        mtp_layers=hf.get("num_nextn_predict_layers", 0),
    )


# -- export ---------------------------------------------------------------------------------------
def moe_type_of(cfg) -> str:
    """The HF family of an MoE config: latent attention -> deepseek_v3, q/k norms -> qwen3_moe,
    else mixtral; UserError naming the first field the family cannot express."""
    if cfg.latent_attention:
        mtype, wants = "deepseek_v3", _DEEPSEEK_NEEDS
    elif cfg.qk_norm:
        mtype, wants = "qwen3_moe", _QWEN3_MOE_NEEDS
    else:
        mtype, wants = "mixtral", _MIXTRAL_NEEDS
    if mtype == "deepseek_v3" and not (cfg.router_bias or cfg.router_bias_rate > 0):
        raise UserError(
            "model.router_bias=False has no HuggingFace DeepSeek-V3 equivalent (needs True, or"
            " router_bias_rate > 0: its router always has the selection bias)"
        )
    for field, want in wants:
        have = getattr(cfg, field)
        if not (want(have) if callable(want) else have == want):
            need = getattr(want, "__doc__", None) if callable(want) else want
            raise UserError(
                f"model.{field}={have} has no HuggingFace {_NAMES[mtype]} equivalent (needs {need})"
            )
    return mtype


def _positive(v):
    """> 0"""
    return v > 0


_NAMES = {"deepseek_v3": "DeepSeek-V3", "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral"}
_COMMON = (("qkv_bias", False), ("router_groups", 1), ("router_scale", 1.0), ("mtp_layers", 0))
_DEEPSEEK_NEEDS = (
    ("moe_every", 1),
    ("router", "sigmoid"),
    ("n_shared_experts", _positive),
    ("qkv_bias", False),
    ("sliding_window", 0),
)
_QWEN3_MOE_NEEDS = _COMMON + (
    ("router", "softmax"),
    ("n_shared_experts", 0),
    ("router_bias", False),
    ("router_bias_rate", 0),
)
_MIXTRAL_NEEDS = (
    ("moe_every", 1),
    ("n_shared_experts", 0),
    ("router", "softmax"),
    ("router_bias_rate", 0),
    ("qkv_bias", False),
    ("attn_head_dim", 0),
    ("router_bias", False),
    ("first_dense_layers", 0),
    ("router_renorm", True),
) + _COMMON


def config_keys(cfg, mtype: str) -> dict:
    """The family's config.json keys beyond the common ones models/hf_config.py writes."""
    if mtype == "mixtral":
        return dict(
            intermediate_size=cfg.expert_width,
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.experts_per_token,
            router_aux_loss_coef=cfg.aux_loss_coef,
        )
    common = dict(
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=cfg.expert_width,
        num_experts_per_tok=cfg.experts_per_token,
        norm_topk_prob=cfg.router_renorm,
    )
    if mtype == "qwen3_moe":
        return dict(
            common,
            num_experts=cfg.n_experts,
            decoder_sparse_step=cfg.moe_every,
            mlp_only_layers=list(range(cfg.first_dense_layers)),
            router_aux_loss_coef=cfg.aux_loss_coef,
        )
    return dict(
        common,
        n_routed_experts=cfg.n_experts,
        n_shared_experts=cfg.n_shared_experts,
        first_k_dense_replace=cfg.first_dense_layers,
        n_group=cfg.router_groups,
        topk_group=cfg.router_topk_groups,
        routed_scaling_factor=cfg.router_scale,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
        head_dim=cfg.qk_rope_head_dim,  # transformers' DeepseekV3Config sets it so
        num_key_value_heads=cfg.n_heads,  # every head has its own key and value
        rope_interleave=cfg.rope_interleave,
        num_nextn_predict_layers=cfg.mtp_layers,
        attention_bias=False,
    )
