"""Decoder-only Transformer (Llama architecture, optionally Mixture-of-Experts) with stacked,
scannable layer stacks.

Parameters are always stored stacked over layers ([L, ...], logical axis 'layers'); `scan_layers`
only chooses between a `lax.scan` over that stack and an unrolled Python loop over its slices,
so checkpoints do not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mesh.shard import constrain
from models import pipeline as pipeline_lib
from models.attention import Attention, KVCache
from models.config import ModelConfig, PipelineConfig
from models.layer_pattern import LayerSpec, PatternCache
from models.layers import MLP, RMSNorm, param
from models.mla import LatentAttention
from models.moe import MoE
from models.mtp import MTPModule
from models.pieces import ACT_BTD, TAIL_LAYERS, DecoderPieces, n_groups_and_tail


def _norm(cfg: ModelConfig, param_dtype, rngs) -> RMSNorm:
    return RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype, rngs=rngs, plus_one=cfg.norm_plus_one)


def attention(cfg: ModelConfig, dtype, param_dtype, rngs: nnx.Rngs):
    """The layer's attention: latent (models/mla.py) where the config has a KV latent, else
    grouped-query."""
    kind = LatentAttention if cfg.latent_attention else Attention
    return kind(cfg, dtype, param_dtype, rngs=rngs)


class Block(nnx.Module):
    """A decoder layer: pre-norm attention and MLP, each added to the residual stream; with
    `sandwich_norm` (Gemma 2/3) each output normed again before its add."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, param_dtype, rngs)
        self.attn = attention(cfg, dtype, param_dtype, rngs)
        self.mlp_norm = _norm(cfg, param_dtype, rngs)
        self.mlp = MLP(
            cfg.d_model,
            cfg.d_ff,
            dtype,
            param_dtype,
            rngs=rngs,
            fp8_matmuls=cfg.matmul_precision == "fp8",
            activation=cfg.mlp_activation,
        )
        if cfg.sandwich_norm:
            self.post_attn_norm = _norm(cfg, param_dtype, rngs)
            self.post_mlp_norm = _norm(cfg, param_dtype, rngs)

    def __call__(
        self,
        x_BTD,
        positions_BT,
        cache: KVCache | None = None,
        segment_ids_BT=None,
        spec: LayerSpec | None = None,
    ):
        h_BTD, cache = self.attn(self.attn_norm(x_BTD), positions_BT, cache, segment_ids_BT, spec)
        x_BTD = constrain(x_BTD + _post(self, "post_attn_norm", h_BTD), ACT_BTD)
        y_BTD = _post(self, "post_mlp_norm", self.mlp(self.mlp_norm(x_BTD)))
        return constrain(x_BTD + y_BTD, ACT_BTD), cache


def _post(block: nnx.Module, norm: str, y_BTD):
    """`y_BTD` through the block's sandwich norm `norm` where it has one."""
    return getattr(block, norm)(y_BTD) if hasattr(block, norm) else y_BTD


class MoEBlock(nnx.Module):
    """A decoder layer whose feed-forward is a Mixture-of-Experts; also returns the router stats."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, param_dtype, rngs)
        self.attn = attention(cfg, dtype, param_dtype, rngs)
        self.mlp_norm = _norm(cfg, param_dtype, rngs)
        self.moe = MoE(cfg, dtype, param_dtype, rngs=rngs)
        if cfg.sandwich_norm:
            self.post_attn_norm = _norm(cfg, param_dtype, rngs)
            self.post_mlp_norm = _norm(cfg, param_dtype, rngs)

    def __call__(
        self,
        x_BTD,
        positions_BT,
        cache: KVCache | None = None,
        segment_ids_BT=None,
        spec: LayerSpec | None = None,
    ):
        h_BTD, cache = self.attn(self.attn_norm(x_BTD), positions_BT, cache, segment_ids_BT, spec)
        x_BTD = constrain(x_BTD + _post(self, "post_attn_norm", h_BTD), ACT_BTD)
        y_BTD, stats = self.moe(self.mlp_norm(x_BTD))
        return constrain(x_BTD + _post(self, "post_mlp_norm", y_BTD), ACT_BTD), cache, stats


def _stack(cfg: ModelConfig, n: int, cls, dtype, pdt, rngs, axis: str = "layers"):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs):
        return cls(cfg, dtype, pdt, rngs=rngs)

    return make(rngs)


def default_positions(segment_ids_BT: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
    """Positions where the batch has none: 0..T-1, restarting at each segment when packed."""
    return (
        jnp.broadcast_to(jnp.arange(shape[1]), shape)
        if segment_ids_BT is None
        else segment_positions(segment_ids_BT)
    )


def segment_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """Positions restarting at 0 where the segment id changes (packed sequences)."""
    t = segment_ids_BT.shape[1]
    idx_BT = jnp.broadcast_to(jnp.arange(t), segment_ids_BT.shape)
    starts_BT = jnp.concatenate(
        [
            jnp.ones_like(segment_ids_BT[:, :1], bool),
            segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1],
        ],
        axis=1,
    )
    return idx_BT - jax.lax.cummax(jnp.where(starts_BT, idx_BT, 0), axis=1)


class Decoder(nnx.Module):
    """Dense layers live in `blocks` ([L_dense, ...]), MoE layers in `moe_blocks` ([L_moe, ...]).
    The forward pass runs groups of `moe_every` layers (moe_every - 1 dense, then one MoE; a dense
    model: groups of one dense layer), scanning over the groups as MaxText does. The math is
    models/pieces.py's: `pieces` splits the module into the pieces and their params."""

    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.embed_VD = param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "vocab_embed"), pdt, std=cfg.init_std
        )
        tail = n_groups_and_tail(cfg)[1]
        n_dense = cfg.n_group_layers - cfg.n_moe_layers - tail
        if cfg.first_dense_layers:  # run with the embedding: not a pipelined stack
            self.first_blocks = _stack(
                cfg, cfg.first_dense_layers, Block, self.dtype, pdt, rngs, "outer_layers"
            )
        if n_dense:
            self.blocks = _stack(cfg, n_dense, Block, self.dtype, pdt, rngs)
        if cfg.n_moe_layers:
            self.moe_blocks = _stack(cfg, cfg.n_moe_layers, MoEBlock, self.dtype, pdt, rngs)
        if tail:  # the layers past the pattern's last whole repeat (models/layer_pattern.py)
            self.tail_blocks = _stack(cfg, tail, Block, self.dtype, pdt, rngs, TAIL_LAYERS)
        if cfg.mtp_layers:  # the layer type of the last layer, as DeepSeek-V3's MTP modules
            block = MoEBlock if cfg.n_experts else Block
            mtp = functools.partial(MTPModule, block_cls=block)
            self.mtp = _stack(cfg, cfg.mtp_layers, mtp, self.dtype, pdt, rngs, "outer_layers")
        self.final_norm = _norm(cfg, pdt, rngs)
        if not cfg.tie_embeddings:
            self.lm_head_DV = param(
                rngs, (cfg.d_model, cfg.vocab_size), ("vocab_embed", "vocab"), pdt, std=cfg.init_std
            )

    def pieces(self, token_loss=None) -> tuple[DecoderPieces, dict, tuple]:
        """-> (the pieces, outer params, stack params [G, ...]) (models/pieces.py); `token_loss`:
        the head's custom per-token loss (DecoderPieces)."""
        cfg = self.cfg
        pieces = DecoderPieces(cfg, self.dtype, None, None, None, token_loss)
        n_groups, tail = n_groups_and_tail(cfg)
        dense_gdef, dense = nnx.split(self.blocks) if pieces.n_dense else (None, None)
        moe_gdef, moe = nnx.split(self.moe_blocks) if cfg.n_experts else (None, None)
        tail_gdef, tail_params = nnx.split(self.tail_blocks) if tail else (None, None)
        if pieces.n_dense:
            dense = jax.tree.map(lambda a: a.reshape(n_groups, pieces.n_dense, *a.shape[1:]), dense)
        norm_gdef, norm = nnx.split(self.final_norm)
        pieces = dataclasses.replace(
            pieces, dense_gdef=dense_gdef, moe_gdef=moe_gdef, norm_gdef=norm_gdef
        )
        if tail:
            pieces = dataclasses.replace(pieces, tail_gdef=tail_gdef)
        outer = {
            "embed_VD": self.embed_VD[...],
            "norm": norm,
            "head_DV": None if cfg.tie_embeddings else self.lm_head_DV[...],
        }
        if tail:  # runs after the groups, with the head (under a pipeline: on the last stage)
            outer["tail"] = tail_params
        # the stacks outside the groups: their graph merges with one layer's slice of the state
        for name, attr in (("first", "first_blocks"), ("mtp", "mtp")):
            if hasattr(self, attr):
                gdef, outer[name] = nnx.split(getattr(self, attr))
                pieces = dataclasses.replace(pieces, **{f"{name}_gdef": gdef})
        return pieces, outer, (dense, moe)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        cache: KVCache | None = None,
        segment_ids_BT: jax.Array | None = None,
        *,
        pipeline: PipelineConfig | None = None,
    ):
        """tokens [B,T] int32 -> (logits [B,T,V] float32, cache, MoE stats stacked [L_moe, ...]).
        `cache` holds [L,...] stacked KVCaches (with a layer pattern: a PatternCache);
        `segment_ids_BT` restricts attention to each segment. On a mesh with pipeline > 1 the
        training forward (no cache) runs the layer groups through models/pipeline with
        `pipeline`'s schedule (default: PipelineConfig()). The train objective is made of the same
        pieces elsewhere (models/model.py `objective`)."""
        pieces, outer, stack = self.pieces()
        if positions_BT is None:
            positions_BT = default_positions(segment_ids_BT, tokens_BT.shape)
        if cache is None:
            x_BTD = pieces.embed(outer, tokens_BT, positions_BT, segment_ids_BT)
            x_BTD, stats = pipeline_lib.stack_forward(
                pieces, stack, x_BTD, positions_BT, segment_ids_BT, pipeline=pipeline
            )
            x_BTD, _ = pieces.tail(outer, x_BTD, positions_BT, segment_ids_BT)
        elif isinstance(cache, PatternCache):
            x_BTD = pieces.embed_tokens(outer, tokens_BT)
            x_BTD, stats, groups = pieces.decode(
                outer, stack, x_BTD, positions_BT, cache.groups, segment_ids_BT
            )
            x_BTD, tail = pieces.tail(outer, x_BTD, positions_BT, segment_ids_BT, cache.tail)
            cache = PatternCache(groups, tail)
        else:
            x_BTD = pieces.embed_tokens(outer, tokens_BT)
            x_BTD, stats, cache = pieces.decode(
                outer, stack, x_BTD, positions_BT, cache, segment_ids_BT
            )
        x_BTD, head_DV = pieces.final(outer, x_BTD)
        return pieces.logits(x_BTD, head_DV), cache, stats
