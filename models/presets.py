"""The named model presets (`--model NAME`): the test and CPU demo shapes, Llama, Mixtral,
Qwen3-MoE, DeepSeek-V3 and Gemma 3 shapes."""

from __future__ import annotations

import dataclasses

from errors import UserError
from models.config import ModelConfig


def _llama(vocab, d, layers, heads, kv, ff, seq, theta=500000.0) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=ff,
        max_seq_len=seq,
        rope_theta=theta,
        dtype="auto",
    )


PRESETS: dict[str, ModelConfig] = {
    # tests: small enough that a step compiles in about a second on CPU
    "tiny": ModelConfig(
        vocab_size=264, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=256
    ),
    # CPU demo: 3.3M parameters, byte-level vocabulary; activations of this size fit easily, so no
    # remat
    "default": ModelConfig(remat="none"),
    # Llama shapes (https://arxiv.org/abs/2302.13971, Llama 2/3 GQA)
    "125m": _llama(32000, 768, 12, 12, 12, 2048, 2048, theta=10000.0),
    "1b": _llama(128256, 2048, 16, 32, 8, 8192, 4096),
    "7b": _llama(32000, 4096, 32, 32, 32, 11008, 4096, theta=10000.0),
    "70b": _llama(128256, 8192, 80, 64, 8, 28672, 4096),
}


def _moe(base: ModelConfig, **moe) -> ModelConfig:
    return dataclasses.replace(base, **moe)


PRESETS.update(
    {
        # tests: 8 experts of width 64, top-2, on the tiny shape
        "moe-tiny": _moe(PRESETS["tiny"], n_experts=8, experts_per_token=2, d_ff_expert=64),
        # CPU demo: the default shape with 8 experts of width 384, top-2 (active FFN width 768 = the
        # dense default)
        "moe-default": _moe(PRESETS["default"], n_experts=8, experts_per_token=2, d_ff_expert=384),
        # Mixtral 8x7B (https://arxiv.org/abs/2401.04088): 8 experts, top-2, every layer
        "mixtral-8x7b": _moe(
            _llama(32000, 4096, 32, 32, 8, 14336, 32768, theta=1e6),
            n_experts=8,
            experts_per_token=2,
            d_ff_expert=14336,
        ),
        # Qwen3-30B-A3B (the config.json of https://huggingface.co/Qwen/Qwen3-30B-A3B): 128 experts
        # of width 768, top-8 renormalised, no shared expert, every layer MoE; Qwen3's q/k norms and
        # 128-wide heads (32 query, 4 KV). 30.5B parameters, 3.3B active.
        "qwen3-30b-a3b": _moe(
            _llama(151936, 2048, 48, 32, 4, 6144, 40960, theta=1e6),
            attn_head_dim=128,
            qk_norm=True,
            norm_eps=1e-6,
            n_experts=128,
            experts_per_token=8,
            d_ff_expert=768,
            aux_loss_coef=0.001,
            z_loss_coef=0.0,
        ),
        # DeepSeek-V3 (https://arxiv.org/abs/2412.19437, and deepseek-ai/DeepSeek-V3's config.json):
        # multi-head latent attention (KV latent 512 + rotary key 64, query latent 1536, heads of
        # 128 + 64 query/key and 128 value features, interleaved RoPE), the first 3 layers dense,
        # then 256 fine-grained experts, top-8 from the 4 best of 8 groups, weights renormalised x
        # 2.5, 1 shared expert, sigmoid router with aux-loss-free bias balancing; one multi-token
        # prediction module. 671B parameters (+11.6B in the MTP module), 37B active. The context
        # is the pre-training 4K (its YaRN extension to 128K is not modelled).
        "deepseek-v3": _moe(
            _llama(129280, 7168, 61, 128, 128, 18432, 4096, theta=10000.0),
            norm_eps=1e-6,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_interleave=True,
            first_dense_layers=3,
            n_experts=256,
            experts_per_token=8,
            d_ff_expert=2048,
            n_shared_experts=1,
            router="sigmoid",
            router_bias_rate=0.001,
            router_groups=8,
            router_topk_groups=4,
            router_scale=2.5,
            aux_loss_coef=0.0001,
            mtp_layers=1,
        ),
        # tests: the DeepSeek-V3 layout on the tiny shape (latent attention with a query latent, a
        # dense first layer, 8 experts in 4 groups, top-2 of the 2 best groups, a shared expert,
        # one MTP module)
        "deepseek-tiny": _moe(
            PRESETS["tiny"],
            n_layers=3,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_interleave=True,
            first_dense_layers=1,
            n_experts=8,
            experts_per_token=2,
            d_ff_expert=32,
            n_shared_experts=1,
            router="sigmoid",
            router_bias_rate=0.001,
            router_groups=4,
            router_topk_groups=2,
            router_scale=2.5,
            mtp_layers=1,
        ),
    }
)


# Gemma 3's math (models/layer_pattern.py, models/softcap.py): five local layers of a 1,024-token
# window (RoPE base 10k) to one global (1M, positions interpolated x8), q/k norms, sandwich norms,
# RMSNorm by 1 + w, GeGLU, embeddings scaled by sqrt(d_model) and tied to the head
GEMMA3 = dict(
    layer_pattern="LLLLLG",
    sliding_window=1024,
    rope_theta=1e6,
    rope_local_theta=1e4,
    rope_linear_factor=8.0,
    qk_norm=True,
    sandwich_norm=True,
    norm_plus_one=True,
    embed_scale=True,
    mlp_activation="gelu_tanh",
    tie_embeddings=True,
    norm_eps=1e-6,
)


def _gemma3(d, layers, heads, kv, head_dim, ff, query_pre_attn_scalar) -> ModelConfig:
    """A Gemma 3 text model (HF google/gemma-3-*-pt text_config); 262,208 tokens, 128K context."""
    return ModelConfig(
        vocab_size=262208,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        attn_head_dim=head_dim,
        d_ff=ff,
        max_seq_len=131072,
        query_pre_attn_scalar=query_pre_attn_scalar,
        dtype="auto",
        **GEMMA3,
    )


PRESETS.update(
    {
        # tests: the tiny shape with every Gemma option on (Gemma 2's soft-capping and Gemma 3's
        # q/k norms and RoPE alike), a window shorter than the tests' 32 tokens, and 5 layers of an
        # LG pattern: 2 groups and a tail layer
        "gemma-tiny": dataclasses.replace(
            PRESETS["tiny"],
            n_layers=5,
            attn_head_dim=16,
            query_pre_attn_scalar=24.0,
            attn_softcap=5.0,
            final_softcap=30.0,
            **{**GEMMA3, "layer_pattern": "LG", "sliding_window": 8, "rope_linear_factor": 2.0},
        ),
        # Gemma 3 (https://arxiv.org/abs/2503.19786), the text model: 34 layers (5 groups of six
        # and 4 local layers after them), 62 (10 groups and 2)
        "gemma3-4b": _gemma3(2560, 34, 8, 4, 256, 10240, 256.0),
        "gemma3-27b": _gemma3(5376, 62, 32, 16, 128, 21504, 168.0),
    }
)


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise UserError(f"--model: unknown preset '{name}'; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]
