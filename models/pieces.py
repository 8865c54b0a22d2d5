"""The built-in decoder in three pieces, pure functions of its parameters: the embedding (tokens ->
x_BTD), the repeating layer group (x_BTD, one group's params, positions, segment ids -> x_BTD, MoE
stats) and the head with its loss (x_BTD, batch -> loss sum). `Decoder.__call__`
(models/transformer.py) is made of them, and models/pipeline runs them under every schedule, the
plain scan included, so a change to the decoder's layers (a new family's block, a per-layer
attention pattern) is made here once and every schedule runs it.

The params as the pieces see them (`Decoder.pieces` splits the module): `outer`, what lies outside
the layer stack ({"embed_VD", "norm": the final norm's state, "head_DV": None when tied; where the
model has them, "tail": the tail layers' [r, ...], "first": the dense first layers
[first_dense_layers, ...], which `embed` runs, and "mtp": the multi-token prediction modules
[mtp_layers, ...], which `head` runs}), and `stack`, the layer groups' params with every leaf
[G, ...]: (dense [G, n_dense, ...] or None, MoE [G, ...] or None). A group is moe_every layers,
moe_every - 1 dense then one MoE (a dense model: one dense layer, or one repeat of its layer
pattern), so every group has the same structure and the stack scans, and pipelines, by group.
Layer j of a group runs with its own LayerSpec (window, RoPE: models/layer_pattern.py); the layers
past the pattern's last whole repeat (the tail) run after the groups, inside `head`. A layer's
params may hold quantised weights (models/quant.py, a QLoRA base): each layer materialises its own
where it runs, so the full-precision temporary is one layer's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mesh.shard import constrain
from models import context, layer_pattern, mtp
from models.config import ModelConfig
from models.layers import head_logits
from models.loss import chunked_token_xent, token_xent
from models.quant import materialise, remat_policy, take_rows
from models.softcap import softcap

# the residual stream between blocks: its sequence dim is also split over `model` with sequence
# parallelism
ACT_BTD = ("batch", "res_seq", "act_embed")
HIDDEN_BTD = ("logits_batch", "seq", "act_embed")  # the final-normed states the head reads
LOGITS_BTV = ("logits_batch", "seq", "act_vocab")

REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # save projection outputs (dots without batch dims); recompute attention scores, norms and
    # activations
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the same outputs, moved to pinned host memory after the forward and back for the backward
    # (XLA's host offloading; device memory then holds one layer's at a time)
    "dots_offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


# the tail layers' stacked dim: kept whole on every pipeline stage (the last one runs them)
TAIL_LAYERS = "tail_layers"


def layers_per_group(cfg: ModelConfig) -> int:
    """Layers per repeating group: moe_every for an MoE model (moe_every - 1 dense, then one MoE),
    else one repeat of the layer pattern (1 without one). The pipelines split the stack by groups,
    so the run's checks and `plan` count stages in groups too."""
    return cfg.moe_every if cfg.n_experts else layer_pattern.period(cfg)


def n_groups_and_tail(cfg: ModelConfig) -> tuple[int, int]:
    """(the repeating groups, the layers after them): Gemma 3 4B's 34 layers in groups of 6 are
    (5, 4)."""
    return divmod(cfg.n_group_layers, layers_per_group(cfg))


def stage_layers(cfg: ModelConfig, stages: int) -> tuple[int, int]:
    """(the layers one pipeline stage holds, of them the repeating groups' share): the `layers`
    rule shards the groups over `pipeline`; the dense first layers and the tail after the last
    group are whole on every stage (mesh/rules.py's `outer_layers`, `tail_layers`). DeepSeek-V3's
    61 layers at 2 stages: 3 + 29 + 0 = 32 held, 29 of them the stage's groups."""
    n_groups, tail = n_groups_and_tail(cfg)
    grouped = n_groups // stages * layers_per_group(cfg)
    return cfg.first_dense_layers + grouped + tail, grouped


@dataclasses.dataclass(frozen=True)
class DecoderPieces:
    """The decoder's pieces for one config; the graph definitions are the modules' (nnx.split).
    `token_loss(logits_BTV, batch) -> loss_BT`: a custom per-token loss (train/core/batch_loss.py
    token_losses); None: cross-entropy against batch["targets"], which the head may chunk."""

    cfg: ModelConfig
    dtype: Any
    dense_gdef: Any  # nnx.GraphDef of one dense layer (None: no dense layers)
    moe_gdef: Any  # ... of one MoE layer (None: a dense model)
    norm_gdef: Any  # ... of the final norm
    token_loss: Callable | None = None
    tail_gdef: Any = None  # ... of one tail layer (None: no tail)
    first_gdef: Any = None  # ... of one of the dense first layers (None: none)
    mtp_gdef: Any = None  # ... of one multi-token prediction module (None: none)

    # MoE stats that are sums over tokens (the rest are means); the pipelines average every stat
    # over the pieces of the batch, so these are scaled back by the piece count
    count_stats = ("counts", "assigned", "dropped")

    @property
    def per_group(self) -> int:
        return layers_per_group(self.cfg)

    @property
    def n_dense(self) -> int:
        """Dense layers per group."""
        return self.per_group - 1 if self.cfg.n_experts else self.per_group

    @property
    def group_specs(self) -> tuple[layer_pattern.LayerSpec, ...]:
        """The LayerSpec of each layer of a group."""
        return layer_pattern.layer_specs(self.cfg)[: self.per_group]

    @property
    def remat_policy(self):
        return REMAT[self.cfg.remat]

    @property
    def scan_layers(self) -> bool:
        return self.cfg.scan_layers

    # -------------------------------------------------------------------------- the pieces

    def embed_tokens(self, outer: dict, tokens_BT: jax.Array) -> jax.Array:
        x_BTD = take_rows(outer["embed_VD"], tokens_BT).astype(self.dtype)
        if self.cfg.embed_scale:  # Gemma: sqrt(d_model), rounded to the compute dtype as HF does
            x_BTD = x_BTD * jnp.asarray(self.cfg.d_model**0.5, self.dtype)
        return constrain(x_BTD, ACT_BTD)

    def embed(self, outer: dict, tokens_BT, positions_BT=None, segment_ids_BT=None) -> jax.Array:
        """The token embedding, then the dense first layers where the model has them
        (first_dense_layers; they need the positions): they run wherever the embedding runs, every
        schedule's first stage, outside the pipelined groups."""
        x_BTD = self.embed_tokens(outer, tokens_BT)
        if self.first_gdef is None:
            return x_BTD

        def step(x_BTD, params):
            layer = nnx.merge(self.first_gdef, materialise(params))
            return layer(x_BTD, positions_BT, None, segment_ids_BT)[0], None

        policy = remat_policy(self.remat_policy, outer["first"])
        if policy is not None:
            step = jax.checkpoint(step, policy=policy, prevent_cse=not self.scan_layers)
        return over_groups(step, x_BTD, outer["first"], self.scan_layers)[0]

    def group(self, x_BTD, params_G, positions_BT, segment_ids_BT=None):
        """One group of layers -> (x_BTD, the MoE layer's stats or {}). Positions and segment ids
        are arguments, not closed over: a pipeline splits them into micro-batches alongside x."""
        x_BTD, stats, _ = self.layers(x_BTD, params_G, positions_BT, segment_ids_BT, None)
        return x_BTD, stats

    def decode_group(self, x_BTD, params_G, positions_BT, cache_G, segment_ids_BT=None):
        """`group` reading and writing a KV cache ([per_group, ...] stacked, or a tuple of one per
        layer of the group) -> (x_BTD, stats, cache_G)."""
        return self.layers(x_BTD, params_G, positions_BT, segment_ids_BT, cache_G)

    def layers(self, x_BTD, params_G, positions_BT, segment_ids_BT, cache_G):
        """The one definition of a group's layers, for `group` and `decode_group`."""
        dense_G, moe_G = params_G
        new_caches, stats = [], {}
        # the cache: [per_group, ...] stacked, or (a layer pattern's) one per layer of the group
        per_layer = cache_G is not None and bool(self.cfg.layer_pattern)
        for j, spec in enumerate(self.group_specs):
            if cache_G is None or per_layer:
                c = None if cache_G is None else cache_G[j]
            else:
                c = jax.tree.map(lambda a, j=j: a[j], cache_G)
            if j < self.n_dense:
                dense_j = jax.tree.map(lambda a, j=j: a[j], dense_G)
                layer = nnx.merge(self.dense_gdef, materialise(dense_j))
                x_BTD, c = layer(x_BTD, positions_BT, c, segment_ids_BT, spec)
            else:
                layer = nnx.merge(self.moe_gdef, materialise(moe_G))
                x_BTD, c, stats = layer(x_BTD, positions_BT, c, segment_ids_BT, spec)
            new_caches.append(c)
        if per_layer:
            cache_G = tuple(new_caches)
        elif cache_G is not None:
            cache_G = jax.tree.map(lambda *a: jnp.stack(a), *new_caches)
        return x_BTD, stats, cache_G

    def tail(self, outer, x_BTD, positions_BT, segment_ids_BT=None, caches=None):
        """The tail layers (after the groups; none: x_BTD unchanged) -> (x_BTD, their caches, one
        per layer, or None). Rematerialised as the groups are when training."""
        if self.tail_gdef is None:
            return x_BTD, caches
        n_groups, tail = n_groups_and_tail(self.cfg)
        specs = layer_pattern.layer_specs(self.cfg)[n_groups * self.per_group :]
        new_caches = []
        for i in range(tail):

            def run(x_BTD, params, c, i=i):
                layer = nnx.merge(self.tail_gdef, materialise(params))
                return layer(x_BTD, positions_BT, c, segment_ids_BT, specs[i])

            policy = remat_policy(self.remat_policy, outer["tail"])
            if caches is None and policy is not None:
                run = jax.checkpoint(run, policy=policy)
            params = jax.tree.map(lambda a, i=i: a[i], outer["tail"])
            x_BTD, c = run(x_BTD, params, None if caches is None else caches[i])
            new_caches.append(c)
        return x_BTD, None if caches is None else tuple(new_caches)

    def final(self, outer: dict, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """-> (the final-normed states [B,T,D], the LM head [D,V] in the compute dtype)."""
        x_BTD = constrain(nnx.merge(self.norm_gdef, outer["norm"])(x_BTD), HIDDEN_BTD)
        tied = outer["head_DV"] is None
        head_DV = materialise(outer["embed_VD"]).T if tied else materialise(outer["head_DV"])
        return x_BTD, head_DV.astype(self.dtype)

    def logits(self, x_BTD: jax.Array, head_DV: jax.Array) -> jax.Array:
        """The final-normed states -> logits [B,T,V] float32 (soft-capped by final_softcap)."""
        return constrain(softcap(head_logits(x_BTD, head_DV), self.cfg.final_softcap), LOGITS_BTV)

    def head(self, outer: dict, x_BTD: jax.Array, batch: dict, chunk: int = 0) -> jax.Array:
        """The last layer group's output -> the batch's loss sum (float32): per-token losses times
        batch["weights"] (when given). `chunk` > 0: the cross-entropy `chunk` tokens at a time
        (models/loss.py), never holding the [B,T,V] logits; a custom token_loss reads whole
        logits."""
        x_BTD, _ = self.tail(outer, x_BTD, batch["positions"], batch.get("segment_ids"))
        x_BTD, head_DV = self.final(outer, x_BTD)
        if chunk and self.token_loss is None:
            loss_BT = chunked_token_xent(
                x_BTD,
                head_DV,
                batch["targets"],
                chunk_tokens=chunk,
                seq_shards=context.context_size(),
                softcap=self.cfg.final_softcap,
            )
        else:
            logits_BTV = self.logits(x_BTD, head_DV)
            loss_BT = (
                token_xent(logits_BTV, batch["targets"])
                if self.token_loss is None
                else self.token_loss(logits_BTV, batch)
            )
        weights_BT = batch.get("weights")
        loss = jnp.sum(loss_BT if weights_BT is None else loss_BT * weights_BT)
        if self.mtp_gdef is not None and self.cfg.mtp_loss_weight > 0:
            # in the gradient, not in the value: the loss reported stays the next-token one
            term = mtp.loss_sum(
                self.cfg,
                self.mtp_gdef,
                outer["mtp"],
                materialise(outer["embed_VD"]),
                x_BTD,
                head_DV,
                batch,
                chunk=chunk if self.token_loss is None else 0,
                remat_policy=self.remat_policy,
            )
            loss = loss + (term - jax.lax.stop_gradient(term))
        return loss

    def decode(self, outer, stack, x_BTD, positions_BT, cache, segment_ids_BT=None):
        """The dense first layers and every group with the KV cache ([L, ...] stacked, the first
        layers' first; with a layer pattern, a tuple of one [G, ...] cache per layer of the group)
        -> (x_BTD, stats [G, ...], cache). Decoding has no backward pass: no remat, no pipeline."""
        if self.cfg.layer_pattern:
            x_BTD, (stats, cache) = over_groups(
                functools.partial(self._decode_step, positions_BT, segment_ids_BT),
                x_BTD,
                (stack, cache),
                self.scan_layers,
            )
            return x_BTD, stats, cache
        first = self.cfg.first_dense_layers
        if first:

            def first_step(x_BTD, xs):
                params, c = xs
                layer = nnx.merge(self.first_gdef, materialise(params))
                return layer(x_BTD, positions_BT, c, segment_ids_BT)

            head_cache = jax.tree.map(lambda a: a[:first], cache)
            x_BTD, head_cache = over_groups(
                first_step, x_BTD, (outer["first"], head_cache), self.scan_layers
            )
            cache = jax.tree.map(lambda a: a[first:], cache)
        n_groups = self.cfg.n_group_layers // self.per_group
        caches = jax.tree.map(lambda a: a.reshape(n_groups, self.per_group, *a.shape[1:]), cache)

        def step(x_BTD, xs):
            params_G, cache_G = xs
            x_BTD, stats, cache_G = self.decode_group(
                x_BTD, params_G, positions_BT, cache_G, segment_ids_BT
            )
            return x_BTD, (stats, cache_G)

        x_BTD, (stats, caches) = over_groups(step, x_BTD, (stack, caches), self.scan_layers)
        cache = jax.tree.map(lambda a: a.reshape(self.cfg.n_group_layers, *a.shape[2:]), caches)
        if first:
            cache = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), head_cache, cache)
        return x_BTD, stats, cache

    def _decode_step(self, positions_BT, segment_ids_BT, x_BTD, xs):
        params_G, cache_G = xs
        x_BTD, stats, cache_G = self.decode_group(
            x_BTD, params_G, positions_BT, cache_G, segment_ids_BT
        )
        return x_BTD, (stats, cache_G)


def over_groups(step: Callable, x, xs, scan: bool):
    """`lax.scan(step, x, xs)`, or with `scan` False the same as an unrolled Python loop over the
    groups (compile time grows with depth; XLA sees every layer)."""
    if scan:
        return jax.lax.scan(step, x, xs)
    n = jax.tree.leaves(xs)[0].shape[0]
    outs = []
    for g in range(n):
        x, out = step(x, jax.tree.map(lambda a, g=g: a[g], xs))
        outs.append(out)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)
