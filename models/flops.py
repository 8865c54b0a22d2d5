"""Parameter and FLOP counts (PaLM appendix B): 6N + 12*L*H*Q*T FLOPs per trained token, N counting
only the active parameters of a Mixture-of-Experts (the experts_per_token chosen experts); the
biases and norms (q/k/v biases, q/k norms and the latent norms included) are additions, not
matmuls. The counts read the model's parameter tree, so a new part's weights count as they are."""

from __future__ import annotations

import math

import jax

from mesh.shard import path_names
from models import layer_pattern, model
from models.config import ModelConfig

# parameters that take part in no matmul: norm scales (any path with a norm module) and biases
_ADDED = ("router_bias_E", "bq_NH", "bk_KH", "bv_KH")


def _sizes(cfg: ModelConfig) -> dict[str, int]:
    """{'/'-path: element count} of every parameter."""
    leaves = path_names(model.abstract_params(cfg), is_leaf=lambda x: hasattr(x, "shape"))
    return {name: math.prod(sd.shape) for name, sd in leaves}


def param_count(cfg: ModelConfig) -> int:
    return sum(x.size for x in jax.tree.leaves(model.abstract_params(cfg)))


def mtp_param_count(cfg: ModelConfig) -> int:
    """The multi-token prediction modules' own parameters (they share the embedding and head)."""
    return sum(n for name, n in _sizes(cfg).items() if name.startswith("mtp/"))


def _idle_experts(cfg: ModelConfig, moe_layers: int) -> int:
    """Expert weights a token does not use in `moe_layers` MoE layers: n_experts - experts_per_token
    of each layer's experts."""
    idle = cfg.n_experts - cfg.experts_per_token if cfg.n_experts else 0
    return moe_layers * idle * 3 * cfg.d_model * cfg.expert_width


def _mtp_on(cfg: ModelConfig) -> bool:
    return bool(cfg.mtp_layers) and cfg.mtp_loss_weight > 0


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses when generating: in each MoE layer the router picks
    experts_per_token of the n_experts (shared experts and the router always run); the
    multi-token prediction modules, a training objective, are not counted."""
    return param_count(cfg) - mtp_param_count(cfg) - _idle_experts(cfg, cfg.n_moe_layers)


def matmul_param_count(cfg: ModelConfig) -> int:
    """N of the formula: every active weight a trained token multiplies. The input embedding is a
    lookup (no FLOPs) unless it is tied to the LM head, which is a matmul; norms and biases (the MoE
    router bias only shifts the expert choice) are additions. The multi-token prediction modules
    count where their loss is on: their active weights, and the LM head once more per module."""
    n = 0
    for name, size in _sizes(cfg).items():
        parts = name.split("/")
        if any("norm" in p for p in parts) or parts[-1] in _ADDED:
            continue
        if name == "embed_VD" and not cfg.tie_embeddings:
            continue
        if parts[0] == "mtp" and not _mtp_on(cfg):
            continue
        n += size
    mtp_moe = cfg.mtp_layers if cfg.n_experts and _mtp_on(cfg) else 0
    head = cfg.mtp_layers * cfg.vocab_size * cfg.d_model if _mtp_on(cfg) else 0
    return n - _idle_experts(cfg, cfg.n_moe_layers + mtp_moe) + head


def attention_flops_fwd(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the attention scores and their weighted sum: 2 x heads x
    (query/key width + value width) x keys per layer (PaLM's 4 x H x Q x T where the widths are
    equal; latent attention's differ), keys = seq_len, or the layer's sliding window where it is
    shorter (each query scores at most that many keys; a layer pattern's local layers); the
    multi-token prediction modules' layers too where their loss is on."""

    def keys(window: int) -> int:
        return min(seq_len, window) if window else seq_len

    layer_keys = sum(keys(spec.window) for spec in layer_pattern.layer_specs(cfg))
    if _mtp_on(cfg):
        layer_keys += cfg.mtp_layers * keys(cfg.sliding_window)
    widths = cfg.qk_head_dim + cfg.v_head_dim if cfg.latent_attention else 2 * cfg.head_dim
    return 2 * cfg.n_heads * widths * layer_keys


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, without remat recomputation (the MFU
    convention): 6N plus three times the attention's forward (PaLM; causal masking not
    subtracted)."""
    return 6 * matmul_param_count(cfg) + 3 * attention_flops_fwd(cfg, seq_len)
