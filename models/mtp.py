"""Multi-token prediction (DeepSeek-V3, `--model.mtp_layers` D > 0): D modules in a chain after
the decoder, module k predicting the token k + 1 positions ahead of each position. A training
objective only: generation never runs them.

Module k at position i (DeepSeek-V3 report, section 2.2, as transformers' MtpLayer computes it):
  h'_i = W_eh [RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h^{k-1}_i)]    (W_eh: [2D, D])
  h^k  = RMSNorm_out(Block_k(h'))                                (a decoder layer of the model)
  p^k  = softmax(h^k_i W_head)                                    (the model's embedding and head)
with h^0 the decoder's final-normed hidden states; the loss of module k is the cross-entropy of
t_{i+k+1} under p^k_i, over the positions whose t_{i+k+1} exists in the same document. The
objective adds mtp_loss_weight / D x the modules' loss sums, weighted by each target token's
weight (batch["weights"]) and normalised with the main loss (by the token count), in the
gradient only: the loss a run reports stays the next-token cross-entropy.

The modules' MoE layers route as the decoder's do, but their balance statistics do not enter the
balance losses or the bias updates (the train step reads those from the layer groups): their
routing bias stays as initialised or imported.

Under context parallelism the batch arrives in the zigzag order (models/context.py): "k positions
ahead" is then a fixed permutation of the index, applied to the [B,T] token arrays (`ahead`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import context
from models.config import ModelConfig
from models.layers import RMSNorm, head_logits, param
from models.loss import chunked_token_xent, token_xent


class MTPModule(nnx.Module):
    """One prediction module: the two norms, the projection of their concatenation, a decoder layer
    (`block_cls`: the model's MoE layer, or its dense one for a dense model) and the output norm."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, block_cls, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.enorm = RMSNorm(d, cfg.norm_eps, param_dtype, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.norm_eps, param_dtype, rngs=rngs)
        # the embedding's half of the input, then the hidden state's
        self.w_eh_ED = param(rngs, (2 * d, d), ("embed", None), param_dtype, fan_in=2 * d)
        self.block = block_cls(cfg, dtype, param_dtype, rngs=rngs)
        self.norm = RMSNorm(d, cfg.norm_eps, param_dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, h_BTD, e_BTD, positions_BT, segment_ids_BT=None):
        """The previous depth's states and the embeddings of the tokens k ahead -> this depth's
        (normed) states."""
        both_BTE = jnp.concatenate([self.enorm(e_BTD), self.hnorm(h_BTD)], axis=-1)
        x_BTD = jnp.einsum("bte,ed->btd", both_BTE, self.w_eh_ED[...].astype(self.dtype))
        out = self.block(x_BTD, positions_BT, None, segment_ids_BT)
        return self.norm(out[0])


def ahead(a_BT: jax.Array, k: int, n_context: int) -> tuple[jax.Array, np.ndarray]:
    """a at the position k ahead of each index [B,T], and [T] whether that position exists. The
    batch is in the zigzag order of `n_context` sequence shards (1: index order)."""
    t = a_BT.shape[1]
    if k >= t:
        return a_BT, np.zeros(t, bool)
    order = context.zigzag(t, n_context)  # index j holds position order[j]
    index_of = np.argsort(order)
    exists_T = order + k < t
    source_T = np.where(exists_T, index_of[np.minimum(order + k, t - 1)], np.arange(t))
    if n_context == 1:  # a slice, not a gather
        return jnp.concatenate([a_BT[:, k:], a_BT[:, t - k :]], axis=1), exists_T
    return jnp.take(a_BT, jnp.asarray(source_T), axis=1), exists_T


def states(cfg: ModelConfig, mtp_gdef, mtp_params, embed_VD, h_BTD, batch: dict, remat_policy=None):
    """Module by module -> (k, its states [B,T,D]: position i's prediction of token i + k + 1).
    `h_BTD`: the decoder's final-normed states; `mtp_params`: the modules' params stacked [D, ...];
    `batch`: "inputs" and "positions" (and "segment_ids"), in the layout of the objective's."""
    n_ctx = context.context_size()

    def depth(h_BTD, p, tokens_BT):
        e_BTD = jnp.take(embed_VD, tokens_BT, axis=0).astype(h_BTD.dtype)
        return nnx.merge(mtp_gdef, p)(h_BTD, e_BTD, batch["positions"], batch.get("segment_ids"))

    if remat_policy is not None:
        depth = jax.checkpoint(depth, policy=remat_policy)
    for k in range(1, cfg.mtp_layers + 1):
        tokens_BT, _ = ahead(batch["inputs"], k, n_ctx)
        h_BTD = depth(h_BTD, jax.tree.map(lambda a, k=k: a[k - 1], mtp_params), tokens_BT)
        yield k, h_BTD


def loss_sum(
    cfg: ModelConfig,
    mtp_gdef,
    mtp_params,
    embed_VD,
    h_BTD,
    head_DV,
    batch: dict,
    *,
    chunk: int = 0,
    remat_policy=None,
):
    """mtp_loss_weight / D x the D modules' weighted cross-entropy sums (float32). `head_DV`: the LM
    head in the compute dtype; `batch`: the objective's ("inputs", "targets", "positions";
    "segment_ids", "weights" where given); `chunk` > 0: the cross-entropy that many tokens at a
    time (models/loss.py); the rest as `states`."""
    n_ctx = context.context_size()
    seg_BT, weights_BT = batch.get("segment_ids"), batch.get("weights")
    total = jnp.zeros((), jnp.float32)
    for k, hk_BTD in states(cfg, mtp_gdef, mtp_params, embed_VD, h_BTD, batch, remat_policy):
        targets_BT, exists_T = ahead(batch["targets"], k, n_ctx)
        w_BT = jnp.broadcast_to(jnp.asarray(exists_T, jnp.float32), targets_BT.shape)
        if seg_BT is not None:  # the target k ahead must lie in the same document
            w_BT = w_BT * (ahead(seg_BT, k, n_ctx)[0] == seg_BT)
        if weights_BT is not None:
            w_BT = w_BT * ahead(weights_BT, k, n_ctx)[0]
        if chunk:
            xent_BT = chunked_token_xent(
                hk_BTD, head_DV, targets_BT, chunk_tokens=chunk, seq_shards=n_ctx
            )
        else:
            xent_BT = token_xent(head_logits(hk_BTD, head_DV), targets_BT)
        total = total + jnp.sum(xent_BT * w_BT)
    return total * (cfg.mtp_loss_weight / cfg.mtp_layers)
