"""The ModelConfig fields of per-layer attention patterns and the Gemma family's math (Gemma 1/2/3):
their ranges and help, and the rules between them that ModelConfig.validate checks. Plain Python,
imported while flags are parsed; the pattern's own rules are models/layer_pattern.py's."""

from __future__ import annotations

from collections.abc import Callable

from models import layer_pattern
from models.fields import option, ranged

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")  # --model.mlp_activation (models/layers.py MLP)

# the fields, as models/config.py's ModelConfig declares them (one Field object each)
FIELDS = {
    "layer_pattern": option(
        "",
        "attention per layer, a pattern repeated over the layers: L = local (sliding_window"
        " keys, RoPE base rope_local_theta), G = global (the whole causal prefix, rope_theta"
        " and its scaling); e.g. LG (Gemma 2), LLLLLG (Gemma 3); the pattern is the repeating"
        " layer group (scanned, pipelined), layers past its last whole repeat run after the"
        " stack; empty = every layer alike (sliding_window, if set, on all)",
    ),
    "rope_local_theta": ranged(
        0.0, ">=0", help="RoPE base of the local (L) layers of layer_pattern; 0 = rope_theta"
    ),
    "rope_linear_factor": ranged(
        1.0,
        ">=1",
        help="linear RoPE scaling of the global layers (HF rope_type linear): positions divided"
        " by this factor (Gemma 3 4B and up: 8); 1 = none",
    ),
    "embed_scale": option(False, "embeddings multiplied by sqrt(d_model) (Gemma)"),
    "norm_plus_one": option(
        False, "every RMSNorm scales by 1 + w, w stored and initialised to 0 (Gemma)"
    ),
    "mlp_activation": option(
        "silu",
        "the gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU with the tanh"
        " approximation: Gemma) | gelu (GeGLU, exact)",
    ),
    "sandwich_norm": option(
        False,
        "an RMSNorm after attention and after the MLP too, before each residual add (Gemma 2/3)",
    ),
    "attn_softcap": ranged(
        0.0, ">=0", help="attention scores soft-capped to c * tanh(s / c) (Gemma 2); 0 = none"
    ),
    "final_softcap": ranged(
        0.0, ">=0", help="logits soft-capped to c * tanh(logits / c) (Gemma 2); 0 = none"
    ),
    "query_pre_attn_scalar": ranged(
        0.0,
        ">=0",
        help="attention scores scaled by query_pre_attn_scalar ** -0.5 instead of"
        " head_dim ** -0.5 (Gemma 2/3); 0 = head_dim",
    ),
}


def check(cfg, need: Callable[[bool, str], None]) -> None:
    """The rules between the fields (need(ok, message) raises the section's one-line error)."""
    need(
        cfg.mlp_activation in ACTIVATIONS,
        f"mlp_activation '{cfg.mlp_activation}' is not one of {', '.join(ACTIVATIONS)}",
    )
    layer_pattern.validate(cfg, need)
    # no family has both; the decoder's layer stacks outside the groups are one or the other
    for field in ("first_dense_layers", "mtp_layers", "kv_lora_rank"):
        need(
            not (cfg.layer_pattern and getattr(cfg, field)),
            f"layer_pattern '{cfg.layer_pattern}' with {field}={getattr(cfg, field)}: a layer"
            " pattern runs with neither dense first layers, MTP modules nor latent attention;"
            f" set one of them empty/0",
        )
