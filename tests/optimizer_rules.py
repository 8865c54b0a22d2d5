"""The optimizers' update rules as their papers state them, in float64 numpy, one parameter at a
time: the references tests/test_optimizers.py holds --optim.name's optimizers to. Nothing here
calls optax or train/core/optim.py.

Every rule takes the learning rate lr_t of its update and applies weight decay decoupled from the
gradient (Loshchilov & Hutter): the update also takes lr_t x weight_decay x x off each decayed
parameter (the papers' lambda is lr x weight_decay, --train.weight_decay being per unit rate, as in
PyTorch). Gradients are first clipped to a global norm over all parameters."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Jordan et al. 2024 (Muon): the quintic Newton-Schulz iteration's coefficients and step count
NS_COEFFS, NS_STEPS = (3.4445, -4.7750, 2.0315), 5
MUON_RMS = 0.2  # Liu et al. 2025: orthogonalised updates scaled to AdamW's RMS
# Shazeer & Stern 2018: second-moment decay 1 - t^-0.8, eps1 (added to g^2), eps2 (the floor of a
# parameter's RMS in the relative step), the update clipping threshold d, and the factoring rule
# (both of a parameter's two largest dims at least 128)
ADAFACTOR_DECAY_POW, ADAFACTOR_EPS1, ADAFACTOR_EPS2, ADAFACTOR_CLIP = 0.8, 1e-30, 1e-3, 1.0
ADAFACTOR_FACTOR_FROM = 128


@dataclasses.dataclass(frozen=True)
class Hyper:
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float


@dataclasses.dataclass(frozen=True)
class Leaf:
    """What the rules need to know of a parameter besides its values: whether it is decayed, and
    for Muon its matrix view (reduction axes, output axes; the rest are batch axes) or None."""

    decayed: bool
    matrix: tuple[tuple[int, ...], tuple[int, ...]] | None = None


def lr_at(count: int, lr: float, warmup_steps: int, steps: int, min_lr_ratio: float) -> float:
    """The documented schedule at the optimizer's update count (0 for the first update): a linear
    warm-up from lr / w to lr at count w, w = warmup_steps cut to steps - 1; then a cosine from lr
    at count w to lr x min_lr_ratio at count steps, and that floor after it."""
    w = min(warmup_steps, max(steps - 1, 0))
    if count < w:
        return lr / w + (lr - lr / w) * count / w
    end = lr * min_lr_ratio
    frac = min(count - w, steps - w) / max(steps - w, 1)
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * frac))


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(a * a)))


def adamw(state: dict, x, g, t: int, lr: float, hp: Hyper, leaf: Leaf):
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2) with bias-corrected moments."""
    m = state["m"] = hp.b1 * state.get("m", 0.0) + (1 - hp.b1) * g
    v = state["v"] = hp.b2 * state.get("v", 0.0) + (1 - hp.b2) * g * g
    m_hat, v_hat = m / (1 - hp.b1**t), v / (1 - hp.b2**t)
    return x - lr * m_hat / (np.sqrt(v_hat) + hp.eps) - _decay(x, lr, hp, leaf)


def nadamw(state: dict, x, g, t: int, lr: float, hp: Hyper, leaf: Leaf):
    """AdamW with Nesterov momentum (Dozat 2016): the first moment looks one step ahead, each term
    with its own bias correction. Muon's rule for the parameters it does not orthogonalise."""
    m = state["m"] = hp.b1 * state.get("m", 0.0) + (1 - hp.b1) * g
    v = state["v"] = hp.b2 * state.get("v", 0.0) + (1 - hp.b2) * g * g
    m_hat = hp.b1 * m / (1 - hp.b1 ** (t + 1)) + (1 - hp.b1) * g / (1 - hp.b1**t)
    v_hat = v / (1 - hp.b2**t)
    return x - lr * m_hat / (np.sqrt(v_hat) + hp.eps) - _decay(x, lr, hp, leaf)


def lion(state: dict, x, g, t: int, lr: float, hp: Hyper, leaf: Leaf):
    """Lion (Chen et al. 2023, Program 1): the sign of an interpolation of momentum and gradient;
    the momentum itself decays at b2."""
    m = state.get("m", 0.0)
    step = np.sign(hp.b1 * m + (1 - hp.b1) * g)
    state["m"] = hp.b2 * m + (1 - hp.b2) * g
    return x - lr * step - _decay(x, lr, hp, leaf)


def sgd(state: dict, x, g, t: int, lr: float, hp: Hyper, leaf: Leaf):
    """SGD with heavy-ball momentum b1: buf = b1 buf + g, x -= lr buf."""
    buf = state["buf"] = hp.b1 * state.get("buf", 0.0) + g
    return x - lr * buf - _decay(x, lr, hp, leaf)


def adafactor(state: dict, x, g, t: int, lr: float, hp: Hyper, leaf: Leaf):
    """Adafactor (Shazeer & Stern 2018, Algorithms 4 and 5) without momentum: the second moment
    factored into row and column means over a parameter's two largest dims when both are at least
    128 (leading dims are batch), else kept whole; decay 1 - t^-0.8; the update clipped to RMS d;
    the step relative to the parameter's RMS, with the schedule's rate as the paper's rho_t."""
    beta = 1 - t**-ADAFACTOR_DECAY_POW
    g2 = g * g + ADAFACTOR_EPS1
    dims = np.argsort(x.shape)[-2:] if x.ndim >= 2 else ()
    if len(dims) == 2 and min(x.shape[d] for d in dims) >= ADAFACTOR_FACTOR_FROM:
        row_axis, col_axis = int(min(dims)), int(max(dims))
        r = state["r"] = beta * state.get("r", 0.0) + (1 - beta) * g2.mean(col_axis, keepdims=True)
        c = state["c"] = beta * state.get("c", 0.0) + (1 - beta) * g2.mean(row_axis, keepdims=True)
        # the paper's V = R C / (1^T R) with row and column sums; with means it reads the same
        v = r * c / r.mean(row_axis, keepdims=True)
    else:
        v = state["v"] = beta * state.get("v", 0.0) + (1 - beta) * g2
    u = g / np.sqrt(v)
    u = u / max(1.0, _rms(u) / ADAFACTOR_CLIP)
    return x - lr * max(ADAFACTOR_EPS2, _rms(x)) * u - _decay(x, lr, hp, leaf)


def muon(state: dict, x, g, t: int, lr: float, hp: Hyper, leaf: Leaf):
    """Muon (Jordan et al. 2024) on the hidden matrices: Nesterov momentum b1, each matrix
    orthogonalised by the quintic Newton-Schulz iteration, scaled by 0.2 sqrt(max(fan_in, fan_out))
    (Liu et al. 2025); every other parameter by NAdamW. The Nesterov blend bias-corrects each of
    its two terms, as --optim.name muon is configured (optax's Muon); Jordan's reference code
    blends them uncorrected, which turns the update's direction from the second update on."""
    if leaf.matrix is None:
        return nadamw(state, x, g, t, lr, hp, leaf)
    b = hp.b1
    m = state["m"] = b * state.get("m", 0.0) + (1 - b) * g
    m_hat = b * m / (1 - b ** (t + 1)) + (1 - b) * g / (1 - b**t)
    red, out = leaf.matrix
    batch = tuple(a for a in range(x.ndim) if a not in red + out)
    order = batch + red + out
    fan_in, fan_out = (math.prod(x.shape[a] for a in axes) for axes in (red, out))
    mats = m_hat.transpose(order).reshape(-1, fan_in, fan_out)
    ortho = np.stack([newton_schulz(a, hp.eps) for a in mats])
    ortho = ortho.reshape([x.shape[a] for a in order]).transpose(np.argsort(order))
    ortho *= MUON_RMS * math.sqrt(max(fan_in, fan_out))
    return x - lr * ortho - _decay(x, lr, hp, leaf)


def newton_schulz(a: np.ndarray, eps: float) -> np.ndarray:
    """A matrix's orthogonalisation by NS_STEPS of X <- aX + (b XX^T + c (XX^T)^2) X from X =
    A / (|A|_F + eps), on the wide orientation (rows <= columns)."""
    wide = a.shape[0] <= a.shape[1]
    x = (a if wide else a.T) / (np.linalg.norm(a) + eps)
    c0, c1, c2 = NS_COEFFS
    for _ in range(NS_STEPS):
        xx = x @ x.T
        x = c0 * x + (c1 * xx + c2 * xx @ xx) @ x
    return x if wide else x.T


def _decay(x, lr: float, hp: Hyper, leaf: Leaf):
    return lr * hp.weight_decay * x if leaf.decayed else 0.0


RULES = {"adamw": adamw, "adafactor": adafactor, "lion": lion, "sgd": sgd, "muon": muon}


def run(
    name: str,
    params: dict[str, np.ndarray],
    grads_N: list[dict[str, np.ndarray]],
    leaves: dict[str, Leaf],
    hp: Hyper,
    lr_of_count,
) -> list[dict[str, np.ndarray]]:
    """`name`'s rule over the gradients in order, from `params` (flat dicts: name -> array) ->
    the parameters after each update, float64. Update t (1-based) applies lr_of_count(t - 1)."""
    rule, states = RULES[name], {k: {} for k in params}
    x = {k: np.asarray(v, np.float64) for k, v in params.items()}
    out = []
    for t, grads in enumerate(grads_N, start=1):
        g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
        norm = math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
        scale = min(1.0, hp.grad_clip / norm) if hp.grad_clip > 0 else 1.0
        lr = lr_of_count(t - 1)
        x = {k: rule(states[k], x[k], g[k] * scale, t, lr, hp, leaves[k]) for k in x}
        out.append(x)
    return out
