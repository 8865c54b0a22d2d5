"""Shared helpers of the parallel-equivalence tests (tests/test_equivalence_*.py): build a Trainer
on a mesh or on one device, run the real jitted train step on a fixed sequence of synthetic
batches, and compare losses, gradient norms, parameters and raw gradients leaf by leaf.

Everything runs in float32 (compute and parameters). The learning rate warms up over WARMUP
steps, so the steps compared afterwards apply full AdamW updates. Adam's eps
is 1e-3 instead of 1e-8 and clipping is off: Adam then stays linear in the small coordinates of
the gradient, so the parameters still show a gradient off by a constant factor (clipping and
Adam's normalisation would divide it out), and a near-zero coordinate whose sign is rounding
noise moves the parameter by ~lr x noise / eps instead of a full +-lr step."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from mesh.rules import axis_rules
from train.core import comm
from train.core.config import build
from train.core.setup import create_state, jit_step
from train.core.state import TrainState
from train.core.step import grads_loss_stats
from train.run.loop import Trainer

BATCH, SEQ = 8, 32
WARMUP, COMPARED = 2, 3  # steps run before the comparison starts, steps compared after it
# Where the math is the same the tolerance is float32 reduction order: relative 1e-5 of
# each value, plus an absolute floor of ATOL_FRAC x the leaf's largest magnitude for
# values that cross zero (a relative bound means nothing for an entry that is 1e-9 on one
# side and 0 on the other).
RTOL, ATOL_FRAC = 1e-5, 1e-6
# Parameters also get ADAM_ATOL x the learning rates applied so far: Adam divides each coordinate
# by sqrt(v) + eps, so for a coordinate near eps the rounding error of its gradient (ATOL_FRAC of
# the leaf) moves the parameter by up to lr x that error / eps, about 1e-4 of an update. A
# gradient off by a constant factor moves such coordinates by a sizeable share of lr instead.
ADAM_ATOL = 1e-4
# The compared programs compile at LLVM optimisation level 1 whatever the test process's default
# (tests/conftest.py): at level 0 the rounding of the sharded and the one-device programs drifted
# apart enough to move one parameter of a 5-step comparison 3x past its tolerance (Adam amplifies
# rounding where a gradient is near zero).
COMPARISON_COMPILE = {"xla_backend_optimization_level": 1}


def make_trainer(mesh: str, tmp_path, one_device: bool = False, **over) -> Trainer:
    """A Trainer of a float32 model on the first devices that `mesh` (all sizes given) spans;
    `one_device`: the reference on jax.devices()[:1]."""
    d = {
        "model.dtype": "float32",
        "model.param_dtype": "float32",
        "parallelism.mesh": mesh,
        "train.batch_size": BATCH,
        "train.seq_len": SEQ,
        "train.steps": WARMUP + COMPARED,
        "train.warmup_steps": WARMUP,
        "train.eps": 1e-3,
        "train.grad_clip": 0.0,
        "train.seed": 0,
        "train.eval_every": 0,
        "train.sample_tokens": 0,
        "logging.progress": False,
        "logging.tensorboard": False,
        "logging.run_dir": str(tmp_path),
    }
    d.update(over)
    sizes = [int(part.partition("=")[2]) for part in mesh.split(",") if part]
    n = 1 if one_device else math.prod(sizes) if sizes else len(jax.devices())
    return Trainer(build(d), devices=jax.devices()[:n])


def trainer_cache(tmp_path_factory, **base):
    """(mesh, one_device, overrides) -> make_trainer's Trainer with `base` and the overrides, each
    built once (a fixture's cache: every build compiles)."""
    cache = {}

    def get(mesh: str, one_device: bool = False, **over):
        key = (mesh, one_device, tuple(sorted(over.items())))
        if key not in cache:
            cache[key] = make_trainer(
                mesh, tmp_path_factory.mktemp("run"), one_device, **base, **over
            )
        return cache[key]

    return get


def synthetic_batches(vocab: int, n: int = WARMUP + COMPARED, seed: int = 0) -> list[dict]:
    """A different batch every step, the same sequence on every mesh."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tok = rng.integers(0, min(vocab, 256), (BATCH, SEQ + 1)).astype(np.int32)
        out.append(
            {
                "inputs": tok[:, :-1],
                "targets": tok[:, 1:],
                "weights": np.ones((BATCH, SEQ), np.float32),
            }
        )
    return out


def initial_params(tr: Trainer):
    """The seed's initial parameters, on the host (one sharded-init compile per model config)."""
    return jax.device_get(create_state(tr.setup).params)


def initial_state(tr: Trainer, params) -> TrainState:
    """A fresh state around host `params`, placed on the trainer's shardings: every mesh starts
    from the same bits without compiling its own init."""
    state = TrainState(
        step=np.zeros((), np.int32), params=params, opt_state=tr.setup.tx.init(params)
    )
    if tr.setup.sync.error_feedback:
        state = state.replace(
            residual=comm.init_residual(params, tr.setup.sync.replicas(tr.setup.mesh))
        )
    return jax.device_put(state, tr.setup.state_shardings)


def run_steps(tr: Trainer, batches: list[dict], params0) -> dict:
    """The real jitted step over `batches` from `params0` -> {"params0", "metrics": per step,
    "params": the params after each step, "state": the final state} (params and metrics on the
    host, fetched before the next step donates the state)."""
    state = initial_state(tr, params0)
    out = {"params0": jax.device_get(state.params), "metrics": [], "params": []}
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        step = (
            jit_step(tr.setup)
            .lower(state, jax.device_put(batches[0], tr.setup.batch_sharding))
            .compile(COMPARISON_COMPILE)
        )
        for b in batches:
            state, m = step(state, jax.device_put(b, tr.setup.batch_sharding))
            out["metrics"].append(jax.device_get(m))
            out["params"].append(jax.device_get(state.params))
    out["state"] = state
    return out


def gradients(tr: Trainer, params, batch: dict):
    """(mean loss, gradient pytree) of the objective the train step differentiates (cross-entropy
    + MoE balance losses), through train.core.step.grads_loss_stats on the trainer's mesh with its
    micro-batches, data-parallel axes and pipeline schedule; gradients laid out like the params."""
    t = tr.cfg.train
    fn = functools.partial(
        grads_loss_stats,
        tr.setup.model_cfg,
        micro_batches=t.micro_batches,
        dp_axes=tr.setup.dp_axes,
        pipeline=tr.cfg.pipeline,
    )
    param_sh = tr.setup.state_shardings.params
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        args = jax.device_put(params, param_sh), jax.device_put(batch, tr.setup.batch_sharding)
        loss, grads, _ = (
            jax.jit(
                lambda p, b: fn(p, b),
                in_shardings=(param_sh, tr.setup.batch_sharding),
                out_shardings=(None, param_sh, None),
            )
            .lower(*args)
            .compile(COMPARISON_COMPILE)(*args)
        )
    return float(loss), jax.device_get(grads)


def grads_and_loss(cfg, params, batch, micro_batches: int, dp_axes: tuple[str, ...] = ()):
    """The mean loss over all tokens and its gradient: train.core.step.grads_loss_stats without
    its statistics."""
    loss, grads, _ = grads_loss_stats(cfg, params, batch, micro_batches, dp_axes)
    return loss, grads


def assert_trees_close(
    got, want, what: str, rtol: float = RTOL, atol_frac: float = ATOL_FRAC, atol: float = 0.0
) -> None:
    """Leaf by leaf: |got - want| <= atol + atol_frac x max|want leaf| + rtol x |want|, naming the
    leaf."""
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), (what, len(got_leaves), len(want_leaves))
    for (path, g), w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, (what, jax.tree_util.keystr(path), g.shape, w.shape)
        np.testing.assert_allclose(
            g,
            w,
            rtol=rtol,
            atol=atol + atol_frac * float(np.abs(w).max()),
            err_msg=f"{what}: {jax.tree_util.keystr(path)}",
        )


def assert_runs_match(
    got: dict, want: dict, what: str, rtol: float = RTOL, atol_frac: float = ATOL_FRAC
) -> None:
    """Same start, then per step after the warm-up: loss, gradient norm and every parameter."""
    assert_trees_close(
        got["params0"], want["params0"], f"{what} initial params", rtol=0, atol_frac=0
    )
    losses = [float(m["loss"]) for m in want["metrics"]]
    assert np.all(np.isfinite(losses)), losses
    for i in range(WARMUP, WARMUP + COMPARED):
        g, w = got["metrics"][i], want["metrics"][i]
        assert float(w["lr"]) > 0, "the compared steps must update the parameters"
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(
                float(g[key]), float(w[key]), rtol=rtol, err_msg=f"{what} step {i + 1} {key}"
            )
        lr_sum = sum(float(m["lr"]) for m in want["metrics"][: i + 1])
        assert_trees_close(
            got["params"][i],
            want["params"][i],
            f"{what} params after step {i + 1}",
            rtol,
            atol_frac,
            atol=ADAM_ATOL * lr_sum,
        )
    moved = max(
        float(np.abs(a - b).max())
        for a, b in zip(
            jax.tree.leaves(want["params"][-1]), jax.tree.leaves(want["params"][WARMUP - 1])
        )
    )
    assert moved > 1e-4, "the parameters did not change over the compared steps"
