"""The pure train and eval steps: (state, batch) -> (state, metrics). No I/O here."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from mesh.rules import axis_rules, current_rules
from mesh.shard import constrain
from models import model as M
from models.config import ModelConfig
from train.state import TrainState

BATCH_BT = ("batch", "seq")


def loss_sums(cfg: ModelConfig, params, batch) -> tuple[jax.Array, jax.Array]:
    """-> (sum of token cross-entropies, number of tokens), in float32. Summing (not averaging)
    per micro-batch makes gradient accumulation exactly equal to one big batch."""
    logits_BTV, _ = M.apply(cfg, params, batch["inputs"])
    xent_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    weights_BT = batch.get("weights", jnp.ones_like(xent_BT))
    return jnp.sum(xent_BT * weights_BT), jnp.sum(weights_BT)


def _split_micro(x_BT: jax.Array, m: int) -> jax.Array:
    """[B,...] -> [M, B/M, ...] taking rows m, m+M, m+2M... into micro-batch m, so every micro-batch
    spans all batch shards (a plain reshape would put whole micro-batches on single shards)."""
    b = x_BT.shape[0]
    x = x_BT.reshape(b // m, m, *x_BT.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def grads_and_loss(cfg: ModelConfig, params, batch, micro_batches: int, dp_axes: tuple[str, ...] = ()):
    """Mean loss over all tokens and its gradient, accumulated over micro-batches in float32.

    `dp_axes`: the leading batch mesh axes that shard no parameter (plain data parallelism). With
    micro-batches, each such replica group keeps its own partial gradient sum ([n_dp, ...], sharded
    over dp_axes) and they are reduced once at the end, so the data-parallel all-reduce runs once
    per step rather than once per micro-batch (DDP's no_sync). Axes that do shard parameters
    (fsdp) reduce-scatter every micro-batch, as ZeRO-3 does, to keep gradients sharded.
    """
    def sums_and_grads(p, mb):
        (total, n), g = jax.value_and_grad(loss_sums, argnums=1, has_aux=True)(cfg, p, mb)
        return total, n, g

    if micro_batches == 1:
        total, n, g = sums_and_grads(params, batch)
        n = jnp.maximum(n, 1.0)
        return total / n, jax.tree.map(lambda x: x / n, g)

    micro = jax.tree.map(lambda x: _split_micro(x, micro_batches), batch)   # [M, B/M, ...]
    n_dp = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in dp_axes) if dp_axes else 1
    rules = current_rules()
    inner_rules = {**rules, "batch": tuple(a for a in rules["batch"] if a not in dp_axes)}
    if n_dp > 1:  # [M, B/M, ...] -> [M, n_dp, B/(M n_dp), ...]: dim 1 is the replica group
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0], n_dp, x.shape[1] // n_dp, *x.shape[2:]), micro)
        grad_fn = jax.vmap(sums_and_grads, in_axes=(None, 0), spmd_axis_name=dp_axes)
    else:
        grad_fn = sums_and_grads

    def body(carry, mb):
        total, n, g = carry
        with axis_rules(inner_rules):
            t_i, n_i, g_i = grad_fn(params, mb)
        return (total + t_i, n + n_i, jax.tree.map(jnp.add, g, g_i)), None

    lead = (n_dp,) if n_dp > 1 else ()
    zeros = (jnp.zeros(lead), jnp.zeros(lead), jax.tree.map(lambda p: jnp.zeros(lead + p.shape, jnp.float32), params))
    (total, n, g), _ = jax.lax.scan(body, zeros, micro)
    if n_dp > 1:  # the one data-parallel reduction of the step
        total, n, g = total.sum(0), n.sum(0), jax.tree.map(lambda x: x.sum(0), g)
    n = jnp.maximum(n, 1.0)
    return total / n, jax.tree.map(lambda x: x / n, g)


def train_step(cfg: ModelConfig, tx: optax.GradientTransformation, lr_schedule, micro_batches: int,
               dp_axes: tuple[str, ...], state: TrainState, batch) -> tuple[TrainState, dict]:
    loss, grads = grads_and_loss(cfg, state.params, batch, micro_batches, dp_axes)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr_schedule(state.step),
               # optax.apply_if_finite: updates skipped in a row / in total (non-finite gradients)
               "bad_in_a_row": opt_state.notfinite_count, "skipped_steps": opt_state.total_notfinite}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(cfg: ModelConfig, params, batch) -> tuple[jax.Array, jax.Array]:
    """-> (sum of cross-entropies, token count) for one held-out batch."""
    return loss_sums(cfg, params, batch)
