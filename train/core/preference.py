"""Preference losses, per pair: each takes the sequence log-probabilities of the chosen (w, the
preferred) and rejected (l) responses under the policy pi (and, where it has one, the frozen
reference pi_ref) and returns (loss_B, chosen reward_B, rejected reward_B), float32. A sequence
log-probability is the sum of the response's token log-probabilities (the prompt's tokens are
masked out); `n_*` are the responses' token counts, for the length-normalised losses. The
rewards are each loss's implicit reward, logged (their margin and how often the chosen one is
higher, the accuracy); the step takes the mean loss over pairs (train/core/pair_loss.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def dpo(
    logp_w_B, logp_l_B, ref_w_B, ref_l_B, *, beta: float, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Direct Preference Optimization (Rafailov et al. 2023, "Direct Preference Optimization: Your
    Language Model is Secretly a Reward Model"), the sigmoid loss:

        h = (log pi(w) - log pi_ref(w)) - (log pi(l) - log pi_ref(l))
        loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)

    eps (`label_smoothing`) > 0 is conservative DPO (Mitchell 2023): the labels are assumed
    flipped with probability eps. Rewards: beta (log pi - log pi_ref)."""
    reward_w, reward_l = beta * (logp_w_B - ref_w_B), beta * (logp_l_B - ref_l_B)
    margin = reward_w - reward_l
    loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(
        margin
    ) - label_smoothing * jax.nn.log_sigmoid(-margin)
    return loss, reward_w, reward_l


def ipo(logp_w_B, logp_l_B, ref_w_B, ref_l_B, *, tau: float) -> tuple[jax.Array, ...]:
    """Identity Preference Optimisation (Azar et al. 2023, "A General Theoretical Paradigm to
    Understand Learning from Human Preferences"), the squared loss that regresses the log-ratio
    margin onto a fixed target instead of pushing it to infinity:

        h = (log pi(w) - log pi_ref(w)) - (log pi(l) - log pi_ref(l))
        loss = (h - 1 / (2 tau))^2

    with whole-sequence log-probabilities as in the paper. Rewards: tau (log pi - log pi_ref)."""
    h = (logp_w_B - ref_w_B) - (logp_l_B - ref_l_B)
    return (h - 1 / (2 * tau)) ** 2, tau * (logp_w_B - ref_w_B), tau * (logp_l_B - ref_l_B)


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurately on both sides of -log 2 (Maechler 2012); x is held
    below -1e-6 first: at x = 0 (a response of probability 1 in float32) it is -inf."""
    x = jnp.minimum(x, -1e-6)
    return jnp.where(x > -math.log(2), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo(
    logp_w_B, logp_l_B, n_w_B, n_l_B, *, lam: float, beta: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Odds Ratio Preference Optimization (Hong et al. 2024, "ORPO: Monolithic Preference
    Optimization without Reference Model"): supervised NLL on the chosen response plus an
    odds-ratio term, no reference model. With the length-normalised log-probabilities
    a = log pi(y) / |y| and odds(y) = P / (1 - P), P = exp(a):

        log OR = (a_w - a_l) - (log(1 - exp(a_w)) - log(1 - exp(a_l)))
        loss = -a_w - lambda log sigmoid(log OR)

    Rewards: beta a (as TRL logs them)."""
    a_w, a_l = logp_w_B / n_w_B, logp_l_B / n_l_B
    log_odds = (a_w - a_l) - (log1mexp(a_w) - log1mexp(a_l))
    return -a_w - lam * jax.nn.log_sigmoid(log_odds), beta * a_w, beta * a_l


def simpo(
    logp_w_B, logp_l_B, n_w_B, n_l_B, *, beta: float, gamma: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Simple Preference Optimization (Meng et al. 2024, "SimPO: Simple Preference Optimization
    with a Reference-Free Reward"): the length-normalised log-probability as the reward, a target
    margin gamma, no reference model:

        r(y) = beta / |y| log pi(y)
        loss = -log sigmoid(r(w) - r(l) - gamma)"""
    reward_w, reward_l = beta * logp_w_B / n_w_B, beta * logp_l_B / n_l_B
    return -jax.nn.log_sigmoid(reward_w - reward_l - gamma), reward_w, reward_l
