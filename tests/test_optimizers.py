"""--optim.name (train.optimizer): each of AdamW, Adafactor, Lion, SGD and Muon, inside Brigade's
clipping, float32 and non-finite guards and on its schedule, follows its paper's update rule
(written in numpy in tests/optimizer_rules.py) for 5 updates, the schedule follows its formula,
each trains the tiny model on a data=2,fsdp=2,model=2 mesh with its state sharded like the
parameters (Adafactor's factored statistics too), round-trips a checkpoint, and a bad name is one
line.

The mesh runs share one compiled gradient program and jit only each optimizer's update: the
train step is generic over the transformation, so what differs between optimizers is there."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import optimizer_rules as rules
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


# A model's parameter tree in miniature, each leaf with what the rules need to know of it,
# written here by hand (not read from train/core/optim.py): decayed or not (embeddings and norms
# are not), and for Muon its matrix view (reduction, output axes; the stacked-layer dim is a batch
# dim).
# w_down_FD's two largest dims are both >= 128: Adafactor factors its second moment (and Muon
# transposes it: 160 rows > 128 columns). A small tree compiles in a fraction of a model's time.
SMALL = {
    "blocks/attn/wq_DNH": ((2, 16, 2, 8), rules.Leaf(True, ((1,), (2, 3)))),
    "blocks/attn/wo_NHD": ((2, 2, 8, 16), rules.Leaf(True, ((1, 2), (3,)))),
    "blocks/mlp/w_up_DF": ((2, 16, 24), rules.Leaf(True, ((1,), (2,)))),
    "blocks/mlp/w_down_FD": ((2, 160, 128), rules.Leaf(True, ((1,), (2,)))),
    "blocks/attn_norm/scale": ((2, 16), rules.Leaf(False)),
    "embed_VD": ((40, 16), rules.Leaf(False)),
    "lm_head_DV": ((16, 40), rules.Leaf(True)),
}
# the hyperparameters of the comparison: none at its default, clipping that binds (the random
# gradients' global norm is ~200)
HYPER = rules.Hyper(b1=0.8, b2=0.9, eps=1e-7, weight_decay=0.1, grad_clip=0.5)
# a warm-up of 2 then the cosine to 0.1 lr at count 6: the 5 updates meet every part of the schedule
SCHEDULE = {"warmup_steps": 2, "steps": 6, "min_lr_ratio": 0.1}
UPDATES, SKIPPED_AT = 5, 2  # ours also gets a non-finite gradient before the third update
F32_EPS = float(np.finfo(np.float32).eps)


def _nested(flat: dict) -> dict:
    tree = {}
    for path, value in flat.items():
        *heads, last = path.split("/")
        node = tree
        for h in heads:
            node = node.setdefault(h, {})
        node[last] = value
    return tree


def _flat(tree, prefix="") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.fixture(scope="module")
def by_the_rules():
    """name -> (params0, ours after each update [N+1, ...], the paper's rule after each, our final
    state). Ours: the optimizer --optim.name builds (optim.make: clipping, float32 and non-finite
    guards, the schedule), one jitted scan for all five, with a NaN gradient at SKIPPED_AT; the
    rule (tests/optimizer_rules.py, float64 numpy) sees only the finite gradients."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(shape, np.float32) * 0.02 for k, (shape, _) in SMALL.items()}
    params["blocks/attn_norm/scale"] = np.ones(SMALL["blocks/attn_norm/scale"][0], np.float32)
    grads = [
        {k: rng.standard_normal(p.shape, np.float32) for k, p in params.items()}
        for _ in range(UPDATES)
    ]
    nan = {k: np.full(p.shape, np.nan, np.float32) for k, p in params.items()}
    fed = grads[:SKIPPED_AT] + [nan] + grads[SKIPPED_AT:]
    txs = {
        name: optim.make(
            TrainConfig(
                optimizer=name,
                lr=LR[name],
                b1=HYPER.b1,
                b2=HYPER.b2,
                eps=HYPER.eps,
                weight_decay=HYPER.weight_decay,
                grad_clip=HYPER.grad_clip,
                **SCHEDULE,
            )
        )
        for name in OPTIMIZERS
    }

    def updates(tx, params, grads_N):
        def one(carry, g):
            p, state = _apply(tx, *carry, g)
            return (p, state), p

        (_, state), params_N = jax.lax.scan(one, (params, tx.init(params)), grads_N)
        return params_N, state

    stacked = jax.tree.map(lambda *g: np.stack(g), *[_nested(g) for g in fed])
    ours = (
        jax.jit(lambda p, g: {n: updates(tx, p, g) for n, tx in txs.items()})
        .lower(_nested(params), stacked)
        .compile(FAST_COMPILE)(_nested(params), stacked)
    )
    leaves = {k: leaf for k, (_, leaf) in SMALL.items()}
    out = {}
    for name, (ours_N, state) in ours.items():
        lr = functools.partial(rules.lr_at, lr=LR[name], **SCHEDULE)
        want = rules.run(name, params, grads, leaves, HYPER, lr)
        out[name] = params, _flat(jax.device_get(ours_N)), want, state
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_equals_its_papers_rule(by_the_rules, name):
    """Every parameter after each of 5 updates, within float32 rounding of the float64 rule: an
    ulp of the parameter per update (each update rounds it once) and 1e-5 of the largest distance
    the leaf moved (the update's own arithmetic). The non-finite gradient changed nothing and did
    not advance the schedule (the rule never saw it)."""
    params, ours_N, want_N, state = by_the_rules[name]
    ours_at = [i for i in range(UPDATES + 1) if i != SKIPPED_AT]  # ours[i] after update i + 1
    for k, p0 in params.items():
        moved = max(float(np.abs(w[k] - p0).max()) for w in want_N)
        assert moved > 1e-4, (name, k, moved)
        for t, (i, want) in enumerate(zip(ours_at, want_N), start=1):
            np.testing.assert_allclose(
                ours_N[k][i],
                want[k],
                rtol=UPDATES * F32_EPS,
                atol=1e-5 * moved,
                err_msg=f"{name} update {t} {k}",
            )
    assert int(state.total_notfinite) == 1 and int(state.notfinite_count) == 0  # later ones applied
    assert all(np.array_equal(a[SKIPPED_AT], a[SKIPPED_AT - 1]) for a in ours_N.values())


@pytest.mark.parametrize(
    "warmup,steps,min_ratio",
    [(10, 110, 0.1), (0, 5, 0.0), (30, 5, 0.1), (1, 2, 0.5), (3, 1, 0.2)],
    ids=["warmup-then-cosine", "no-warmup", "warmup-cut-to-the-run", "shortest", "one-step"],
)
def test_schedule_follows_its_formula(warmup, steps, min_ratio):
    """The learning rate at the ends, around the warm-up boundary, mid-way down the cosine and past
    the run, against the formula (tests/optimizer_rules.py's lr_at); the warm-up's first rate is
    lr / w, its last lr, the run's end lr x min_lr_ratio."""
    lr = 1e-2
    sched = optim.schedule(
        TrainConfig(lr=lr, warmup_steps=warmup, steps=steps, min_lr_ratio=min_ratio)
    )
    w = min(warmup, max(steps - 1, 0))
    counts = sorted({0, 1, w - 1, w, w + 1, (w + steps) // 2, steps - 1, steps, steps + 10} - {-1})
    for c in counts:
        want = rules.lr_at(c, lr, warmup, steps, min_ratio)
        assert float(sched(c)) == pytest.approx(want, rel=1e-6), c
    if w:
        assert float(sched(0)) == pytest.approx(lr / w, rel=1e-6)
    assert float(sched(w)) == pytest.approx(lr, rel=1e-6)
    assert float(sched(steps + 10)) == pytest.approx(lr * min_ratio, rel=1e-6, abs=1e-12)
    # a number given as the schedule (Trainer(schedule=...)) is a constant rate
    assert float(optim.as_schedule(3e-4)(c)) == pytest.approx(3e-4)


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
