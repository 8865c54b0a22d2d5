"""The functional face of the model: params are a plain nested dict of arrays.

The trainer, checkpoints and converters only see `init`, `apply`, `param_axes` and
`abstract_params`; the NNX module graph is rebuilt from the dict inside each trace (trace-time
cost only), which keeps jitted steps on plain pytrees (the cheapest per-step path we measured).
"""
from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import KVCache
from models.config import ModelConfig
from models.pipeline import PipelineConfig
from models.transformer import Decoder

# Shardings come from the logical-axis table through jit out_shardings, not from Flax's eager
# per-variable constraints (which need a mesh while constructing and differ per trace level).
flax.config.update("flax_always_shard_variable", False)


@functools.lru_cache(maxsize=32)
def _graph(cfg: ModelConfig, dtype: str):
    abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def compute_dtype(cfg: ModelConfig) -> str:
    return cfg.compute_dtype(jax.default_backend())


def _module(cfg: ModelConfig, params: dict) -> Decoder:
    gdef, abstract_state = _graph(cfg, compute_dtype(cfg))
    state = jax.tree.map(lambda x: x, abstract_state)  # fresh Variables; replace_by_pure_dict mutates
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(gdef, state)


def init(cfg: ModelConfig, key: jax.Array) -> dict:
    """Fresh parameters (call under jit with out_shardings to create them already sharded)."""
    module = Decoder(cfg, compute_dtype(cfg), rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def abstract_params(cfg: ModelConfig) -> dict:
    """ShapeDtypeStructs of the params, without allocating anything."""
    state = nnx.state(nnx.merge(*_graph(cfg, compute_dtype(cfg))), nnx.Param)
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))


def param_axes(cfg: ModelConfig) -> dict:
    """The logical axis names of every parameter, same tree as the params."""
    state = nnx.state(nnx.merge(*_graph(cfg, compute_dtype(cfg))), nnx.Param)
    return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["out_sharding"]), state,
                        is_leaf=lambda v: isinstance(v, nnx.Variable)))


def apply(cfg: ModelConfig, params: dict, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
          cache: KVCache | None = None, segment_ids_BT: jax.Array | None = None):
    """tokens [B,T] -> (logits [B,T,V] float32, cache). With `segment_ids_BT` (packed sequences)
    a token attends only to earlier tokens of its own segment; positions then come from the batch
    (or restart at each segment when not given)."""
    logits_BTV, cache, _ = _module(cfg, params)(tokens_BT, positions_BT, cache, segment_ids_BT)
    return logits_BTV, cache


def forward(cfg: ModelConfig, params: dict, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
            segment_ids_BT: jax.Array | None = None, pipeline: PipelineConfig | None = None):
    """Training forward -> (logits [B,T,V] float32, MoE stats: dict of [L_moe, ...] arrays, {} if dense).
    `pipeline`: the schedule used when the mesh has a pipeline axis > 1."""
    logits_BTV, _, stats = _module(cfg, params)(tokens_BT, positions_BT, None, segment_ids_BT, pipeline=pipeline)
    return logits_BTV, stats


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
    """An empty stacked KV cache [L,B,S,K,H] for `length` positions."""
    dtype = jnp.dtype(dtype or compute_dtype(cfg))
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((cfg.n_layers,), jnp.int32))
