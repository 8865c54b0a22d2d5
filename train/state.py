"""The train state (step, params, optimizer state), created already sharded on the mesh."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mesh.rules import axis_rules
from mesh.shard import tree_shardings
from models import model as M
from models.config import ModelConfig


@flax.struct.dataclass
class TrainState:
    step: jax.Array      # int32 scalar: optimizer updates applied so far
    params: Any          # nested dict of arrays, sharded by the logical-axis rules
    opt_state: Any       # optax state; moments sharded exactly like params


def shardings(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, rules) -> TrainState:
    """A TrainState of NamedShardings: params from the rules, optimizer moments like their params,
    scalars (counts, step) replicated."""
    param_sh = tree_shardings(mesh, M.param_axes(cfg), rules)
    abstract_opt = jax.eval_shape(tx.init, M.abstract_params(cfg))
    replicated = NamedSharding(mesh, P())
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                   transform_non_params=lambda _: replicated,
                                   is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh)


def abstract(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, rules) -> TrainState:
    """ShapeDtypeStructs with shardings: what `plan` compiles against, without allocating."""
    sh = shardings(cfg, tx, mesh, rules)
    shapes = jax.eval_shape(lambda: _fresh(cfg, tx, jax.random.key(0)))
    return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, sh)


def _fresh(cfg: ModelConfig, tx, key) -> TrainState:
    params = M.init(cfg, key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def create(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, rules, seed: int) -> TrainState:
    """Initialise under jit with output shardings: every device only ever holds its own shards."""
    sh = shardings(cfg, tx, mesh, rules)
    with jax.set_mesh(mesh), axis_rules(rules):
        return jax.jit(lambda k: _fresh(cfg, tx, k), out_shardings=sh)(jax.random.key(seed))
