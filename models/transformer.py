"""Decoder-only Transformer (Llama architecture, optionally Mixture-of-Experts) with stacked,
scannable layer stacks.

Parameters are always stored stacked over layers ([L, ...], logical axis 'layers'); `scan_layers`
only chooses between a `lax.scan` over that stack and an unrolled Python loop over its slices,
so checkpoints do not depend on it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mesh.rules import current_rules
from mesh.shard import constrain
from models import pipeline as pipeline_lib
from models.attention import Attention, KVCache
from models.config import ModelConfig
from models.layers import MLP, RMSNorm, head_logits, param
from models.moe import MoE

# the residual stream between blocks: its sequence dim is also split over `model` with sequence parallelism
ACT_BTD = ("batch", "res_seq", "act_embed")

REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # save projection outputs (dots without batch dims); recompute attention scores, norms, activations
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the same outputs, moved to pinned host memory after the forward and back for the backward
    # (XLA's host offloading; device memory then holds one layer's at a time)
    "dots_offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype, param_dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype, rngs=rngs)
        self.mlp = MLP(
            cfg.d_model,
            cfg.d_ff,
            dtype,
            param_dtype,
            rngs=rngs,
            fp8_matmuls=cfg.matmul_precision == "fp8",
        )

    def __call__(self, x_BTD, positions_BT, cache: KVCache | None = None, segment_ids_BT=None):
        h_BTD, cache = self.attn(self.attn_norm(x_BTD), positions_BT, cache, segment_ids_BT)
        x_BTD = constrain(x_BTD + h_BTD, ACT_BTD)
        x_BTD = constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD)), ACT_BTD)
        return x_BTD, cache


class MoEBlock(nnx.Module):
    """A decoder layer whose feed-forward is a Mixture-of-Experts; also returns the router stats."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype, param_dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype, rngs=rngs)
        self.moe = MoE(cfg, dtype, param_dtype, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, cache: KVCache | None = None, segment_ids_BT=None):
        h_BTD, cache = self.attn(self.attn_norm(x_BTD), positions_BT, cache, segment_ids_BT)
        x_BTD = constrain(x_BTD + h_BTD, ACT_BTD)
        y_BTD, stats = self.moe(self.mlp_norm(x_BTD))
        return constrain(x_BTD + y_BTD, ACT_BTD), cache, stats


def _stack(cfg: ModelConfig, n: int, cls, dtype, pdt, rngs):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
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
    model: groups of one dense layer), scanning over the groups as MaxText does."""

    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.embed_VD = param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "vocab_embed"), pdt, std=cfg.init_std
        )
        n_dense = cfg.n_layers - cfg.n_moe_layers
        if n_dense:
            self.blocks = _stack(cfg, n_dense, Block, self.dtype, pdt, rngs)
        if cfg.n_moe_layers:
            self.moe_blocks = _stack(cfg, cfg.n_moe_layers, MoEBlock, self.dtype, pdt, rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head_DV = param(
                rngs, (cfg.d_model, cfg.vocab_size), ("vocab_embed", "vocab"), pdt, std=cfg.init_std
            )

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        cache: KVCache | None = None,
        segment_ids_BT: jax.Array | None = None,
        *,
        pipeline: pipeline_lib.PipelineConfig | None = None,
        logits: bool = True,
    ):
        """tokens [B,T] int32 -> (logits [B,T,V] float32, cache, MoE stats stacked [L_moe, ...]).
        `cache` holds [L,...] stacked KVCaches; `segment_ids_BT` restricts attention to each segment.
        On a mesh with pipeline > 1 the training forward (no cache) runs the layer groups through
        models/pipeline.py with `pipeline`'s schedule (default: PipelineConfig()). `logits=False`:
        ((the final-normed hidden states [B,T,D], the LM head [D,V] in the compute dtype), cache,
        stats) instead, for a loss that applies the head chunk by chunk (models/loss.py)."""
        # ~75 lines on purpose: `group` (one layer group) is shared by the three ways of running the
        # stack (pipeline, scan, unrolled), which read best side by side with it.
        cfg = self.cfg
        if positions_BT is None:
            positions_BT = default_positions(segment_ids_BT, tokens_BT.shape)
        x_BTD = constrain(
            jnp.take(self.embed_VD[...], tokens_BT, axis=0).astype(self.dtype), ACT_BTD
        )

        per_group = cfg.moe_every if cfg.n_experts else 1
        n_groups = cfg.n_layers // per_group
        n_dense = per_group - 1 if cfg.n_experts else 1  # dense layers per group
        grouped = lambda tree, size: jax.tree.map(
            lambda a: a.reshape(n_groups, size, *a.shape[1:]), tree
        )
        dense_gdef, dense = nnx.split(self.blocks) if n_dense else (None, None)
        moe_gdef, moe = nnx.split(self.moe_blocks) if cfg.n_experts else (None, None)
        dense = grouped(dense, n_dense) if n_dense else None
        caches = grouped(cache, per_group) if cache is not None else None

        def group(x_BTD, xs, positions_BT, *seg):
            # positions and segment ids are arguments, not closed over: the pipeline splits them
            # into micro-batches alongside x
            dense_state, moe_state, group_cache = xs
            segment_ids_BT = seg[0] if seg else None
            new_caches, stats = [], {}
            for j in range(per_group):
                c = None if group_cache is None else jax.tree.map(lambda a: a[j], group_cache)
                if j < n_dense:
                    layer = nnx.merge(dense_gdef, jax.tree.map(lambda a: a[j], dense_state))
                    x_BTD, c = layer(x_BTD, positions_BT, c, segment_ids_BT)
                else:
                    x_BTD, c, stats = nnx.merge(moe_gdef, moe_state)(
                        x_BTD, positions_BT, c, segment_ids_BT
                    )
                new_caches.append(c)
            new_cache = (
                None if group_cache is None else jax.tree.map(lambda *a: jnp.stack(a), *new_caches)
            )
            return x_BTD, (new_cache, stats)

        seg = () if segment_ids_BT is None else (segment_ids_BT,)
        policy = REMAT[cfg.remat]
        stages = _pipeline_stages()
        if stages > 1 and cache is None:
            pc = pipeline or pipeline_lib.PipelineConfig()

            def one_group(x_BTD, xs, *args):
                x_BTD, (_, stats) = group(x_BTD, (*xs, None), *args)
                return x_BTD, stats

            M = pc.microbatches_for(stages)
            x_BTD, stats = pipeline_lib.pipeline_apply(
                one_group,
                (dense, moe),
                x_BTD,
                positions_BT,
                *seg,
                stages=stages,
                microbatches=M,
                repeats=pc.repeats,
                schedule=pc.schedule,
                remat_policy=policy,
                remat_stage=pc.remat_stage,
                has_aux=True,
                scan_layers=cfg.scan_layers,
                replica_axes=pc.replica_axes,
            )
            stats = _sum_counts(stats, M * _replicas(pc.replica_axes))
            caches = None
        else:
            step = lambda x_BTD, xs: group(x_BTD, xs, positions_BT, *seg)
            if (
                policy is not None and cache is None
            ):  # no remat when decoding: there is no backward pass
                step = jax.checkpoint(step, policy=policy, prevent_cse=not cfg.scan_layers)
            if cfg.scan_layers:
                x_BTD, (caches, stats) = jax.lax.scan(step, x_BTD, (dense, moe, caches))
            else:
                outs = []
                for g in range(n_groups):
                    x_BTD, out = step(x_BTD, jax.tree.map(lambda a: a[g], (dense, moe, caches)))
                    outs.append(out)
                caches, stats = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        if cache is not None:
            cache = jax.tree.map(lambda a: a.reshape(cfg.n_layers, *a.shape[2:]), caches)

        x_BTD = constrain(self.final_norm(x_BTD), ("logits_batch", "seq", "act_embed"))
        head_DV = (self.embed_VD[...].T if cfg.tie_embeddings else self.lm_head_DV[...]).astype(
            self.dtype
        )
        if not logits:
            return (x_BTD, head_DV), cache, stats
        logits_BTV = head_logits(x_BTD, head_DV)
        return constrain(logits_BTV, ("logits_batch", "seq", "act_vocab")), cache, stats


def _pipeline_stages() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "pipeline" not in mesh.shape else mesh.shape["pipeline"]


def _replicas(replica_axes: tuple[str, ...]) -> int:
    """How many data replicas pipeline_apply splits each micro-batch into (its dim A)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = [a for a in current_rules()["batch"] if a not in current_rules()["stages"]]
    return math.prod(mesh.shape[a] for a in batch_axes if a in replica_axes)


# MoE stats that are sums over tokens; the pipeline returns every stat's mean over batch pieces
_COUNT_STATS = ("counts", "assigned", "dropped")


def _sum_counts(stats: dict, pieces: int) -> dict:
    return {k: v * pieces if k in _COUNT_STATS else v for k, v in stats.items()}
