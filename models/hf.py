"""HuggingFace Llama, Mistral, Mixtral, Qwen2/2.5, Qwen3 and Gemma 1/2/3 <-> Brigade: the family
tables, and the model object (`Model`: a ModelConfig and its params).

The conversion is a table per architecture (`ROWS`): each row names a Brigade parameter (its '/'
path in the params dict), the HF tensor it comes from (a name template over layer `{l}`, and
expert `{e}` for MoE layers) and the layout change between the two. A template's placeholders
are the leading stacked dims of the Brigade array, in order ([L, ...] or [L, E, ...]), so adding
an architecture is adding rows (and its config.json mapping: models/hf_config.py).
checkpoint/hf_files.py applies the rows to the tensors (`params_from_hf`/`hf_tensors`) and
checkpoint/hf.py has the CLI (`python -m checkpoint hf`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from errors import UserError
from models import hf_config
from models.config import ModelConfig


# -- layouts ------------------------------------------------------------------------------------
# HF nn.Linear stores weight [out, in]; Brigade stores [in, out] and keeps heads as their own dim.
# Head h's features are rows h*H..(h+1)*H-1 of q/k/v_proj (columns of o_proj), and HF's rotary
# embedding pairs feature i with i + H/2 (rotate_half), which is Brigade's split-halves layout, so
# no permutation is needed. GQA: query head n reads kv head n // (N/K) in both.
class Layout(NamedTuple):
    to_brigade: Callable[[np.ndarray, int], np.ndarray]  # (hf tensor, head_dim) -> Brigade slice
    to_hf: Callable[[np.ndarray, int], np.ndarray]  # (Brigade slice, head_dim) -> hf tensor


LAYOUTS = {
    "same": Layout(lambda w, h: w, lambda w, h: w),
    "T": Layout(lambda w, h: w.T, lambda w, h: w.T),  # [out,in] <-> [in,out]
    "in_heads": Layout(
        lambda w, h: w.T.reshape(w.shape[1], -1, h),  # [N*H,D] <-> [D,N,H]
        lambda w, h: w.reshape(w.shape[0], -1).T,
    ),
    "out_heads": Layout(
        lambda w, h: w.T.reshape(-1, h, w.shape[0]),  # [D,N*H] <-> [N,H,D]
        lambda w, h: w.reshape(-1, w.shape[-1]).T,
    ),
    "heads": Layout(lambda w, h: w.reshape(-1, h), lambda w, h: w.reshape(-1)),  # [N*H] <-> [N,H]
}


class Row(NamedTuple):
    """One parameter's conversion. A row applies to a config whose model has its Brigade parameter
    (the latent and the plain query projection, say, are rows of one table)."""

    brigade: str  # '/' path in the params dict
    hf: str  # tensor name; {l} = layer, {e} = expert: the leading stacked dims, in order
    layout: str  # key of LAYOUTS
    # the head width the layout reshapes by, from the config (None: ModelConfig.head_dim)
    dim: Callable[[ModelConfig], int] | None = None
    first_layer: int = 0  # the HF layer number {l} of a tail stack's index 0


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
    Row("lm_head_DV", "lm_head.weight", "T"),  # absent with tie_word_embeddings
)
LLAMA_ROWS = (
    _OUTER
    + _attention_rows("blocks")
    + (
        Row("blocks/mlp/w_gate_DF", _LAYER + "mlp.gate_proj.weight", "T"),
        Row("blocks/mlp/w_up_DF", _LAYER + "mlp.up_proj.weight", "T"),
        Row("blocks/mlp/w_down_FD", _LAYER + "mlp.down_proj.weight", "T"),
    )
)
# Every Mixtral layer is MoE: Brigade's `moe_blocks` stack ([L, ...]; experts [L, E, ...]). HF
# Mixtral's router is softmax -> top-k -> renormalise, Brigade's `router=softmax`.
_MOE = _LAYER + "block_sparse_moe."
MIXTRAL_ROWS = (
    _OUTER
    + _attention_rows("moe_blocks")
    + (
        Row("moe_blocks/moe/router_DE", _MOE + "gate.weight", "T"),
        Row("moe_blocks/moe/w_gate_EDF", _MOE + "experts.{e}.w1.weight", "T"),
        Row("moe_blocks/moe/w_up_EDF", _MOE + "experts.{e}.w3.weight", "T"),
        Row("moe_blocks/moe/w_down_EFD", _MOE + "experts.{e}.w2.weight", "T"),
    )
)

# Qwen2/2.5: Llama with biases on q/k/v (not o); Qwen3: Llama with an RMSNorm over each q and k head
# before RoPE (one [H] scale each), no biases; Mistral: Llama with a sliding window (no tensors).
_ATTN = _LAYER + "self_attn."
QWEN2_ROWS = LLAMA_ROWS + (
    Row("blocks/attn/bq_NH", _ATTN + "q_proj.bias", "heads"),
    Row("blocks/attn/bk_KH", _ATTN + "k_proj.bias", "heads"),
    Row("blocks/attn/bv_KH", _ATTN + "v_proj.bias", "heads"),
)
QWEN3_ROWS = LLAMA_ROWS + (
    Row("blocks/attn/q_norm/scale", _ATTN + "q_norm.weight", "same"),
    Row("blocks/attn/k_norm/scale", _ATTN + "k_norm.weight", "same"),
)
# Gemma: Llama's tensors (its RMSNorm's 1 + w is model.norm_plus_one: w is stored as HF stores it).
# Gemma 2/3 norm each sublayer's output too (sandwich): HF's post_attention_layernorm is the norm
# after attention, not before the MLP (that is pre_feedforward_layernorm). Gemma 3 adds the q/k
# norms of Qwen3.
GEMMA2_ROWS = _OUTER + (
    Row("blocks/attn_norm/scale", _LAYER + "input_layernorm.weight", "same"),
    Row("blocks/attn/wq_DNH", _ATTN + "q_proj.weight", "in_heads"),
    Row("blocks/attn/wk_DKH", _ATTN + "k_proj.weight", "in_heads"),
    Row("blocks/attn/wv_DKH", _ATTN + "v_proj.weight", "in_heads"),
    Row("blocks/attn/wo_NHD", _ATTN + "o_proj.weight", "out_heads"),
    Row("blocks/post_attn_norm/scale", _LAYER + "post_attention_layernorm.weight", "same"),
    Row("blocks/mlp_norm/scale", _LAYER + "pre_feedforward_layernorm.weight", "same"),
    Row("blocks/mlp/w_gate_DF", _LAYER + "mlp.gate_proj.weight", "T"),
    Row("blocks/mlp/w_up_DF", _LAYER + "mlp.up_proj.weight", "T"),
    Row("blocks/mlp/w_down_FD", _LAYER + "mlp.down_proj.weight", "T"),
    Row("blocks/post_mlp_norm/scale", _LAYER + "post_feedforward_layernorm.weight", "same"),
)
GEMMA3_ROWS = GEMMA2_ROWS + QWEN3_ROWS[len(LLAMA_ROWS) :]


_SWIGLU = (("gate_DF", "gate"), ("up_DF", "up"), ("down_FD", "down"))


def _mlp_rows(stack: str) -> tuple[Row, ...]:
    return tuple(
        Row(f"{stack}/mlp/w_{ours}", _LAYER + f"mlp.{theirs}_proj.weight", "T")
        for ours, theirs in _SWIGLU
    )


def _expert_rows(stack: str) -> tuple[Row, ...]:
    """An MoE layer's router and experts as Qwen2/3-MoE and DeepSeek-V3 name them, and DeepSeek-V3's
    selection bias and shared experts (rows that apply where the model has them)."""
    moe = f"{stack}/moe/"
    return (
        (
            Row(moe + "router_DE", _LAYER + "mlp.gate.weight", "T"),
            Row(moe + "router_bias_E", _LAYER + "mlp.gate.e_score_correction_bias", "same"),
        )
        + tuple(
            Row(moe + ours, _LAYER + f"mlp.experts.{{e}}.{theirs}_proj.weight", "T")
            for ours, theirs in (("w_gate_EDF", "gate"), ("w_up_EDF", "up"), ("w_down_EFD", "down"))
        )
        + tuple(
            Row(moe + f"shared/w_{ours}", _LAYER + f"mlp.shared_experts.{theirs}_proj.weight", "T")
            for ours, theirs in _SWIGLU
        )
    )


# Qwen3-MoE: Qwen3's attention in every layer; dense layers (the first_dense_layers, and all but
# the last of each moe_every group) with an MLP, the others MoE. The router is softmax, top-k,
# renormalised or not (norm_topk_prob).
_QWEN3_NORMS = (
    Row("{stack}/attn/q_norm/scale", _ATTN + "q_norm.weight", "same"),
    Row("{stack}/attn/k_norm/scale", _ATTN + "k_norm.weight", "same"),
)


def _qwen3_attention(stack: str) -> tuple[Row, ...]:
    norms = tuple(r._replace(brigade=r.brigade.format(stack=stack)) for r in _QWEN3_NORMS)
    return _attention_rows(stack) + norms


QWEN3_MOE_ROWS = (
    _OUTER
    + _qwen3_attention("first_blocks")
    + _mlp_rows("first_blocks")
    + _qwen3_attention("blocks")
    + _mlp_rows("blocks")
    + _qwen3_attention("moe_blocks")
    + _expert_rows("moe_blocks")
)


# DeepSeek-V3: latent attention (models/mla.py). q_proj (no query latent) or q_a_proj, its norm and
# q_b_proj; kv_a_proj_with_mqa holds the KV latent then the rotary key; kv_b_proj each head's
# RoPE-free key features then its value, as the heads' rows [N*(G+W), C]; o_proj the values'
# columns [D, N*W].
def _qk_width(cfg: ModelConfig) -> int:
    return cfg.qk_head_dim


def _kv_width(cfg: ModelConfig) -> int:
    return cfg.qk_nope_head_dim + cfg.v_head_dim


def _v_width(cfg: ModelConfig) -> int:
    return cfg.v_head_dim


def _mla_rows(stack: str) -> tuple[Row, ...]:
    a = f"{stack}/attn/"
    return (
        Row(f"{stack}/attn_norm/scale", _LAYER + "input_layernorm.weight", "same"),
        Row(a + "wq_DNH", _ATTN + "q_proj.weight", "in_heads", _qk_width),
        Row(a + "wq_a_DQ", _ATTN + "q_a_proj.weight", "T"),
        Row(a + "q_norm/scale", _ATTN + "q_a_layernorm.weight", "same"),
        Row(a + "wq_b_QNH", _ATTN + "q_b_proj.weight", "in_heads", _qk_width),
        Row(a + "wkv_a_DC", _ATTN + "kv_a_proj_with_mqa.weight", "T"),
        Row(a + "kv_norm/scale", _ATTN + "kv_a_layernorm.weight", "same"),
        Row(a + "wkv_b_CNH", _ATTN + "kv_b_proj.weight", "in_heads", _kv_width),
        Row(a + "wo_NWD", _ATTN + "o_proj.weight", "out_heads", _v_width),
        Row(f"{stack}/mlp_norm/scale", _LAYER + "post_attention_layernorm.weight", "same"),
    )


# Multi-token prediction modules (models/mtp.py) are the layers after the last, as DeepSeek-V3's
# checkpoints hold them: a decoder layer plus enorm, hnorm, eh_proj ([D, 2D]: the embedding's
# columns first) and shared_head.norm; their embed_tokens and shared_head.head repeat the model's
# (shared_copies).
DEEPSEEK_V3_ROWS = (
    _OUTER
    + _mla_rows("first_blocks")
    + _mlp_rows("first_blocks")
    + _mla_rows("moe_blocks")
    + _expert_rows("moe_blocks")
    + _mla_rows("mtp/block")
    + _expert_rows("mtp/block")
    + (
        Row("mtp/enorm/scale", _LAYER + "enorm.weight", "same"),
        Row("mtp/hnorm/scale", _LAYER + "hnorm.weight", "same"),
        Row("mtp/w_eh_ED", _LAYER + "eh_proj.weight", "T"),
        Row("mtp/norm/scale", _LAYER + "shared_head.norm.weight", "same"),
    )
)
ROWS = {
    "llama": LLAMA_ROWS,
    "mistral": LLAMA_ROWS,
    "mixtral": MIXTRAL_ROWS,
    "qwen2": QWEN2_ROWS,
    "qwen3": QWEN3_ROWS,
    "gemma": LLAMA_ROWS,
    "gemma2": GEMMA2_ROWS,
    "gemma3_text": GEMMA3_ROWS,
    "qwen3_moe": QWEN3_MOE_ROWS,
    "deepseek_v3": DEEPSEEK_V3_ROWS,
}


IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# -- the model object ---------------------------------------------------------------------------
def check_params(cfg: ModelConfig, params: dict, source: str = "params") -> None:
    """UserError naming the first array whose path or shape differs from what `cfg` implies: the
    layouts reshape by the config's head counts, so a config that does not describe its arrays
    (n_heads 4 read as 2) would convert without complaint into a silently wrong model."""
    from mesh.shard import path_names

    want = expected_shapes(cfg)
    have = {n: tuple(a.shape) for n, a in path_names(params, is_leaf=lambda x: hasattr(x, "shape"))}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            found = f"shape {have[name]}" if name in have else "no such array"
            implied = f"shape {want[name]}" if name in want else "no such array"
            fields = ", ".join(f"{f}={getattr(cfg, f)}" for f in _SHAPE_FIELDS)
            raise UserError(
                f"{source}: params/{name} has {found}, but its model config ({fields})"
                f" implies {implied}; the config does not describe these arrays"
            )


_SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "attn_head_dim",
    "d_ff",
    "n_experts",
    "d_ff_expert",
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "sandwich_norm",
    "layer_pattern",
    "moe_every",
    "first_dense_layers",
    "kv_lora_rank",
    "q_lora_rank",
    "mtp_layers",
)


class Model:
    """A ModelConfig and its params: `model(tokens_BT)` -> logits [B,T,V] float32."""

    def __init__(self, cfg: ModelConfig, params: dict, source: str = "params"):
        check_params(cfg, params, source)
        self.cfg, self.params = cfg, params

    @property
    def model_type(self) -> str:
        return hf_config.model_type_of(self.cfg)

    @functools.cached_property
    def _forward(self):
        import jax

        from models import model as model_lib

        return jax.jit(lambda params, tokens_BT: model_lib.apply(self.cfg, params, tokens_BT)[0])

    def __call__(self, tokens_BT):  # -> jax.Array [B,T,V]
        import jax.numpy as jnp

        return self._forward(self.params, jnp.asarray(tokens_BT, jnp.int32))

    def generate(
        self, prompt_BT, max_new: int, *, temperature: float = 0.0, top_k: int = 0, seed: int = 0
    ):
        """prompt [B,T0] int32 -> [B, max_new] new tokens (greedy by default), with a KV cache."""
        import jax
        import jax.numpy as jnp

        from models.sample import generate

        return generate(
            self.cfg,
            self.params,
            jnp.asarray(prompt_BT, jnp.int32),
            jax.random.key(seed),
            max_new=max_new,
            temperature=temperature,
            top_k=top_k,
        )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from mesh.shard import path_names
    from models import model as model_lib

    abstract = model_lib.abstract_params(cfg)
    return {
        n: tuple(s.shape) for n, s in path_names(abstract, is_leaf=lambda x: hasattr(x, "shape"))
    }


# -- deprecated for one release: the names and the command that moved out (hf_moved.py)
def __getattr__(name: str):
    """`models.hf.from_pretrained` & co. still import, with a DeprecationWarning naming their new
    home (models/hf_moved.py); any other unknown name is an AttributeError as usual."""
    from models.hf_moved import moved

    return moved(name)


if __name__ == "__main__":  # `python -m models.hf import|export ...`: now python -m checkpoint hf
    import sys

    from models.hf_moved import moved_command

    sys.exit(moved_command(sys.argv[1:]))
