"""The functional face of the model: params are a plain nested dict of arrays.

The trainer, checkpoints and converters only see `init`, `apply`, `forward`, `param_axes`,
`abstract_params`, `init_cache` and the train step's `objective`, which dispatch on the config
(models/registry.py: the built-in decoder, or a registered model); the NNX module graph is rebuilt
from the dict inside each trace (trace-time cost only), which keeps jitted steps on plain pytrees
(the cheapest per-step path we measured).
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from errors import UserError
from models import layer_pattern, mla, registry
from models import pipeline as pipeline_lib
from models.attention import KVCache
from models.config import ModelConfig, PipelineConfig
from models.loss import token_xent
from models.pieces import layers_per_group, n_groups_and_tail
from models.transformer import Decoder, default_positions

# Shardings come from the logical-axis table through jit out_shardings, not from Flax's eager
# per-variable constraints (which need a mesh while constructing and differ per trace level).
flax.config.update("flax_always_shard_variable", False)


@functools.lru_cache(maxsize=32)
def _graph(cfg: ModelConfig, dtype: str):
    # Built without the caller's mesh: under one, nnx.eval_shape would turn each variable's logical
    # axis names into a sharding of that mesh (and fail on names that are not mesh axes). A step
    # traced under its mesh reaches here whenever this config's entry is new or was evicted.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        abstract = nnx.eval_shape(lambda: Decoder(cfg, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def compute_dtype(cfg: ModelConfig) -> str:
    return cfg.compute_dtype(jax.default_backend())


def compute_dtype_text(cfg: ModelConfig) -> str:
    """The start line's words for the compute dtype: `bfloat16 compute (auto: why)`."""
    dtype, why = cfg.compute_dtype_why(jax.default_backend())
    return f"{dtype} compute" + ("" if why == "set" else f" ({why})")


def module(cfg: ModelConfig, params: dict) -> Decoder:
    gdef, abstract_state = _graph(cfg, compute_dtype(cfg))
    # fresh Variables; replace_by_pure_dict mutates
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(gdef, state)


def _init(cfg: ModelConfig, key: jax.Array) -> dict:
    module = Decoder(cfg, compute_dtype(cfg), rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _param_axes(cfg: ModelConfig) -> dict:
    return _fresh_dicts(_decoder_leaves(cfg, compute_dtype(cfg))[1])


# `plan --search` asks for the same configs' shapes and axes thousands of times; rebuilding them
# from the module graph (an NNX flatten and merge each) was 70% of a 4,096-device search.
@functools.lru_cache(maxsize=64)
def _decoder_leaves(cfg: ModelConfig, dtype: str) -> tuple[dict, dict]:
    """(ShapeDtypeStructs, logical axes) of the built-in decoder's params; shared, never mutated."""
    state = nnx.state(nnx.merge(*_graph(cfg, dtype)), nnx.Param)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    axes = nnx.to_pure_dict(
        jax.tree.map(
            lambda v: tuple(v.get_metadata()["out_sharding"]),
            state,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    )
    return shapes, axes


def _fresh_dicts(tree: dict) -> dict:
    """A copy of the nested dicts around immutable leaves, so a caller may edit its own tree."""
    return {k: _fresh_dicts(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _apply(
    cfg: ModelConfig, params: dict, tokens_BT, positions_BT=None, cache=None, segment_ids_BT=None
):
    logits_BTV, cache, _ = module(cfg, params)(tokens_BT, positions_BT, cache, segment_ids_BT)
    return logits_BTV, cache


def _forward(cfg: ModelConfig, params: dict, tokens_BT, positions_BT, segment_ids_BT, pipeline):
    logits_BTV, _, stats = module(cfg, params)(
        tokens_BT, positions_BT, None, segment_ids_BT, pipeline=pipeline
    )
    return logits_BTV, stats


def _init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None):
    """KVCache [L, B, S, K, H]; S = length, or a window's ring of min(window, length) slots
    (models/window_cache.py). With a layer pattern, whose layers' S differ: a PatternCache."""
    dtype = jnp.dtype(dtype or compute_dtype(cfg))
    if cfg.latent_attention:  # the latent and the rotary key (models/mla.py)
        return mla.init_cache(cfg, batch, length, dtype)

    def empty(spec: layer_pattern.LayerSpec, lead: tuple[int, ...]) -> KVCache:
        slots = min(length, spec.window) if spec.window else length
        shape = (*lead, batch, slots, cfg.n_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros(lead, jnp.int32))

    specs = layer_pattern.layer_specs(cfg)
    if not cfg.layer_pattern:
        return empty(specs[0], (cfg.n_layers,))
    n_groups, tail = n_groups_and_tail(cfg)
    per_group = layers_per_group(cfg)
    return layer_pattern.PatternCache(
        tuple(empty(specs[j], (n_groups,)) for j in range(per_group)),
        tuple(empty(spec, ()) for spec in specs[n_groups * per_group :]),
    )


DECODER = registry.Model(
    init=_init, apply=_apply, param_axes=_param_axes, init_cache=_init_cache, forward=_forward
)


# -- the one dispatch point: every caller (trainer, plan, checkpoints, sampling) goes through these


def init(cfg: ModelConfig, key: jax.Array) -> dict:
    """Fresh parameters (call under jit with out_shardings to create them already sharded)."""
    return registry.lookup(cfg, DECODER).init(cfg, key)


def abstract_params(cfg: ModelConfig) -> dict:
    """ShapeDtypeStructs of the params, without allocating anything."""
    if registry.lookup(cfg, DECODER) is DECODER:  # the cached module graph: no init trace
        return _fresh_dicts(_decoder_leaves(cfg, compute_dtype(cfg))[0])
    return jax.eval_shape(lambda: init(cfg, jax.random.key(0)))


def param_axes(cfg: ModelConfig) -> dict:
    """The logical axis names of every parameter, same tree as the params."""
    return registry.lookup(cfg, DECODER).param_axes(cfg)


def apply(
    cfg: ModelConfig,
    params: dict,
    tokens_BT: jax.Array,
    positions_BT: jax.Array | None = None,
    cache: KVCache | None = None,
    segment_ids_BT: jax.Array | None = None,
):
    """tokens [B,T] -> (logits [B,T,V] float32, cache). With `segment_ids_BT` (packed sequences)
    a token attends only to earlier tokens of its own segment; positions then come from the batch
    (or restart at each segment when not given)."""
    return registry.lookup(cfg, DECODER).apply(
        cfg, params, tokens_BT, positions_BT, cache, segment_ids_BT
    )


def forward(
    cfg: ModelConfig,
    params: dict,
    tokens_BT: jax.Array,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    pipeline: PipelineConfig | None = None,
):
    """Training forward -> (logits [B,T,V] float32, MoE stats: dict of [L_moe, ...] arrays, {} if
    dense). `pipeline`: the schedule used when the mesh has a pipeline axis > 1."""
    impl = registry.lookup(cfg, DECODER)
    if impl.forward is None:
        return registry.default_forward(
            impl, cfg, params, tokens_BT, positions_BT, segment_ids_BT, pipeline
        )
    return impl.forward(cfg, params, tokens_BT, positions_BT, segment_ids_BT, pipeline)


def objective(
    cfg: ModelConfig,
    params: dict,
    batch: dict,
    *,
    pipeline: PipelineConfig | None = None,
    token_loss=None,
    stat_weights: dict | None = None,
    loss_chunk: int = 0,
):
    """The training objective of one batch -> (objective, loss sum, MoE stats: [L_moe, ...] arrays,
    {} if dense), float32. The loss sum is sum(per-token loss x batch["weights"]): cross-entropy, or
    `token_loss(logits_BTV, batch) -> loss_BT`; the objective adds, for each stat named in
    `stat_weights`, weight x its mean over the MoE layers. The built-in decoder runs through
    models/pipeline under `pipeline`'s schedule on a mesh with pipeline > 1, whichever schedule it
    is; `loss_chunk` > 0: the cross-entropy that many tokens at a time where the head sees the whole
    batch (models/loss.py). A registered model runs its own forward (`forward`)."""
    impl = registry.lookup(cfg, DECODER)
    if impl is DECODER:
        pieces, outer, stack = module(cfg, params).pieces(token_loss)
        if batch.get("positions") is None:
            positions = default_positions(batch.get("segment_ids"), batch["inputs"].shape)
            batch = {**batch, "positions": positions}
        return pipeline_lib.objective(
            pieces,
            (outer, stack),
            batch,
            pipeline=pipeline,
            stat_weights=stat_weights,
            loss_chunk=loss_chunk,
        )
    pipeline_lib.engine_for(cfg, pipeline)  # one line for a schedule it cannot run (explicit ones)
    logits_BTV, stats = forward(
        cfg, params, batch["inputs"], batch.get("positions"), batch.get("segment_ids"), pipeline
    )
    loss_BT = (
        token_xent(logits_BTV, batch["targets"])
        if token_loss is None
        else token_loss(logits_BTV, batch)
    )
    weights_BT = batch.get("weights")
    loss_sum = jnp.sum(loss_BT if weights_BT is None else loss_BT * weights_BT)
    return pipeline_lib.with_stat_terms(loss_sum, stats, stat_weights or {}), loss_sum, stats


def decodes(cfg: ModelConfig) -> bool:
    """Whether the model can generate (has a decoding cache): a registered one may not."""
    return registry.lookup(cfg, DECODER).init_cache is not None


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None):
    """An empty decoding cache for `length` positions (the decoder's: a stacked KV cache
    [L,B,S,K,H]); one line for a registered model that cannot decode."""
    impl = registry.lookup(cfg, DECODER)
    if impl.init_cache is None:
        raise UserError(
            f"model '{cfg.arch}' cannot generate text: it was registered without init_cache"
            f" (models.register(..., init_cache=...)); train it with --train.sample_tokens 0"
        )
    return impl.init_cache(cfg, batch, length, dtype)
