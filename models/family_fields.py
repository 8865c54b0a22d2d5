"""The ModelConfig fields of latent attention, group-limited routing, the dense first layers and
multi-token prediction (DeepSeek-V3, Qwen3-MoE): their ranges and help, and the rules between them
that ModelConfig.validate checks. Plain Python, imported while flags are parsed."""

from __future__ import annotations

from collections.abc import Callable

from models.fields import option, ranged

# the fields, as models/config.py's ModelConfig declares them (one Field object each)
FIELDS = {
    "kv_lora_rank": ranged(
        0,
        ">=0",
        help="multi-head latent attention (DeepSeek-V2/V3) when > 0: keys and values come from a"
        " compressed latent of this width (C), which is all the KV cache holds besides the shared"
        " rotary key; 0 = grouped-query attention",
    ),
    "q_lora_rank": ranged(
        0,
        ">=0",
        help="latent attention: queries through a compressed latent of this width (DeepSeek-V3:"
        " 1536); 0 = one query projection",
    ),
    "qk_nope_head_dim": ranged(
        128, ">=1", help="latent attention: the per-head query/key features without RoPE"
    ),
    "qk_rope_head_dim": ranged(
        64,
        ">=2",
        help="latent attention: the per-head query features with RoPE, and the rotary key all"
        " heads share; must be even",
    ),
    "v_head_dim": ranged(128, ">=1", help="latent attention: the per-head value width"),
    "rope_interleave": option(
        False,
        "latent attention: the rotary features come in interleaved pairs (x0, x1), (x2, x3) ..."
        " (DeepSeek's checkpoints); false: split halves (i, i + H/2)",
    ),
    "router_groups": ranged(
        1,
        ">=1",
        help="MoE: group-limited routing (DeepSeek-V3: 8): the experts split into this many groups,"
        " each scored by the sum of its two best experts; must divide n_experts",
    ),
    "router_topk_groups": ranged(
        1,
        ">=1",
        help="MoE: group-limited routing: a token's experts come from its this many best groups",
    ),
    "router_renorm": option(
        True,
        "MoE: the chosen experts' weights renormalised to sum to 1 (HF's norm_topk_prob; Mixtral,"
        " DeepSeek-V3, Qwen3-30B-A3B); false: the router's probabilities as they are",
    ),
    "router_scale": ranged(
        1.0, ">0", help="MoE: the routed experts' weights times this (DeepSeek-V3: 2.5)"
    ),
    "router_bias": option(
        False,
        "MoE: the router has the aux-loss-free selection bias (DeepSeek-V3) even where"
        " router_bias_rate is 0 (then it stays as imported)",
    ),
    "first_dense_layers": ranged(
        0,
        ">=0",
        help="MoE: the first this many layers are dense (DeepSeek-V3: 3), the rest grouped by"
        " moe_every; they run with the embedding, outside the pipelined layer groups",
    ),
    "mtp_layers": ranged(
        0,
        ">=0",
        help="multi-token prediction (DeepSeek-V3: 1): modules that each predict one token further"
        " ahead during training; never run when generating",
    ),
    "mtp_loss_weight": ranged(
        0.3,
        ">=0",
        help="multi-token prediction: weight of the mean of the modules' cross-entropies"
        " (DeepSeek-V3: 0.3, then 0.1); in the gradient, not in the loss reported; 0 = off",
    ),
}


def check(cfg, need: Callable[[bool, str], None]) -> None:
    """`need(ok, message)` for each rule; the first broken one raises."""
    need(
        cfg.qk_rope_head_dim % 2 == 0,
        f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for rotary embeddings",
    )
    need(
        not cfg.q_lora_rank or cfg.latent_attention,
        f"q_lora_rank={cfg.q_lora_rank} needs latent attention (kv_lora_rank > 0)",
    )
    need(
        not cfg.latent_attention or not (cfg.qkv_bias or cfg.qk_norm),
        "latent attention (kv_lora_rank > 0) has no qkv_bias or qk_norm; set them false",
    )
    need(
        not cfg.first_dense_layers or cfg.n_experts,
        f"first_dense_layers={cfg.first_dense_layers} needs an MoE model (n_experts > 0)",
    )
    if cfg.n_experts:
        _check_routing(cfg, need)


def _check_routing(cfg, need) -> None:
    """The dense first layers leave a layer to group, and group-limited routing has whole groups
    of at least two experts (each group is scored by its two best), enough of them chosen to hold
    experts_per_token."""
    need(
        cfg.first_dense_layers < cfg.n_layers,
        f"first_dense_layers={cfg.first_dense_layers} must be below n_layers={cfg.n_layers}",
    )
    e, g, top = cfg.n_experts, cfg.router_groups, cfg.router_topk_groups
    need(
        e % g == 0 and (g == 1 or e // g >= 2),
        f"router_groups={g} must divide n_experts={e} into groups of at least 2; valid:"
        f" {[d for d in range(1, e + 1) if e % d == 0 and (d == 1 or e // d >= 2)]}",
    )
    need(
        top <= g and top * (e // g) >= cfg.experts_per_token,
        f"router_topk_groups={top} must be in [1, router_groups={g}] and its groups must hold"
        f" experts_per_token={cfg.experts_per_token} experts ({e // g} per group)",
    )
