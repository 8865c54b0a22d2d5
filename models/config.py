"""ModelConfig and PipelineConfig, the `model` and `pipeline` config sections; the named presets
are in models/presets.py, the field helpers (`ranged`, `option`, `check_ranges`) in
models/fields.py."""

from __future__ import annotations

import dataclasses

from errors import UserError
from models import family_fields, gemma_fields
from models.fields import check_ranges, option, ranged
from models.pipeline_config import PipelineConfig as PipelineConfig  # its home before

REMAT_POLICIES = ("none", "full", "dots", "dots_offload")
MATMUL_PRECISIONS = ("default", "fp8")
ATTENTIONS = ("auto", "dense", "blockwise", "cudnn")
# `--model.attention auto` turns to memory-linear attention from this sequence length: below it the
# dense step is as fast or faster on CPU (seq 512 and 1,024 in bf16), from here the dense [T,T]
# scores take 2.3x the memory and more, growing x4 per doubling, and blockwise is the faster of the
# two forward + backward (BENCHMARKS.md, Long context; "The attention's and the MLP's layouts")
BLOCKWISE_FROM = 2048
# --model.loss_chunk 0 (auto): the chunk and the per-device logits size from which the loss is
# chunked
LOSS_CHUNK, LOSS_CHUNK_FROM = 1024, 256 << 20
CONTEXT_STRATEGIES = ("all_gather", "ring")  # --parallelism.context_strategy (models/context.py)
DTYPES = ("auto", "float32", "bfloat16", "float16")
ROUTERS = ("softmax", "sigmoid")
DISPATCHES = ("dropless", "capacity")
KERNELS = ("auto", "ragged", "blocks")
EXCHANGES = ("auto", "fixed", "ragged")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The `model` config section; a preset (`--model`) sets every field, flags and YAML override
    it."""

    vocab_size: int = ranged(
        264,
        ">=1",
        help="token vocabulary (V); the byte-level presets' 264 is 256 bytes +"
        " specials, padded to a multiple of 8 so that it shards on model <= 8",
    )
    d_model: int = ranged(256, ">=1", help="width of the residual stream (D)")
    n_layers: int = ranged(4, ">=1", help="decoder layers (L)")
    n_heads: int = ranged(
        4,
        ">=1",
        help="query heads (N); head_dim = d_model / n_heads (or attn_head_dim), which must be even",
    )
    n_kv_heads: int = ranged(
        2, ">=1", help="key/value heads (K) of grouped-query attention; must divide n_heads"
    )
    d_ff: int = ranged(768, ">=1", help="hidden width of the dense MLP (F)")
    max_seq_len: int = ranged(
        1024, ">=1", help="the longest sequence the model takes; --seq-len must not exceed it"
    )
    rope_theta: float = ranged(10000.0, ">0", help="base of the rotary embedding's wavelengths")
    rope_scaling_factor: float = ranged(
        1.0,
        ">=1",
        help='Llama 3.1 RoPE scaling ("llama3"): long wavelengths'
        " stretched by this factor, short ones kept, a smooth ramp"
        " between; 1 = none",
    )
    rope_low_freq_factor: float = ranged(
        1.0,
        ">0",
        help="RoPE scaling: wavelengths longer than rope_original_max_len / this are stretched",
    )
    rope_high_freq_factor: float = ranged(
        4.0,
        ">0",
        help="RoPE scaling: wavelengths shorter than"
        " rope_original_max_len / this are kept; above"
        " rope_low_freq_factor",
    )
    rope_original_max_len: int = ranged(
        8192, ">=1", help="RoPE scaling: the context length the model was trained at before scaling"
    )
    norm_eps: float = ranged(
        1e-5, ">0", help="RMSNorm epsilon; > 0: an all-zero row would normalise to 0 * inf"
    )
    attn_head_dim: int = ranged(
        0,
        ">=0",
        help="width of each attention head (H) where it is not d_model / n_heads"
        " (Qwen3, Mistral NeMo); 0 = d_model / n_heads",
    )
    qkv_bias: bool = option(
        False, "biases on the query, key and value projections (Qwen2), initialised to zero"
    )
    qk_norm: bool = option(
        False, "RMSNorm of each query and key head before the rotary embedding (Qwen3)"
    )
    sliding_window: int = ranged(
        0,
        ">=0",
        help="attention sees only the last sliding_window positions, the"
        " query's own included (Mistral); 0 = the whole causal prefix",
    )
    tie_embeddings: bool = option(False, "the output projection reuses the input embedding")
    dtype: str = option(
        "auto",
        f"compute dtype: {' | '.join(DTYPES)}; auto = bfloat16 on GPU/TPU, and on a CPU"
        " whose XLA:CPU multiplies bf16 natively (bf16 instructions and a jaxlib that keeps"
        " bf16 matmuls in bf16, detected on the host); float32 on other CPUs",
    )
    param_dtype: str = option(
        "float32", f"dtype of the parameters and optimizer state: {' | '.join(DTYPES[1:])}"
    )
    loss_chunk: int = ranged(
        0,
        ">=0",
        help="tokens per chunk of the LM head + cross-entropy, whose [B,T,V] float32"
        " logits then never exist at once (exact gradients); 0 = auto: chunks of"
        f" {LOSS_CHUNK} tokens where one device's logits would exceed"
        f" {LOSS_CHUNK_FROM >> 20} MiB, else the whole sequence at once",
    )
    remat: str = option(
        "full",
        "what the backward pass recomputes: none | full | dots (save matmul outputs,"
        " recompute the rest) | dots_offload (the same outputs, kept in host memory"
        " between the forward and the backward)",
    )
    matmul_precision: str = option(
        "default",
        "default | fp8: attention projections and MLPs multiply FP8-rounded"
        " operands (e4m3, per-tensor current scaling; e5m2 gradients): FP8"
        " GEMMs on GPUs that have them",
    )
    attention: str = option(
        "auto",
        "auto | dense | blockwise | cudnn: dense = XLA's [T,T] scores; blockwise ="
        " memory-linear flash-style attention in JAX (packed documents by segment ids,"
        " no T x T mask); cudnn = cuDNN flash attention (GPU); auto = on GPU what"
        " jax.nn.dot_product_attention picks (cuDNN where it can), blockwise for packed"
        f" sequences from {BLOCKWISE_FROM} tokens; elsewhere dense below"
        f" {BLOCKWISE_FROM} tokens, blockwise from there",
    )
    scan_layers: bool = option(
        True, "lax.scan over the layer stack: compile time independent of depth"
    )
    init_std: float = ranged(
        0.02, ">0", help="standard deviation of the normal initialisation of embeddings and weights"
    )
    n_experts: int = ranged(
        0, ">=0", help="Mixture-of-Experts: experts per MoE layer (E); 0 = a dense model"
    )
    experts_per_token: int = ranged(
        2, ">=1", help="MoE: experts each token is routed to (top-k); at most n_experts"
    )
    d_ff_expert: int = ranged(
        0, ">=0", help="MoE: width of each expert (and of each shared expert); 0 = d_ff"
    )
    moe_every: int = ranged(
        1, ">=1", help="MoE: every moe_every-th layer is MoE, the rest dense; must divide n_layers"
    )
    n_shared_experts: int = ranged(
        0,
        ">=0",
        help="MoE: always-on experts (DeepSeek), one dense MLP of n_shared_experts * d_ff_expert",
    )
    router: str = option(
        "softmax",
        "MoE router: softmax (Mixtral: top-k of softmax, renormalised) | sigmoid (DeepSeek-V3)",
    )
    dispatch: str = option(
        "dropless",
        "MoE dispatch: dropless | capacity (GShard/Switch slots; overflow skips the layer)",
    )
    capacity_factor: float = ranged(
        1.25,
        ">0",
        help="MoE capacity dispatch: factor * tokens * k / n_experts slots per expert per device",
    )
    dropless_kernel: str = option(
        "auto",
        "MoE dropless grouped matmul: auto | ragged (lax.ragged_dot) | blocks"
        " (padded blocks, empty ones skipped); auto = blocks on CPU, ragged"
        " elsewhere",
    )
    ep_exchange: str = option(
        "auto",
        "MoE dropless tokens over the expert axis: fixed (worst-case all_to_all"
        " buffers) | ragged (ragged_all_to_all, only the real rows; on CPU an"
        " emulation, a test path) | auto (ragged on GPU/TPU, fixed on CPU)",
    )
    aux_loss_coef: float = ranged(
        0.01, ">=0", help="MoE: weight of the Switch load-balancing loss (mean over MoE layers)"
    )
    z_loss_coef: float = ranged(0.001, ">=0", help="MoE: weight of the router z-loss (ST-MoE)")
    router_bias_rate: float = ranged(
        0.0,
        ">=0",
        help="MoE: DeepSeek-V3 aux-loss-free balancing, the bias step per update; 0 = off",
    )

    # -- per-layer attention patterns and the Gemma family's math; ranges, help and the rules
    # between them: models/gemma_fields.py (every default leaves the Llama decoder as it is)
    layer_pattern: str = gemma_fields.FIELDS["layer_pattern"]
    rope_local_theta: float = gemma_fields.FIELDS["rope_local_theta"]
    rope_linear_factor: float = gemma_fields.FIELDS["rope_linear_factor"]
    embed_scale: bool = gemma_fields.FIELDS["embed_scale"]
    norm_plus_one: bool = gemma_fields.FIELDS["norm_plus_one"]
    mlp_activation: str = gemma_fields.FIELDS["mlp_activation"]
    sandwich_norm: bool = gemma_fields.FIELDS["sandwich_norm"]
    attn_softcap: float = gemma_fields.FIELDS["attn_softcap"]
    final_softcap: float = gemma_fields.FIELDS["final_softcap"]
    query_pre_attn_scalar: float = gemma_fields.FIELDS["query_pre_attn_scalar"]
    # -- DeepSeek-V3 / Qwen3-MoE: latent attention, group-limited routing, the dense first layers,
    # multi-token prediction; ranges, help and the rules between them: models/family_fields.py
    kv_lora_rank: int = family_fields.FIELDS["kv_lora_rank"]
    q_lora_rank: int = family_fields.FIELDS["q_lora_rank"]
    qk_nope_head_dim: int = family_fields.FIELDS["qk_nope_head_dim"]
    qk_rope_head_dim: int = family_fields.FIELDS["qk_rope_head_dim"]
    v_head_dim: int = family_fields.FIELDS["v_head_dim"]
    rope_interleave: bool = family_fields.FIELDS["rope_interleave"]
    router_groups: int = family_fields.FIELDS["router_groups"]
    router_topk_groups: int = family_fields.FIELDS["router_topk_groups"]
    router_renorm: bool = family_fields.FIELDS["router_renorm"]
    router_scale: float = family_fields.FIELDS["router_scale"]
    router_bias: bool = family_fields.FIELDS["router_bias"]
    first_dense_layers: int = family_fields.FIELDS["first_dense_layers"]
    mtp_layers: int = family_fields.FIELDS["mtp_layers"]
    mtp_loss_weight: float = family_fields.FIELDS["mtp_loss_weight"]

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        if self.rope_scaling_factor == 1.0:
            return None
        return (
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
        )

    @property
    def expert_width(self) -> int:
        return self.d_ff_expert or self.d_ff

    @property
    def n_group_layers(self) -> int:  # the layers of the repeating groups
        return self.n_layers - self.first_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return self.n_group_layers // self.moe_every if self.n_experts else 0

    @property
    def latent_attention(self) -> bool:  # models/mla.py
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """The query/key width of a latent-attention head: the RoPE-free part, then the rotary."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> ModelConfig:
        """The declared ranges, then the rules between fields; UserError on the first broken one."""
        check_ranges(self, lambda name: f"--model.{name}")

        def need(ok: bool, msg: str):
            if not ok:
                raise UserError(f"model: {msg}")

        need(
            self.attn_head_dim or self.latent_attention or self.d_model % self.n_heads == 0,
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads} (or set"
            " attn_head_dim)",
        )
        need(
            self.rope_high_freq_factor > self.rope_low_freq_factor,
            f"rope_high_freq_factor={self.rope_high_freq_factor}"
            f" must exceed rope_low_freq_factor={self.rope_low_freq_factor}",
        )
        need(
            self.latent_attention or self.head_dim % 2 == 0,
            f"head_dim={self.head_dim} (attn_head_dim, or d_model/n_heads) must be even for"
            " rotary embeddings",
        )
        need(
            self.n_heads % self.n_kv_heads == 0,
            f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            " (grouped-query attention); valid n_kv_heads:"
            f" {[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]}",
        )
        need(
            self.remat in REMAT_POLICIES,
            f"remat '{self.remat}' is not one of {', '.join(REMAT_POLICIES)}",
        )
        need(
            self.matmul_precision in MATMUL_PRECISIONS,
            f"matmul_precision '{self.matmul_precision}' is not one of"
            f" {', '.join(MATMUL_PRECISIONS)}",
        )
        need(
            self.attention in ATTENTIONS,
            f"attention '{self.attention}' is not one of {', '.join(ATTENTIONS)}",
        )
        need(self.dtype in DTYPES, f"dtype '{self.dtype}' is not one of {', '.join(DTYPES)}")
        need(
            self.param_dtype in DTYPES[1:],
            f"param_dtype '{self.param_dtype}' is not one of {', '.join(DTYPES[1:])}",
        )
        if self.n_experts:
            self._validate_moe(need)
        gemma_fields.check(self, need)
        family_fields.check(self, need)
        return self

    def _validate_moe(self, need) -> None:
        e, k = self.n_experts, self.experts_per_token
        need(k <= e, f"experts_per_token={k} must be in [1, n_experts={e}]")
        grouped, first = self.n_group_layers, self.first_dense_layers
        need(
            grouped % self.moe_every == 0,
            f"moe_every={self.moe_every} must divide n_layers={self.n_layers}"
            + (f" less first_dense_layers={first} = {grouped}" if first else "")
            + f"; valid: {[m for m in range(1, grouped + 1) if grouped % m == 0]}",
        )
        need(self.router in ROUTERS, f"router '{self.router}' is not one of {', '.join(ROUTERS)}")
        need(
            self.dispatch in DISPATCHES,
            f"dispatch '{self.dispatch}' is not one of {', '.join(DISPATCHES)}",
        )
        need(
            self.dropless_kernel in KERNELS,
            f"dropless_kernel '{self.dropless_kernel}' is not one of {', '.join(KERNELS)}",
        )
        need(
            self.ep_exchange in EXCHANGES,
            f"ep_exchange '{self.ep_exchange}' is not one of {', '.join(EXCHANGES)}",
        )
        need(
            self.ep_exchange != "ragged" or self.dispatch == "dropless",
            "ep_exchange 'ragged' needs dispatch 'dropless' (capacity buffers are fixed-size);"
            f" got '{self.dispatch}'",
        )

    def attention_kind(self, platform: str, seq_len: int, packed: bool = False) -> str:
        """What attention runs at this sequence length (`packed`: with segment ids): dense,
        blockwise, cudnn, or jax (jax.nn.dot_product_attention's own choice: cuDNN where it supports
        the case)."""
        if self.attention == "cudnn" and platform != "gpu":
            raise UserError(
                f"model: attention 'cudnn' needs an NVIDIA GPU, this backend is {platform};"
                f" valid here: auto, dense, blockwise"
            )
        if self.attention == "cudnn" and self.attn_softcap:
            raise UserError(
                "model: attention 'cudnn' cannot soft-cap scores"
                f" (attn_softcap={self.attn_softcap}); valid with soft-capping: auto, dense,"
                " blockwise"
            )
        if self.attention != "auto":
            return self.attention
        if platform == "gpu":
            kind = "blockwise" if packed and seq_len >= BLOCKWISE_FROM else "jax"
            if self.attn_softcap and kind == "jax":  # no fused kernel soft-caps the scores
                kind = "blockwise" if seq_len >= BLOCKWISE_FROM else "dense"
            return kind
        return "blockwise" if seq_len >= BLOCKWISE_FROM else "dense"

    def compute_dtype(self, platform: str) -> str:
        if self.dtype == "float16" and platform == "cpu":
            raise UserError(
                "model: dtype 'float16' does not run on CPU (XLA:CPU has no float16 matmul"
                " accumulating in float32); valid on CPU: auto, float32, bfloat16"
            )
        return self.compute_dtype_why(platform)[0]

    def compute_dtype_why(self, platform: str) -> tuple[str, str]:
        """(compute dtype, why) on `platform`: the start line says which `auto` picked and why."""
        if self.dtype != "auto":
            return self.dtype, "set"
        if platform == "cpu":
            from models import cpu_dtype  # detection compiles a probe: only when asked

            return cpu_dtype.auto()
        return "bfloat16", "auto: bfloat16 on GPU/TPU"
