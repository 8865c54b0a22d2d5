"""Decoder-only Transformer (Llama architecture) with a stacked, scannable layer stack.

Parameters are always stored stacked over layers ([L, ...], logical axis 'layers'); `scan_layers`
only chooses between a `lax.scan` over that stack and an unrolled Python loop over its slices,
so checkpoints do not depend on it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mesh.shard import constrain
from models.attention import Attention, KVCache
from models.config import ModelConfig
from models.layers import MLP, RMSNorm, param

ACT_BTD = ("batch", "seq", "act_embed")

REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # save projection outputs (dots without batch dims); recompute attention scores, norms, activations
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype, param_dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype, rngs=rngs)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, dtype, param_dtype, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, cache: KVCache | None = None):
        h_BTD, cache = self.attn(self.attn_norm(x_BTD), positions_BT, cache)
        x_BTD = constrain(x_BTD + h_BTD, ACT_BTD)
        x_BTD = constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD)), ACT_BTD)
        return x_BTD, cache


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.embed_VD = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt, std=cfg.init_std)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, self.dtype, pdt, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head_DV = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt, std=cfg.init_std)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 cache: KVCache | None = None):
        """tokens [B,T] int32 -> (logits [B,T,V] float32, cache). `cache` holds [L,...] stacked KVCaches."""
        cfg = self.cfg
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        x_BTD = constrain(jnp.take(self.embed_VD[...], tokens_BT, axis=0).astype(self.dtype), ACT_BTD)

        gdef, stack = nnx.split(self.blocks)

        def layer(x_BTD, layer_state_and_cache):
            layer_state, layer_cache = layer_state_and_cache
            return nnx.merge(gdef, layer_state)(x_BTD, positions_BT, layer_cache)

        policy = REMAT[cfg.remat]
        if policy is not None and cache is None:  # no remat when decoding: there is no backward pass
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            x_BTD, cache = jax.lax.scan(layer, x_BTD, (stack, cache))
        else:
            new = []
            for i in range(cfg.n_layers):
                x_BTD, c = layer(x_BTD, jax.tree.map(lambda a: a[i], (stack, cache)))
                new.append(c)
            cache = None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *new)

        x_BTD = self.final_norm(x_BTD)
        head_DV = self.embed_VD[...].T if cfg.tie_embeddings else self.lm_head_DV[...]
        logits_BTV = jnp.einsum("btd,dv->btv", x_BTD, head_DV.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        return constrain(logits_BTV, ("batch", "seq", "act_vocab")), cache
