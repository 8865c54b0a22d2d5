"""The Mixture-of-Experts router: which experts each token goes to and with what weights, its
balance statistics, and the aux-loss-free bias update (DeepSeek-V3). Shape letters as in
models/moe.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from models.config import ModelConfig


def route(
    cfg: ModelConfig, x_BTD: jax.Array, router_DE: jax.Array, bias_E: jax.Array | None = None
):
    """float32 router -> (expert ids [B,T,J] int32, combine weights [B,T,J] float32, stats).

    softmax (Mixtral, Qwen3-MoE): top-k of the softmax; sigmoid (DeepSeek-V3): top-k of the sigmoid
    scores; the k weights renormalised (router_renorm) and scaled (router_scale). `bias_E`
    (aux-loss-free balancing) shifts only the choice of experts, never the weights; so does the
    group limit (router_groups: experts only from the router_topk_groups best groups). With k = 1
    nothing is renormalised (Switch), else the router would get no gradient. Stats are over all
    tokens: Switch load-balancing loss E * sum_e f_e P_e (f_e: share of assignments, P_e: mean
    router probability), z-loss mean(logsumexp(logits)^2), and assignments per expert."""
    e, k = cfg.n_experts, cfg.experts_per_token
    logits_BTE = jnp.einsum(
        "btd,de->bte",
        x_BTD.astype(jnp.float32),
        router_DE.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )
    probs_BTE = (
        jax.nn.softmax(logits_BTE, -1) if cfg.router == "softmax" else jax.nn.sigmoid(logits_BTE)
    )
    select_BTE = (
        probs_BTE if bias_E is None else probs_BTE + lax.stop_gradient(bias_E.astype(jnp.float32))
    )
    if cfg.router_groups > 1:
        select_BTE = best_groups(select_BTE, cfg.router_groups, cfg.router_topk_groups)
    idx_BTJ = top_k(select_BTE, k)
    gate_BTJ = jnp.take_along_axis(probs_BTE, idx_BTJ, axis=-1)
    if k > 1 and cfg.router_renorm:
        gate_BTJ = gate_BTJ / jnp.sum(gate_BTJ, -1, keepdims=True)
    if cfg.router_scale != 1.0:
        gate_BTJ = gate_BTJ * cfg.router_scale
    counts_E = jnp.sum(jax.nn.one_hot(idx_BTJ, e, dtype=jnp.float32), axis=(0, 1, 2))
    share_BTE = (
        probs_BTE if cfg.router == "softmax" else probs_BTE / jnp.sum(probs_BTE, -1, keepdims=True)
    )
    n_assigned = idx_BTJ.size
    aux = e * jnp.sum(counts_E / n_assigned * jnp.mean(share_BTE, axis=(0, 1)))
    z = jnp.mean(jax.nn.logsumexp(logits_BTE, -1) ** 2)
    stats = {"aux": aux, "z": z, "counts": counts_E, "assigned": jnp.float32(n_assigned)}
    return idx_BTJ.astype(jnp.int32), gate_BTJ, stats


def best_groups(s_BTE: jax.Array, groups: int, keep: int) -> jax.Array:
    """Group-limited routing (DeepSeek-V3): the experts in `groups` equal groups, each scored by
    the sum of its two highest scores; the scores outside the `keep` best groups become -inf, so
    that top-k picks only inside them."""
    b, t, e = s_BTE.shape
    s_BTGX = s_BTE.reshape(b, t, groups, e // groups)
    score_BTG = jnp.sum(top_values(s_BTGX, 2), axis=-1)
    chosen_BTG = jnp.sum(jax.nn.one_hot(top_k(score_BTG, keep), groups, dtype=jnp.int32), -2) > 0
    return jnp.where(chosen_BTG[..., None], s_BTGX, -jnp.inf).reshape(b, t, e)


def top_values(s_BTGX: jax.Array, k: int) -> jax.Array:
    """The k largest entries along the last dim, by k maxima (as top_k, without an index)."""
    picks = []
    for _ in range(k):
        picks.append(jnp.max(s_BTGX, -1))
        first_BTG = jax.nn.one_hot(jnp.argmax(s_BTGX, -1), s_BTGX.shape[-1], dtype=jnp.bool_)
        s_BTGX = jnp.where(first_BTG, -jnp.inf, s_BTGX)
    return jnp.stack(picks, -1)


def top_k(s_BTE: jax.Array, k: int) -> jax.Array:
    """The k largest entries' indices, largest first, ties to the lower index (as lax.top_k), by k
    argmaxes: GSPMD all-gathers lax.top_k's operand over the batch (every device then ranks every
    token), while an argmax stays on each device's own tokens. k is a handful."""
    picks = []
    for _ in range(k):
        picks.append(jnp.argmax(s_BTE, -1).astype(jnp.int32))
        s_BTE = jnp.where(
            jax.nn.one_hot(picks[-1], s_BTE.shape[-1], dtype=jnp.bool_), -jnp.inf, s_BTE
        )
    return jnp.stack(picks, -1)


def bias_update(bias_LE: jax.Array, counts_LE: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 aux-loss-free balancing: raise the bias of under-loaded experts, lower the
    over-loaded ones, by a fixed step (the sign of the load error)."""
    err_LE = jnp.mean(counts_LE, -1, keepdims=True) - counts_LE
    return bias_LE + rate * jnp.sign(err_LE).astype(bias_LE.dtype)
