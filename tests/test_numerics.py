"""Training numerics: every compute/parameter dtype pair trains (or is refused in one line), the
optimizer runs in float32 under low-precision weights, and the logged learning rate is the one
the optimizer applied (warm-up starts above 0, skipped steps do not advance the schedule)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from errors import UserError
from mesh.rules import axis_rules
from models import model as model_lib
from models.config import DTYPES
from train.core import optim
from train.core import state as train_state
from train.core.config import TrainConfig, build
from train.core.setup import jit_step
from train.run.loop import Trainer

PARAM_DTYPES = DTYPES[1:]  # "auto" is a compute dtype only
COMPUTE_DTYPES = [
    d for d in DTYPES if d != "auto"
]  # auto resolves to one of these (float32 on CPU)
WARMUP = 4
FAST_COMPILE = {
    "xla_backend_optimization_level": 0
}  # these tests check dtypes and counts, not speed


def _trainer(**model) -> Trainer:
    """A one-layer tiny model on one device: these tests are about dtypes and counts, not layout."""
    cfg = build(
        {
            "model.preset": "tiny",
            "model.n_layers": 1,
            "model.remat": "none",
            "train.steps": 20,
            "train.lr": 1e-2,
            "train.warmup_steps": WARMUP,
            "train.batch_size": 4,
            "train.seq_len": 16,
            "parallelism.mesh": "data=1",
            **{f"model.{k}": v for k, v in model.items()},
        }
    )
    return Trainer(cfg, devices=jax.devices()[:1])


@functools.cache
def _initial_params() -> dict:
    """float32 initial weights, drawn once: every dtype pair starts from these, cast (an init per
    pair would cost a compile each and test nothing this file is about)."""
    cfg = _trainer().setup.model_cfg
    return (
        jax.jit(lambda k: model_lib.init(cfg, k))
        .lower(jax.random.key(0))
        .compile(FAST_COMPILE)(jax.random.key(0))
    )


def _fresh_state(tr: Trainer) -> train_state.TrainState:
    # a copy even where the dtype is unchanged: from_params donates (deletes) what it is given
    cast = jax.tree.map(
        lambda x: x.astype(tr.setup.model_cfg.param_dtype, copy=True), _initial_params()
    )
    return train_state.from_params(
        tr.setup.model_cfg, tr.setup.tx, tr.setup.mesh, tr.setup.rules, cast
    )


def _batch(tr: Trainer, poison: bool = False) -> dict:
    """One fixed batch (the same every step, so a falling loss means the steps fit it); `poison`:
    NaN loss weights, which make every gradient non-finite."""
    toks = np.random.default_rng(0).integers(0, 256, (4, 17)).astype(np.int32)
    weights = np.full((4, 16), np.nan if poison else 1.0, np.float32)
    return jax.device_put(
        {"inputs": toks[:, :-1], "targets": toks[:, 1:], "weights": weights},
        tr.setup.batch_sharding,
    )


@functools.cache
def _run(dtype: str, param_dtype: str):
    """(trainer, run) for one dtype pair, the run's own jitted step compiled once per pair;
    run(state, batches) -> (state, [metrics as floats])."""
    tr = _trainer(dtype=dtype, param_dtype=param_dtype)
    state = _fresh_state(tr)
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        step = jit_step(tr.setup).lower(state, _batch(tr)).compile(FAST_COMPILE)

    def run(state, batches):
        out = []
        for b in batches:
            state, m = step(state, b)
            out.append({k: float(v) for k, v in m.items()})
        return state, out

    return tr, run


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
def test_every_dtype_pair_trains(dtype, param_dtype):
    if dtype == "float16" and jax.default_backend() == "cpu":
        pytest.skip("float16 compute is refused on CPU (see the test below)")
    tr, run = _run(dtype, param_dtype)
    state = _fresh_state(tr)
    before = _leaves(state.params)
    state, ms = run(state, [_batch(tr)] * 3)
    assert [m["skipped_steps"] for m in ms] == [0, 0, 0], ms
    assert all(np.isfinite(m["loss"]) for m in ms) and ms[2]["loss"] < ms[0]["loss"] - 0.05, ms
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(param_dtype)}
    # both Adam moments in float32 whatever the weights are (see optim.in_float32)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert len(moments) == 2 * len(before) and {x.dtype for x in moments} == {jnp.dtype("float32")}
    # every weight moved
    assert all(not np.array_equal(a, b) for a, b in zip(before, _leaves(state.params)))


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
def test_float16_compute_is_refused_on_cpu_in_one_line(param_dtype):
    """XLA:CPU has no float16 matmul accumulating in float32: the first step would die in a trace.
    The refusal comes before anything compiles, as one line naming the valid choices."""
    if jax.default_backend() != "cpu":
        pytest.skip("float16 compute runs on accelerators (covered by the dtype-pair test there)")
    with pytest.raises(UserError) as err:
        _trainer(dtype="float16", param_dtype=param_dtype)
    msg = str(err.value)
    assert "\n" not in msg and "float16" in msg and "bfloat16" in msg, msg


def test_bfloat16_weights_get_float32_moments_and_one_rounding():
    """Adam's first update is -lr * sign(g). With lr = 2^-9 + 2^-19 the float32 result 1 - lr lies
    just past the midpoint between the bfloat16 neighbours 1 and 1 - 2^-8, so rounding once moves
    the weight; rounding the update to bfloat16 first (2^-9) would land on the midpoint and round
    back to 1 (ties to even): the step would be lost."""
    lr = 2.0**-9 + 2.0**-19
    tx = optim.make(TrainConfig(lr=lr, warmup_steps=0, steps=10, grad_clip=0.0, weight_decay=0.0))
    params = {"w_DF": jnp.ones((2, 2), jnp.bfloat16)}
    state = tx.init(params)
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim} == {jnp.dtype("float32")}
    grads = {"w_DF": jnp.ones((2, 2), jnp.bfloat16)}
    # bfloat16 in: optax's cond used to refuse it
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert int(state.total_notfinite) == 0
    new = optax.apply_updates(params, updates)["w_DF"]
    assert new.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(new, np.float32), 1.0 - 2.0**-8)


def test_logged_lr_is_the_applied_rate_and_skips_do_not_advance_it():
    tr, run = _run("float32", "float32")  # the float32 pair's compiled step, shared
    sched = optim.schedule(tr.cfg.train)
    state = _fresh_state(tr)
    before = _leaves(state.params)
    good, bad = _batch(tr), _batch(tr, poison=True)
    state, ms = run(state, [good])
    # warm-up starts at lr / warmup_steps, so the very first step already moves the weights
    assert ms[0]["lr"] == pytest.approx(tr.cfg.train.lr / WARMUP, rel=1e-6)
    assert any(not np.array_equal(a, b) for a, b in zip(before, _leaves(state.params)))
    held = _leaves(state.params)
    state, ms = run(state, [bad])
    assert ms[0]["skipped_steps"] == 1 and not np.isfinite(ms[0]["loss"])
    # the skipped step applied nothing: lr 0, the weights as they were
    assert ms[0]["lr"] == 0.0 and all(
        np.array_equal(a, b) for a, b in zip(held, _leaves(state.params))
    )
    state, ms = run(state, [good, good])
    # the optimizer's count stood still: steps 3 and 4 apply the schedule at counts
    # 1 and 2, not 2 and 3
    assert [m["lr"] for m in ms] == pytest.approx([float(sched(1)), float(sched(2))], rel=1e-6)
    assert float(sched(2)) != pytest.approx(float(sched(3)), rel=1e-3)
    assert [m["skipped_steps"] for m in ms] == [1, 1] and int(state.step) == 4


def test_warmup_starts_above_zero():
    cfg = TrainConfig(lr=1e-2, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    s = optim.schedule(cfg)
    assert float(s(0)) == pytest.approx(1e-3, rel=1e-5)  # lr / warmup_steps
    assert float(s(10)) == pytest.approx(1e-2, rel=1e-5)
    # warm-up cut to steps - 1 = 4
    clipped = optim.schedule(TrainConfig(lr=1e-2, warmup_steps=30, steps=5))
    assert float(clipped(0)) == pytest.approx(1e-2 / 4, rel=1e-5)
    assert float(optim.schedule(TrainConfig(lr=1e-2, warmup_steps=0, steps=5))(0)) == pytest.approx(
        1e-2
    )
