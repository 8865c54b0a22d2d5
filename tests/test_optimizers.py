"""--optim.name (train.optimizer): each of AdamW, Adafactor, Lion, SGD and Muon, inside Brigade's
clipping, float32 and non-finite guards, equals optax's own transformation applied by hand,
trains the tiny model on a data=2,fsdp=2,model=2 mesh with its state sharded like the parameters
(Adafactor's factored statistics too), round-trips a checkpoint, and a bad name is one line.

The mesh runs share one compiled gradient program and jit only each optimizer's update: the
train step is generic over the transformation, so what differs between optimizers is there."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from equivalence import synthetic_batches

from checkpoint.layout import make_meta
from checkpoint.manager import Checkpointer
from errors import UserError
from mesh.build import make_mesh
from mesh.rules import axis_rules
from models import model
from models.presets import preset
from train.core import optim
from train.core.config import OPTIMIZERS, TrainConfig, build, from_args
from train.core.setup import abstract_state, setup
from train.core.state import TrainState
from train.core.step import grads_loss_stats
from train.run import resume

MESH = "data=2,fsdp=2,model=2"
# a rate each one learns with in a few steps (Adafactor's is relative to each parameter's RMS)
LR = {"adamw": 3e-3, "adafactor": 3e-2, "lion": 1e-3, "sgd": 0.5, "muon": 3e-3}
STEPS = 5
# The programs here compile at LLVM level 0 (a fifth less CPU): every comparison is between
# values of one program, or far from rounding (a loss that falls)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def config(name: str, **over):
    """The tiny model with one layer (the optimizers see the same kinds of parameters; the
    gradient program compiles in 40% less time)."""
    return build(
        {
            "model.preset": "tiny",
            "model.n_layers": 1,
            "model.dtype": "float32",
            "parallelism.mesh": MESH,
            "train.optimizer": name,
            "train.lr": LR[name],
            "train.warmup_steps": 0,
            "train.batch_size": 8,
            "train.seq_len": 32,
            **over,
        }
    )


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MESH)


@pytest.fixture(scope="module")
def runs(mesh):
    """name -> (its RunSetup, the per-step losses, the final state): STEPS steps on one batch
    (learnable in a few steps) from the same initial parameters, on the mesh. One program takes
    the five updates (compiling them together costs 40% less than one by one)."""
    setups = {name: setup(config(name), mesh) for name in OPTIMIZERS}
    base = setups["adamw"]
    param_sh = base.state_shardings.params
    grad_fn = functools.partial(
        grads_loss_stats, base.model_cfg, micro_batches=1, dp_axes=base.dp_axes
    )
    params_sh = {n: s.state_shardings.params for n, s in setups.items()}
    opt_sh = {n: s.state_shardings.opt_state for n, s in setups.items()}
    update = jax.jit(
        lambda ps, os, gs: {n: _apply(s.tx, ps[n], os[n], gs[n]) for n, s in setups.items()},
        in_shardings=(params_sh, opt_sh, params_sh),
        out_shardings={n: (params_sh[n], opt_sh[n]) for n in setups},
        donate_argnums=(0, 1),
    )
    params0 = host_params(model.abstract_params(base.model_cfg))
    params = {n: jax.device_put(params0, params_sh[n]) for n in setups}
    opt_states = {n: jax.device_put(s.tx.init(params0), opt_sh[n]) for n, s in setups.items()}
    losses = {n: [] for n in setups}
    with jax.set_mesh(mesh), axis_rules(base.rules):
        grads = jax.jit(
            lambda p, b: grad_fn(p, b)[:2],
            in_shardings=(param_sh, base.batch_sharding),
            out_shardings=(None, param_sh),
        )
        batch = jax.device_put(
            synthetic_batches(base.model_cfg.vocab_size, 1)[0], base.batch_sharding
        )
        grads = grads.lower(params["adamw"], batch).compile(FAST_COMPILE)
        update = update.lower(params, opt_states, params).compile(FAST_COMPILE)
        for _ in range(STEPS):
            gs = {}
            for n in setups:
                loss, gs[n] = grads(params[n], batch)
                losses[n].append(float(loss))
            new = update(params, opt_states, gs)
            params, opt_states = {n: new[n][0] for n in setups}, {n: new[n][1] for n in setups}
    step = jax.device_put(np.int32(STEPS), base.state_shardings.step)
    return {
        n: (s, losses[n], TrainState(step=step, params=params[n], opt_state=opt_states[n]))
        for n, s in setups.items()
    }


def host_params(abstract, seed=0):
    """Parameters like the model's initial ones (norm scales 1, weights N(0, 0.02)) in host memory,
    without compiling an init: each run donates its own device copy."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: (
            np.ones(a.shape, np.float32)
            if "norm" in jax.tree_util.keystr(path)
            else rng.standard_normal(a.shape, np.float32) * 0.02
        ),
        abstract,
    )


def _apply(tx, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_trains_on_a_mesh(runs, name):
    _, losses, state = runs[name]
    # measured: 5.59 -> 4.0 (sgd) to 5.27 (adafactor) after 4 updates
    assert losses[-1] < losses[0] - 0.2, losses
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))
    assert int(state.opt_state.notfinite_count) == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_is_sharded_like_the_params(runs, name):
    """Every state array of a parameter's shape lies exactly as the parameter does (so never
    replicated where the parameter is sharded): the planned shardings and the trained arrays."""
    s, _, state = runs[name]
    params = {tuple(path): p for path, p in jax.tree_util.tree_leaves_with_path(state.params)}
    checked = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
        own = next(
            (params[tuple(path[k:])] for k in range(len(path)) if tuple(path[k:]) in params), None
        )
        if own is not None and leaf.shape == own.shape:
            assert leaf.sharding.is_equivalent_to(own.sharding, leaf.ndim), jax.tree_util.keystr(
                path
            )
            checked += own.sharding.spec != jax.P()
    assert (
        checked >= 8
    )  # the sharded matrices' moments (SGD/Lion/Adafactor: one per matrix; Adam: two)


def test_adafactor_factored_statistics_sharded_without_the_dropped_dim(mesh):
    """At d_model 128 the matrices are factored (optax: both dims >= 128): a row statistic is
    the parameter's sharding without the dim it averages out (the state shardings are planned
    from shapes alone: nothing is compiled)."""
    s = setup(config("adafactor", **{"model.d_model": 128, "model.d_ff": 384}), mesh)
    params = model.abstract_params(s.model_cfg)
    param_sh = {
        tuple(p): sh for p, sh in jax.tree_util.tree_leaves_with_path(s.state_shardings.params)
    }
    state = jax.eval_shape(s.tx.init, params)
    factored = 0
    for (path, leaf), sh in zip(
        jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(s.state_shardings.opt_state)
    ):
        sh.shard_shape(leaf.shape)  # a valid layout of this shape (raises if it does not divide)
        if {"v_row", "v_col"} & {getattr(k, "name", "") for k in path} and leaf.size > 1:
            param_path = next(
                tuple(path[k:]) for k in range(len(path)) if tuple(path[k:]) in param_sh
            )
            p_shape, p_spec = _shape_at(params, param_path), tuple(param_sh[param_path].spec)
            p_spec += (None,) * (len(p_shape) - len(p_spec))
            dropped = next(
                d
                for d in reversed(range(len(p_shape)))
                if p_shape[:d] + p_shape[d + 1 :] == leaf.shape
            )
            spec = tuple(sh.spec) + (None,) * (leaf.ndim - len(sh.spec))
            assert spec == p_spec[:dropped] + p_spec[dropped + 1 :], jax.tree_util.keystr(path)
            factored += 1
    assert factored >= 10  # rows and columns of the embedding, head, attention and MLP matrices


def _shape_at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tuple(tree.shape)


def _reference(name: str, lr: float, wd: float, mask) -> optax.GradientTransformation:
    """optax's own, written out: b1 0.8, b2 0.9, eps 1e-7, decoupled decay lr x wd under the
    mask."""
    if name == "adamw":
        return optax.adamw(lr, b1=0.8, b2=0.9, eps=1e-7, weight_decay=wd, mask=mask)
    if name == "lion":
        return optax.lion(lr, b1=0.8, b2=0.9, weight_decay=wd, mask=mask)
    if name == "adafactor":
        return optax.adafactor(lr, weight_decay_rate=lr * wd, weight_decay_mask=mask)
    if name == "sgd":
        return optax.chain(optax.sgd(lr, momentum=0.8), optax.add_decayed_weights(-lr * wd, mask))
    return optax.chain(
        optax.contrib.muon(
            lr,
            beta=0.8,
            eps=1e-7,
            adam_b1=0.8,
            adam_b2=0.9,
            consistent_rms=0.2,
            muon_weight_dimension_numbers=optim.muon_dims,
        ),
        optax.add_decayed_weights(-lr * wd, mask),
    )


# A model's parameter tree in miniature (its names decide the decay mask and Muon's matrices): the
# comparison is of the transformations, and a small tree compiles in a fraction of the time.
SMALL = {
    "blocks": {
        "attn": {
            "wq_DNH": jax.ShapeDtypeStruct((2, 16, 2, 8), np.float32),
            "wo_NHD": jax.ShapeDtypeStruct((2, 2, 8, 16), np.float32),
        },
        "mlp": {"w_up_DF": jax.ShapeDtypeStruct((2, 16, 24), np.float32)},
        "attn_norm": {"scale": jax.ShapeDtypeStruct((2, 16), np.float32)},
    },
    "embed_VD": jax.ShapeDtypeStruct((40, 16), np.float32),
    "lm_head_DV": jax.ShapeDtypeStruct((16, 40), np.float32),
}


@pytest.fixture(scope="module")
def by_hand():
    """name -> (params0, our params after each update, optax's by hand after each, our final
    state): on one device, two updates (the second reads the first's state) at a constant rate
    with clipping that binds; ours then takes a non-finite gradient. One program for all five."""
    rng = np.random.default_rng(0)
    params = host_params(SMALL, seed=1)
    grads = jax.tree.map(lambda p: rng.standard_normal((2, *p.shape), np.float32), params)
    with_nan = jax.tree.map(lambda g: np.concatenate([g, np.full_like(g[:1], np.nan)]), grads)
    mask = lambda p: optim.decay_mask(p, False)  # noqa: E731
    pairs = {
        name: (
            optim.make(
                TrainConfig(
                    optimizer=name,
                    lr=LR[name],
                    warmup_steps=0,
                    min_lr_ratio=1.0,
                    steps=10,
                    b1=0.8,
                    b2=0.9,
                    eps=1e-7,
                    weight_decay=0.1,
                    grad_clip=0.5,
                )
            ),
            optax.chain(optax.clip_by_global_norm(0.5), _reference(name, LR[name], 0.1, mask)),
        )
        for name in OPTIMIZERS
    }

    def updates(tx, params, grads_N):
        """params after each of the N updates [N, ...], and the final state."""

        def one(carry, g):
            p, state = _apply(tx, *carry, g)
            return (p, state), p

        (_, state), params_N = jax.lax.scan(one, (params, tx.init(params)), grads_N)
        return params_N, state

    def all_names(params, grads_N, with_nan_N):
        return {
            n: (*updates(ours, params, with_nan_N), updates(theirs, params, grads_N)[0])
            for n, (ours, theirs) in pairs.items()
        }

    out = (
        jax.jit(all_names)
        .lower(params, grads, with_nan)
        .compile(FAST_COMPILE)(params, grads, with_nan)
    )
    return {n: (params, ours_N, theirs_N, state) for n, (ours_N, state, theirs_N) in out.items()}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_equals_optax_by_hand(by_hand, name):
    params, ours_N, theirs_N, state = by_hand[name]
    for i in range(2):
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(ours_N), jax.tree.leaves(theirs_N)
        ):
            np.testing.assert_allclose(
                a[i],
                b[i],
                rtol=1e-6,
                atol=1e-7,
                err_msg=f"{name} update {i + 1} {jax.tree_util.keystr(path)}",
            )
    moved = max(
        float(np.abs(a[1] - b).max())
        for a, b in zip(jax.tree.leaves(ours_N), jax.tree.leaves(params))
    )
    assert moved > 1e-4, moved
    # the non-finite gradient: skipped, counted, the parameters as they were
    assert int(state.notfinite_count) == 1
    assert all(np.array_equal(a[2], a[1]) for a in jax.tree.leaves(ours_N))


def test_muon_orthogonalises_the_hidden_matrices_only():
    dims = optim.muon_dims(model.abstract_params(preset("moe-tiny")))
    blocks = dims["moe_blocks"]
    assert blocks["attn"]["wq_DNH"] == optax.contrib.MuonDimensionNumbers(
        (1,), (2, 3)
    )  # [L, D, N, H]
    assert blocks["attn"]["wo_NHD"] == optax.contrib.MuonDimensionNumbers((1, 2), (3,))
    assert blocks["moe"]["w_down_EFD"] == optax.contrib.MuonDimensionNumbers(
        (2,), (3,)
    )  # experts: a batch dim
    assert blocks["moe"]["w_up_EDF"] == optax.contrib.MuonDimensionNumbers((2,), (3,))
    # AdamW (inside optax's Muon) for the embeddings, the head, norms and the router
    assert (
        dims["embed_VD"] is None
        and dims["lm_head_DV"] is None
        and dims["final_norm"]["scale"] is None
    )
    assert blocks["moe"]["router_DE"] is None and blocks["attn_norm"]["scale"] is None


@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_checkpoint_round_trip(runs, name, tmp_path):
    """The trained state saved and restored through the resume path, onto the same shardings."""
    s, _, state = runs[name]
    saver = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    saver.save(STEPS, state, make_meta(STEPS, s.cfg.to_dict(), s.mesh, seed=0))
    restored, _ = resume.restore(s, abstract_state(s), saver, STEPS)
    saver.close()
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(state.opt_state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bad_name_is_one_line():
    want = r"^--optim.name 'adam': valid: adamw, adafactor, lion, sgd, muon$"
    with pytest.raises(UserError, match=want):
        from_args(["--model", "tiny", "--optim.name", "adam"])
    with pytest.raises(UserError, match=want):
        build({"train.optimizer": "adam"})
    with pytest.raises(UserError, match=want):
        optim.make(dataclasses.replace(TrainConfig(), optimizer="adam"))
    assert from_args(["--model", "tiny", "--optim.name", "lion"])[0].train.optimizer == "lion"


def test_a_code_optimizer_does_not_silently_replace_a_named_one():
    with pytest.raises(
        UserError, match="^optimizer=: replaces the configured optimizer; leave --optim.name"
    ):
        optim.make(TrainConfig(optimizer="lion"), optimizer=optax.sgd(0.1))
