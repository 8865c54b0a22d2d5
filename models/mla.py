"""Multi-head latent attention (DeepSeek-V2/V3, `--model.kv_lora_rank` > 0): keys and values come
from one compressed latent per token (C wide) and a rotary key shared by all heads, and that pair
is all the KV cache holds.

Per token: the latent c = RMSNorm(x W_kv_a[:, :C]) and the rotary key k_r = RoPE(x W_kv_a[:, C:]);
head n's key is [c W_k,n ; k_r] (G RoPE-free features, then R rotary ones) and its value c W_v,n.
Queries: x W_q, or through their own latent, RMSNorm(x W_q_a) W_q_b (`q_lora_rank`), split the same
way into G RoPE-free and R rotary features. Training expands the keys and values of every head
and runs the attention of models/attention.py's paths (values zero-padded to the query width where
they are narrower, since those kernels take one head width). Decoding reads the latent cache with
W_k absorbed into the query (q_n W_k,n^T scores against c directly) and W_v applied after the
weighted sum, so no per-head key or value is ever formed for the cached positions: the cache is
C + R numbers per token and layer (DeepSeek-V3: 576, against 2 x 128 x 128 for its heads in full).

`rope_interleave` (DeepSeek's checkpoints): the rotary features come as pairs (x0, x1), (x2, x3)
...; they are read into the split-halves layout (evens, then odds) before RoPE, as transformers'
apply_rotary_pos_emb_interleave does, for queries and keys alike, so scores are unchanged.

Letters: B batch, T queries, S cached positions, D d_model, N heads, C KV latent (kv_lora_rank),
Q query latent (q_lora_rank), H query/key head width (G RoPE-free + R rotary), W value head width.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mesh.shard import constrain
from models import context, fp8
from models.adapters import frozen, with_adapters
from models.blockwise import visible
from models.config import ModelConfig
from models.context import context_size
from models.layers import RMSNorm, param, rope

# DeepSeek's (and transformers') latent norms use this epsilon whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6
HEADS = ("batch", "seq", "act_heads", None)


class LatentCache(NamedTuple):
    """Per-layer cache of latent attention: the normed latent [B,S,C], the rotary key after RoPE
    [B,S,R], and the next write position."""

    latent: jax.Array
    k_rope: jax.Array
    index: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> LatentCache:
    """An empty cache of every layer, stacked [L, ...]."""
    lead = (cfg.n_layers, batch, length)
    return LatentCache(
        jnp.zeros((*lead, cfg.kv_lora_rank), dtype),
        jnp.zeros((*lead, cfg.qk_rope_head_dim), dtype),
        jnp.zeros((cfg.n_layers,), jnp.int32),
    )


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(H): the query/key width, RoPE-free and rotary together."""
    return cfg.qk_head_dim**-0.5


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        d, n, h, c = cfg.d_model, cfg.n_heads, cfg.qk_head_dim, cfg.kv_lora_rank
        g, r, w, q = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
        pdt = param_dtype
        if q:
            self.wq_a_DQ = param(rngs, (d, q), ("embed", "latent"), pdt, fan_in=d)
            self.q_norm = RMSNorm(q, LATENT_NORM_EPS, pdt, rngs=rngs)
            self.wq_b_QNH = param(rngs, (q, n, h), ("latent", "heads", "head_dim"), pdt, fan_in=q)
        else:
            self.wq_DNH = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pdt, fan_in=d)
        # the latent, then the rotary key: one projection, as the checkpoints store it
        self.wkv_a_DC = param(rngs, (d, c + r), ("embed", "latent"), pdt, fan_in=d)
        self.kv_norm = RMSNorm(c, LATENT_NORM_EPS, pdt, rngs=rngs)
        # each head's RoPE-free key features (G), then its value (W)
        self.wkv_b_CNH = param(rngs, (c, n, g + w), ("latent", "heads", "head_dim"), pdt, fan_in=c)
        self.wo_NWD = param(rngs, (n, w, d), ("heads", "head_dim", "embed"), pdt, fan_in=n * w)
        self.dims = (c, g, r, w)
        self.scale = softmax_scale(cfg)
        self.rope_args = (cfg.rope_theta, cfg.rope_scaling)
        self.interleave = cfg.rope_interleave
        self.dtype, self.fp8 = dtype, cfg.matmul_precision == "fp8"
        self.kind = functools.partial(cfg.attention_kind, jax.default_backend())
        self.kind(cfg.max_seq_len)  # an attention this backend lacks: one line when built

    def _rope(self, x_BTNR, positions_BT):
        if self.interleave:  # pairs (x0, x1), (x2, x3) ... -> halves (x0, x2, ... | x1, x3, ...)
            x_BTNR = jnp.concatenate([x_BTNR[..., 0::2], x_BTNR[..., 1::2]], axis=-1)
        return rope(x_BTNR, positions_BT, *self.rope_args)

    def _queries(self, x_BTD, positions_BT):
        """-> (RoPE-free [B,T,N,G], rotary [B,T,N,R]) query features."""
        dt, g = self.dtype, self.dims[1]
        if hasattr(self, "wq_a_DQ"):
            w_DQ = self.wq_a_DQ[...].astype(dt)
            q_BTQ = self.q_norm(fp8.einsum("btd,dq->btq", x_BTD, w_DQ, self.fp8))
            w_QNH = self.wq_b_QNH[...].astype(dt)
            q_BTNH = fp8.einsum("btq,qnh->btnh", q_BTQ, w_QNH, self.fp8)
        else:
            wq = self.wq_DNH[...]  # LoRA's "q" target (models/adapters.py)
            q_BTNH = fp8.einsum("btd,dnh->btnh", x_BTD, frozen(wq).astype(dt), self.fp8)
            q_BTNH = with_adapters(q_BTNH, "btd,dnh->btnh", x_BTD, wq)
        q_BTNH = constrain(q_BTNH, HEADS)
        return q_BTNH[..., :g], self._rope(q_BTNH[..., g:], positions_BT)

    def _latent(self, x_BTD, positions_BT):
        """-> (the normed latent [B,T,C], the rotary key after RoPE [B,T,R])."""
        c = self.dims[0]
        w_DC = self.wkv_a_DC[...].astype(self.dtype)
        kv_BTC = fp8.einsum("btd,dc->btc", x_BTD, w_DC, self.fp8)
        k_rope_BTR = self._rope(kv_BTC[:, :, None, c:], positions_BT)[:, :, 0]
        return self.kv_norm(kv_BTC[..., :c]), k_rope_BTR

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        cache: LatentCache | None = None,
        segment_ids_BT: jax.Array | None = None,
        spec=None,
    ):
        """-> (out [B,T,D], cache): as models/attention.py's Attention, the cache a LatentCache.
        `spec` (a layer pattern's) is None: ModelConfig refuses a layer pattern with a latent."""
        q_nope_BTNG, q_rope_BTNR = self._queries(x_BTD, positions_BT)
        latent_BTC, k_rope_BTR = self._latent(x_BTD, positions_BT)
        if cache is None:
            out_BTNW = self._expanded(
                q_nope_BTNG, q_rope_BTNR, latent_BTC, k_rope_BTR, positions_BT, segment_ids_BT
            )
        else:
            cache = LatentCache(
                jax.lax.dynamic_update_slice(
                    cache.latent, latent_BTC.astype(cache.latent.dtype), (0, cache.index, 0)
                ),
                jax.lax.dynamic_update_slice(
                    cache.k_rope, k_rope_BTR.astype(cache.k_rope.dtype), (0, cache.index, 0)
                ),
                cache.index + x_BTD.shape[1],
            )
            out_BTNW = self._absorbed(q_nope_BTNG, q_rope_BTNR, cache, positions_BT)
        out_BTNW = constrain(out_BTNW, HEADS)
        out_BTD = fp8.einsum(
            "btnw,nwd->btd", out_BTNW, self.wo_NWD[...].astype(self.dtype), self.fp8
        )
        return out_BTD, cache

    def _expanded(self, q_nope_BTNG, q_rope_BTNR, latent_BTC, k_rope_BTR, positions_BT, seg_BT):
        """Training and prefill-free forward: every head's keys and values from the latent."""
        _, g, r, w = self.dims
        wkv_CNH = self.wkv_b_CNH[...].astype(self.dtype)
        kv_BTNH = constrain(fp8.einsum("btc,cnh->btnh", latent_BTC, wkv_CNH, self.fp8), HEADS)
        b, t, n, _ = kv_BTNH.shape
        k_rope_BTNR = jnp.broadcast_to(k_rope_BTR[:, :, None], (b, t, n, r))
        q_BTNH = jnp.concatenate([q_nope_BTNG, q_rope_BTNR], axis=-1)
        k_BTNH = constrain(jnp.concatenate([kv_BTNH[..., :g], k_rope_BTNR], axis=-1), HEADS)
        v_BTNW = kv_BTNH[..., g:]
        # one head width for the kernels: zero features change no score and no output, and the
        # query is scaled so that the kernel's 1/sqrt(width) gives this model's softmax scale
        width = max(g + r, w)
        q_BTNH, k_BTNH, v_BTNH = (
            _pad(a, width) for a in (q_BTNH * self._prescale(width), k_BTNH, v_BTNW)
        )
        out_BTNH = causal_attention(
            q_BTNH, k_BTNH, v_BTNH, positions_BT, seg_BT, self.kind(t, seg_BT is not None)
        )
        return out_BTNH[..., :w]

    def _prescale(self, width: int):
        factor = self.scale * math.sqrt(width)
        return 1.0 if factor == 1.0 else jnp.asarray(factor, self.dtype)

    def _absorbed(self, q_nope_BTNG, q_rope_BTNR, cache: LatentCache, positions_BT):
        """Decoding on the latent cache: W_k folded into the queries, W_v applied after the sum."""
        dt, g = self.dtype, self.dims[1]
        wkv_CNH = self.wkv_b_CNH[...].astype(dt)
        latent_BSC, k_rope_BSR = cache.latent.astype(dt), cache.k_rope.astype(dt)
        q_lat_BTNC = jnp.einsum("btng,cng->btnc", q_nope_BTNG, wkv_CNH[..., :g])
        s_BNTS = jnp.einsum(
            "btnc,bsc->bnts", q_lat_BTNC, latent_BSC, preferred_element_type=jnp.float32
        ) + jnp.einsum(
            "btnr,bsr->bnts", q_rope_BTNR, k_rope_BSR, preferred_element_type=jnp.float32
        )
        # slot s holds position s: a query at position p sees the slots at positions <= p
        s = latent_BSC.shape[1]
        seen_B1TS = visible(
            positions_BT[:, None, :, None], jnp.arange(s)[None, None, None, :], None, None, None
        )
        p_BNTS = jax.nn.softmax(jnp.where(seen_B1TS, s_BNTS * self.scale, -jnp.inf), axis=-1)
        o_lat_BTNC = jnp.einsum("bnts,bsc->btnc", p_BNTS.astype(dt), latent_BSC)
        return jnp.einsum("btnc,cnw->btnw", o_lat_BTNC, wkv_CNH[..., g:])


def _pad(x_BTNH, width: int):
    extra = width - x_BTNH.shape[-1]
    return x_BTNH if not extra else jnp.pad(x_BTNH, ((0, 0), (0, 0), (0, 0), (0, extra)))


def causal_attention(q_BTNH, k_BTNH, v_BTNH, positions_BT, segment_ids_BT, kind: str):
    """Causal attention by the paths models/attention.py takes: on an unsharded sequence in index
    order, jax.nn.dot_product_attention (causal by index, packed segments by a mask); a sharded
    (permuted) sequence or blockwise, masks from positions (models/context.py)."""
    if kind != "blockwise" and context_size() == 1:
        impl = {"dense": "xla", "cudnn": "cudnn", "jax": None}[kind]
        if segment_ids_BT is None:
            return jax.nn.dot_product_attention(
                q_BTNH, k_BTNH, v_BTNH, is_causal=True, implementation=impl
            )
        t = q_BTNH.shape[1]
        seen_TT = visible(jnp.arange(t)[:, None], jnp.arange(t)[None, :], None, None, None)
        same_B1TT = segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]
        return jax.nn.dot_product_attention(
            q_BTNH, k_BTNH, v_BTNH, mask=same_B1TT & seen_TT, implementation=impl
        )
    return context.attend(
        q_BTNH,
        k_BTNH,
        v_BTNH,
        positions_BT,
        segment_ids_BT,
        window=0,
        kind=context.by_positions(kind),
    )
