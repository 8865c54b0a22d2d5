"""GRPO's objective (--objective grpo; Shao et al. 2024, "DeepSeekMath: Pushing the Limits of
Mathematical Reasoning in Open Language Models", section 4.1): the group-relative advantages of
sampled completions, the clipped policy-gradient loss with the k3 KL estimate to a frozen
reference, and the batch the step trains on, built from the rollouts (train/run/rollouts.py).

A batch of B prompts x G completions is R = B G rows, row b G + g prompt b's completion g, each
the prompt followed by its completion from its start, right-padded: `inputs`, `targets`,
`weights` [R, T] (the weights: 1 on the completion's tokens, its EOS included, 0 on the prompt and
the padding) and `advantages` [R, T] (the row's advantage on every position: an [R, T] array splits
into micro-batches and over data-parallel replicas as the tokens do).

The sampling policy pi_old. With one update per rollout (--post.updates_per_rollout 1) it is the
parameters before the step, so its log-probabilities are the policy's own, held constant:
old = stop_gradient(logp), no second forward, and the ratio is 1. With N > 1 updates per rollout
(the paper's mu, TRL's num_iterations) the rollout's log-probabilities under the sampling policy
are computed once after sampling (`token_logps`, one forward without a gradient) and travel with
the batch as `old_logp` [R, T]; from the second update on the ratio differs from 1 and the clip
binds. `post/clip_fraction` and `post/ratio_mean` log how much.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import context
from models.config import ModelConfig
from models.pipeline import with_stat_terms
from train.core.batch_loss import moe_sums, split_micro
from train.core.pair_loss import sequence_logps_per_token
from train.core.post_sections import PostConfig

ADV_EPS = 1e-4  # the paper's normalisation (r - mean) / std, with eps where the group agrees


def group_advantages(rewards_BG: np.ndarray, eps: float = ADV_EPS) -> np.ndarray:
    """Outcome supervision's advantage: A_bg = (r_bg - mean_g r_b) / (std_g r_b + eps), float32
    [B, G] (the population std, as TRL; a group of equal rewards gets 0)."""
    r = np.asarray(rewards_BG, np.float64)
    mean, std = r.mean(-1, keepdims=True), r.std(-1, keepdims=True)
    return ((r - mean) / (std + eps)).astype(np.float32)


def token_objective(logp_RT, old_RT, ref_RT, adv_R, *, clip: float, kl_beta: float):
    """The per-token objective to minimise (the negative of the paper's eq. 3 integrand):

        ratio = exp(logp - old)
        pg = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)
        kl = exp(ref - logp) - (ref - logp) - 1          (k3: unbiased, >= 0)
        loss = pg + beta kl

    -> (loss [R, T], kl [R, T]); `ref_RT` None = no KL term (kl 0)."""
    ratio = jnp.exp(logp_RT - old_RT)
    adv = adv_R[:, None]
    pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    if ref_RT is None:
        return pg, jnp.zeros_like(pg)
    delta = ref_RT - logp_RT
    kl = jnp.exp(delta) - delta - 1
    return pg + kl_beta * kl, kl


def sequence_means(x_RT, weights_RT):
    """Each row's mean over its completion's tokens [R] (the paper's 1/|o_i| sum_t)."""
    return jnp.sum(x_RT * weights_RT, -1) / jnp.maximum(jnp.sum(weights_RT, -1), 1.0)


def grpo_terms(cfg: ModelConfig, post: PostConfig, params, batch: dict, ref=None):
    """-> (objective sum, (loss sum, row count, sums)) of a batch of rollouts, float32, in
    train/core/batch_loss.py's form: the loss of a row is its completion's mean token objective,
    and the step divides the sum over rows by their count (every micro-batch and replica summed):
    the mean over each response's tokens, then over the group and the batch (the paper's). `sums`
    holds `post/kl` (the rows' mean k3 KL, 0 without a reference). `ref`: the reference's
    parameters (--post.kl_beta > 0), never differentiated."""
    ref_RT = None
    if post.kl_beta > 0:
        ref_RT, _, _ = sequence_logps_per_token(cfg, jax.lax.stop_gradient(ref), batch)
        ref_RT = jax.lax.stop_gradient(ref_RT)
        # the reference's forward first, then the policy's (train/core/pair_loss.py says why)
        ref_RT, params = jax.lax.optimization_barrier((ref_RT, params))
    logp_RT, stats, rows = sequence_logps_per_token(cfg, params, batch)
    weights_RT = rows["weights"]
    if "old_logp" in rows:  # several updates per rollout: the sampling policy's, computed once
        old_RT = rows["old_logp"]
    else:  # the sampling policy is the parameters before this step: its own, held constant
        old_RT = jax.lax.stop_gradient(logp_RT)
    adv_R = rows["advantages"][:, 0]
    loss_RT, kl_RT = token_objective(
        logp_RT, old_RT, ref_RT, adv_R, clip=post.clip, kl_beta=post.kl_beta
    )
    loss_R = sequence_means(loss_RT, weights_RT)
    n = jnp.float32(loss_R.shape[0])
    loss_sum = jnp.sum(loss_R)
    weights = {"aux": n * cfg.aux_loss_coef, "z": n * cfg.z_loss_coef} if cfg.n_experts else {}
    ratio_RT, clipped_RT = clip_stats(logp_RT, old_RT, adv_R, post.clip)
    sums = {
        **moe_sums(stats, n),
        "post/kl": jnp.sum(sequence_means(kl_RT, weights_RT)),
        "post/clip_fraction": jnp.sum(sequence_means(clipped_RT, weights_RT)),
        "post/ratio_mean": jnp.sum(sequence_means(ratio_RT, weights_RT)),
    }
    return with_stat_terms(loss_sum, stats, weights), (loss_sum, n, sums)


def clip_stats(logp_RT, old_RT, adv_R, clip: float):
    """-> (the ratio pi / pi_old [R, T], 1.0 where the clip is the min's active branch [R, T]),
    constants: a token is clipped where its ratio left [1 - eps, 1 + eps] on the side its
    advantage pushes towards (ratio > 1 + eps with A > 0, ratio < 1 - eps with A < 0), where its
    gradient is 0 (TRL's clip_ratio/region_mean)."""
    ratio_RT = jnp.exp(jax.lax.stop_gradient(logp_RT) - old_RT)
    adv = adv_R[:, None]
    clipped = ((ratio_RT > 1 + clip) & (adv > 0)) | ((ratio_RT < 1 - clip) & (adv < 0))
    return ratio_RT, clipped.astype(jnp.float32)


def token_logps(cfg: ModelConfig, micro_batches: int, params, batch: dict):
    """Each target's log-probability [R, T] float32 of a batch of rollouts, in the batch's own
    order (a context axis's zigzag layout undone), no gradient: the sampling policy's
    log-probabilities (`old_logp`) when a rollout serves several updates. Computed over the step's
    micro-batches (rows m, m + M, ...: each spans every batch shard) so that its logits are no
    larger than the step's."""
    t = batch["inputs"].shape[1]
    rows = {k: batch[k] for k in ("inputs", "targets", "weights")}

    def one(mb):
        logp_RT, _, _ = sequence_logps_per_token(cfg, params, mb)
        n = context.context_size()
        if n > 1:  # back from the zigzag order of n shards
            logp_RT = jnp.take(logp_RT, jnp.asarray(np.argsort(context.zigzag(t, n))), axis=1)
        return logp_RT

    micro = jax.tree.map(lambda x: split_micro(x, micro_batches), rows)
    logp_MRT = jax.lax.map(one, micro)  # [M, R/M, T], micro-batch j holding rows j, j + M, ...
    r = rows["inputs"].shape[0]
    return jax.lax.stop_gradient(jnp.swapaxes(logp_MRT, 0, 1).reshape(r, t))


def abstract_rollouts(rows: int, seq_len: int, sharding, old_logp: bool = False) -> dict:
    """ShapeDtypeStructs of one global batch of rollouts (AOT compiles, `plan`); `old_logp`: with
    the sampling policy's log-probabilities (several updates per rollout)."""
    keys = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
    keys["advantages"] = jnp.float32
    if old_logp:
        keys["old_logp"] = jnp.float32
    return {
        k: jax.ShapeDtypeStruct((rows, seq_len), dt, sharding=sharding) for k, dt in keys.items()
    }


def completion_lengths(new_RN: np.ndarray, eos: int) -> np.ndarray:
    """Each completion's token count, its first EOS included (all N without one) [R]."""
    is_eos = new_RN == eos
    first = np.where(is_eos.any(-1), is_eos.argmax(-1) + 1, new_RN.shape[1])
    return first.astype(np.int64)


def rollout_rows(
    prompts_RP: np.ndarray,
    lengths_R: np.ndarray,
    new_RN: np.ndarray,
    adv_R: np.ndarray,
    seq_len: int,
    eos: int,
) -> dict[str, np.ndarray]:
    """Prompts [R, P] right-padded (`lengths_R` tokens each) and their completions [R, N] (each
    the tokens right after its prompt) -> the step's batch [R, T], T = seq_len: the sequence
    prompt + completion (cut after its first EOS) from its start, right-padded with EOS; weight 1
    on the completion's targets only; the row's advantage on every position."""
    r, n = new_RN.shape
    tokens = np.full((r, seq_len + 1), eos, np.int64)
    weights = np.zeros((r, seq_len + 1), np.float32)
    kept_R = completion_lengths(new_RN, eos)
    for i in range(r):
        p, k = int(lengths_R[i]), int(kept_R[i])
        tokens[i, :p] = prompts_RP[i, :p]
        tokens[i, p : p + k] = new_RN[i, :k]
        weights[i, p : p + k] = 1.0
    return {
        "inputs": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "weights": weights[:, 1:],
        "advantages": np.repeat(np.asarray(adv_R, np.float32)[:, None], seq_len, 1),
    }
