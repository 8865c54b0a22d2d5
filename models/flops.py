"""Parameter and FLOP counts (PaLM appendix B): 6N + 12*L*H*Q*T FLOPs per trained token, N counting
only the active parameters of a Mixture-of-Experts (the experts_per_token chosen experts); the
biases and norms (q/k/v biases and q/k norms included) are additions, not matmuls."""

from __future__ import annotations

import math

import jax

from models import layer_pattern, model
from models.config import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(model.abstract_params(cfg)))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: in each MoE layer the router picks experts_per_token of the
    n_experts (shared experts and the router always run)."""
    idle = cfg.n_experts - cfg.experts_per_token if cfg.n_experts else 0
    return param_count(cfg) - cfg.n_moe_layers * idle * 3 * cfg.d_model * cfg.expert_width


def matmul_param_count(cfg: ModelConfig) -> int:
    """N of the formula: every active weight that takes part in a matmul. The input embedding is a
    lookup (no FLOPs) unless it is tied to the LM head, which is a matmul; the MoE router bias
    only shifts the expert choice."""
    n = active_param_count(cfg)
    norms_per_layer = 4 if cfg.sandwich_norm else 2  # Gemma 2/3 norm each sublayer's output too
    norms = cfg.d_model * (norms_per_layer * cfg.n_layers + 1) + (
        2 * cfg.n_layers * cfg.head_dim if cfg.qk_norm else 0
    )
    embed = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    bias = cfg.n_moe_layers * cfg.n_experts if cfg.router_bias_rate > 0 else 0
    qkv_bias = (
        cfg.n_layers * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0
    )
    return n - norms - embed - bias - qkv_bias


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, without remat recomputation (the MFU
    convention). Attention: 12 * heads * head_dim * keys per layer (PaLM; causal masking not
    subtracted), keys = seq_len, or the layer's sliding window where it is shorter (each query
    scores at most that many keys; a layer pattern's local layers)."""
    keys = sum(
        min(seq_len, spec.window) if spec.window else seq_len
        for spec in layer_pattern.layer_specs(cfg)
    )
    attn = 12 * cfg.n_heads * cfg.head_dim * keys
    return 6 * matmul_param_count(cfg) + attn
