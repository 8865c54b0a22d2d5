"""Grouped-query causal self-attention with rotary embeddings and an optional KV cache; optional
q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), a sliding window (Mistral), and Gemma's
query_pre_attn_scalar and soft-capped scores; the window and RoPE of each layer may come from its
LayerSpec (models/layer_pattern.py)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mesh.rules import logical_to_spec
from mesh.shard import axes_size, constrain
from models import context, dense_attention, fp8, layer_pattern, window_cache
from models.adapters import frozen, with_adapters
from models.blockwise import visible
from models.config import ModelConfig
from models.context import context_size
from models.layers import RMSNorm, param, rope


class KVCache(NamedTuple):
    """Per-layer cache. k/v: [B,S,K,H] with S = cache length; `index`: next write position."""

    k: jax.Array
    v: jax.Array
    index: jax.Array


def fused_qkv(n_kv_heads: int, mesh, rules=None) -> bool:
    """Whether q, k and v come from one einsum (Attention._qkv) on `mesh` (empty: no mesh) under
    `rules` (default: the ones in context): the rules cut query and KV heads alike, and into a
    number of shards that divides the KV heads, so each KV group's query heads share a shard."""
    if mesh.empty:
        return True
    (heads,), (kv,) = logical_to_spec(("heads",), rules), logical_to_spec(("kv_heads",), rules)
    return heads == kv and n_kv_heads % axes_size(mesh, kv) == 0


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq_DNH = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), param_dtype, fan_in=d)
        self.wk_DKH = param(
            rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype, fan_in=d
        )
        self.wv_DKH = param(
            rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype, fan_in=d
        )
        self.wo_NHD = param(
            rngs, (n, h, d), ("heads", "head_dim", "embed"), param_dtype, fan_in=n * h
        )
        if cfg.qkv_bias:  # sharded as the projections' output dims
            self.bq_NH = param(rngs, (n, h), ("heads", "head_dim"), param_dtype, zeros=True)
            self.bk_KH = param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, zeros=True)
            self.bv_KH = param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, zeros=True)
        if cfg.qk_norm:  # one scale per head feature, shared by all heads (Qwen3)
            self.q_norm = RMSNorm(
                h, cfg.norm_eps, param_dtype, rngs=rngs, plus_one=cfg.norm_plus_one
            )
            self.k_norm = RMSNorm(
                h, cfg.norm_eps, param_dtype, rngs=rngs, plus_one=cfg.norm_plus_one
            )
        self.spec = layer_pattern.spec(cfg, None)  # a layer's own spec may replace it per call
        self.qkv_bias, self.qk_norm = cfg.qkv_bias, cfg.qk_norm
        # scores scaled by query_pre_attn_scalar^-1/2, not head_dim^-1/2: queries times this factor
        # (every attention path then scales by head_dim^-1/2 as usual)
        self.q_factor = (h / cfg.query_pre_attn_scalar) ** 0.5 if cfg.query_pre_attn_scalar else 1.0
        self.softcap = cfg.attn_softcap
        self.dtype, self.fp8 = dtype, cfg.matmul_precision == "fp8"
        self.kind = functools.partial(cfg.attention_kind, jax.default_backend())
        # an attention this backend lacks: one line when the model is built
        self.kind(cfg.max_seq_len)

    def _qkv(self, x_BTD):
        """q, k, v from as few einsums as the sharding allows. Each einsum's input gradient is one
        partial sum that tensor parallelism all-reduces, so q, k and v from one einsum cost one
        all-reduce in the backward instead of three (Megatron's fused QKV, with the parameters kept
        apart). One einsum needs the query heads of a KV group on the same shard (the shard count
        divides K), else k and v share one and q has its own."""
        dt = self.dtype
        adapted = [w[...] for w in (self.wq_DNH, self.wk_DKH, self.wv_DKH)]
        wq, wk, wv = (frozen(w).astype(dt) for w in adapted)
        d, n, h = wq.shape
        k = wk.shape[1]
        if fused_qkv(k, jax.sharding.get_abstract_mesh()):
            # Q = N / K query heads per KV group, then that group's k and v: Q + 2 along one dim
            w_DKQH = jnp.concatenate(
                [wq.reshape(d, k, n // k, h), wk[:, :, None], wv[:, :, None]], axis=2
            )
            qkv_BTKQH = fp8.einsum("btd,dkqh->btkqh", x_BTD, w_DKQH, self.fp8)
            b, t = x_BTD.shape[:2]
            qkv = (
                qkv_BTKQH[..., :-2, :].reshape(b, t, n, h),
                qkv_BTKQH[..., -2, :],
                qkv_BTKQH[..., -1, :],
            )
        else:
            q_BTNH = fp8.einsum("btd,dnh->btnh", x_BTD, wq, self.fp8)
            # the stack next to the heads, as the MLP's: one plain matmul's output
            kv_BTZKH = fp8.einsum("btd,dzkh->btzkh", x_BTD, jnp.stack([wk, wv], axis=1), self.fp8)
            qkv = (q_BTNH, kv_BTZKH[:, :, 0], kv_BTZKH[:, :, 1])
        # a LoRA-adapted projection adds its adapters' term (models/adapters.py)
        return tuple(
            with_adapters(y, "btd,dnh->btnh", x_BTD, w) for y, w in zip(qkv, adapted, strict=True)
        )

    def _rotated_qkv(self, x_BTD, positions_BT, rope_args):
        """q, k, v with their biases, q/k norms and RoPE (`rope_args`: this layer's), the queries
        scaled for query_pre_attn_scalar, each constrained to its heads' sharding."""
        dt = self.dtype
        q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD)
        if self.qkv_bias:
            q_BTNH = q_BTNH + self.bq_NH[...].astype(dt)
            k_BTKH = k_BTKH + self.bk_KH[...].astype(dt)
            v_BTKH = v_BTKH + self.bv_KH[...].astype(dt)
        if self.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH = rope(q_BTNH, positions_BT, *rope_args)
        if self.q_factor != 1.0:
            q_BTNH = q_BTNH * jnp.asarray(self.q_factor, q_BTNH.dtype)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "act_heads", None))
        k_BTKH = constrain(
            rope(k_BTKH, positions_BT, *rope_args), ("batch", "seq", "act_kv_heads", None)
        )
        v_BTKH = constrain(v_BTKH, ("batch", "seq", "act_kv_heads", None))
        return q_BTNH, k_BTKH, v_BTKH

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        cache: KVCache | None = None,
        segment_ids_BT: jax.Array | None = None,
        spec: layer_pattern.LayerSpec | None = None,
    ):
        """`segment_ids_BT` (packed sequences): a query sees only earlier keys of its own
        segment. `spec`: this layer's window and RoPE (default: the config's)."""
        dt = self.dtype
        window, rope_args = spec or self.spec
        q_BTNH, k_BTKH, v_BTKH = self._rotated_qkv(x_BTD, positions_BT, rope_args)
        kind = self.kind(x_BTD.shape[1], segment_ids_BT is not None)
        if cache is None and kind != "blockwise" and context_size() == 1 and not self.softcap:
            out_BTNH = self._by_index(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, kind, window)
        elif cache is None:
            # the sequence is sharded (and permuted), or blockwise: masks from positions
            out_BTNH = context.attend(
                q_BTNH,
                k_BTKH,
                v_BTKH,
                positions_BT,
                segment_ids_BT,
                window=window,
                kind=context.by_positions(kind),
                softcap=self.softcap,
            )
        elif window or self.softcap:  # a ring of the window's positions, or capped scores
            out_BTNH, cache = window_cache.attend_and_write(
                q_BTNH, k_BTKH, v_BTKH, positions_BT, cache, window=window, softcap=self.softcap
            )
        else:
            cache = KVCache(
                jax.lax.dynamic_update_slice(
                    cache.k, k_BTKH.astype(cache.k.dtype), (0, cache.index, 0, 0)
                ),
                jax.lax.dynamic_update_slice(
                    cache.v, v_BTKH.astype(cache.v.dtype), (0, cache.index, 0, 0)
                ),
                cache.index + x_BTD.shape[1],
            )
            s = cache.k.shape[1]
            # Slot s holds the key of position s: a query at position p sees the cached
            # keys at positions <= p (slots past `index` are empty).
            mask_B1TS = visible(
                positions_BT[:, None, :, None],
                jnp.arange(s)[None, None, None, :],
                None,
                None,
                window,
            )
            out_BTNH = jax.nn.dot_product_attention(
                q_BTNH, cache.k.astype(dt), cache.v.astype(dt), mask=mask_B1TS
            )
        out_BTNH = constrain(out_BTNH, ("batch", "seq", "act_heads", None))
        wo = self.wo_NHD[...]
        out_BTD = fp8.einsum("btnh,nhd->btd", out_BTNH, frozen(wo).astype(dt), self.fp8)
        return with_adapters(out_BTD, "btnh,nhd->btd", out_BTNH, wo), cache

    def _by_index(self, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, kind: str, window: int):
        """Attention on an unsharded sequence in index order: causal by index (the masks XLA and
        cuDNN build themselves), packed segments by a [B,1,T,T] mask."""
        if kind == "dense":  # XLA's einsums, with a backward in the compute dtype
            t = q_BTNH.shape[1]
            seen_1TS = visible(
                jnp.arange(t)[None, :, None], jnp.arange(t)[None, None, :], None, None, window
            )
            if segment_ids_BT is not None:
                seen_1TS = seen_1TS & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
            return dense_attention.attend(q_BTNH, k_BTKH, v_BTKH, seen_1TS)
        impl = {"cudnn": "cudnn", "jax": None}[kind]
        if segment_ids_BT is None:
            # A window of W keys, the query's own included: W - 1 to the left, none to the right.
            return jax.nn.dot_product_attention(
                q_BTNH,
                k_BTKH,
                v_BTKH,
                is_causal=True,
                local_window_size=(window - 1, 0) if window else None,
                implementation=impl,
            )
        t = q_BTNH.shape[1]
        # within a segment, index distance is position distance: the window applies to it alike
        seen_TT = visible(jnp.arange(t)[:, None], jnp.arange(t)[None, :], None, None, window)
        same_B1TT = segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]
        return jax.nn.dot_product_attention(
            q_BTNH, k_BTKH, v_BTKH, mask=same_B1TT & seen_TT, implementation=impl
        )
