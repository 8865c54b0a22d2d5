"""Brigade as a library: the Trainer's own data iterable, loss and optimizer, and a registered
model, each on data=2,fsdp=2,model=2, with a save and an exact resume; the bad inputs, one line
each."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from errors import UserError
from mesh.build import make_mesh
from models import model
from models.presets import PRESETS
from plan.report import analyze
from train.core import state as train_state
from train.core.config import build
from train.core.inference import sample_text
from train.core.setup import abstract_batch, abstract_state, compile_step, create_state, jit_step
from train.data.external import IterableData
from train.run.loop import Trainer

MESH = "data=2,fsdp=2,model=2"
B, T, V = 8, 32, PRESETS["tiny"].vocab_size


class Counting:
    """Rows that count up from a random start: learnable, and reproducible from `i` alone."""

    def __init__(self, seed: int = 0):
        self.seed, self.i = seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        start = np.random.default_rng([self.seed, self.i]).integers(0, V, (B, 1))
        self.i += 1
        tokens = (start + np.arange(T + 1)) % V
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def state(self):
        return {"i": self.i}

    def restore(self, state):
        self.i = state["i"]


def hand_xent(logits_BTV, batch):
    """Cross-entropy written by hand, per token: the custom-loss contract."""
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    return -jnp.sum(logp_BTV * jax.nn.one_hot(batch["targets"], logits_BTV.shape[-1]), axis=-1)


def _cfg(run_dir, steps, preset="tiny", **over):
    return build(
        {
            "model.preset": preset,
            "model.dtype": "float32",
            "train.steps": steps,
            "train.batch_size": B,
            "train.seq_len": T,
            "train.eval_every": 0,
            "train.sample_tokens": 0,
            "train.warmup_steps": 1,
            "checkpoint.every": 3,
            "logging.progress": False,
            "logging.log_every": 1,
            "parallelism.mesh": MESH,
            "logging.run_dir": str(run_dir),
            **over,
        }
    )


def _leaves(tree):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


# --------------------------------------------------------- data + loss + optimizer, save and resume


def _fit(run_dir, steps, **over):
    tr = Trainer(
        _cfg(run_dir, steps, **over),
        mesh=make_mesh(MESH),
        data=Counting(),
        eval_data=Counting(seed=1),
        loss=hand_xent,
        optimizer=optax.lion(3e-4),
        schedule=3e-4,
    )
    return tr, tr.fit()


def test_custom_data_loss_optimizer_resume_exactly(tmp_path, capfd):
    whole, _ = _fit(tmp_path / "whole", 6, **{"train.eval_every": 3, "train.eval_batches": 1})
    first, _ = _fit(tmp_path / "split", 3)
    resumed, out = _fit(tmp_path / "split", 6)
    assert out["resumed_from"] == 3 and "from its beginning" not in capfd.readouterr().out
    losses = {r["step"]: r["loss"] for r in whole.history}
    assert [r["step"] for r in resumed.history] == [4, 5, 6]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed.history], [losses[s] for s in (4, 5, 6)], rtol=1e-6
    )
    for a, b in zip(_leaves(whole.state.params), _leaves(resumed.state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert losses[6] < losses[1]
    # the schedule= the log reports
    assert all(r["lr"] == pytest.approx(3e-4) for r in whole.history)
    assert [r["step"] for r in whole.eval_history] == [3, 6]  # eval_data=
    # lion's momentum is sharded exactly like its parameter
    params = dict(jax.tree_util.tree_flatten_with_path(whole.state.params)[0])
    moments = [
        (path, x)
        for path, x in jax.tree_util.tree_flatten_with_path(whole.state.opt_state)[0]
        if x.ndim and any(tuple(path[k:]) in params for k in range(len(path)))
    ]
    assert moments
    for path, x in moments:
        own = next(params[tuple(path[k:])] for k in range(len(path)) if tuple(path[k:]) in params)
        assert x.sharding == own.sharding and x.shape == own.shape


def test_iterable_without_state_resumes_from_its_beginning(tmp_path, capfd):
    class Plain(Counting):
        state = restore = None

    data = IterableData(
        Plain(), batch_size=B, seq_len=T, packing_mask=False, batch_sharding=None, vocab_size=V
    )
    data.seek(3, {"next_step": 3, "iterable": None})
    assert (
        "resuming at step 3 with a custom data iterable from its beginning"
        in capfd.readouterr().out
    )


# ------------------------------------------------------------------ the custom loss is exact


def test_custom_loss_equals_builtin_cross_entropy(tmp_path):
    """Two steps with micro-batches, hand-written cross-entropy vs the built-in: same loss,
    gradient norm and parameters."""
    # Adam's eps 1e-3: a coordinate whose gradient is rounding noise (the two losses sum in
    # different orders) then moves by lr x noise / eps, not by up to a whole lr step (eps 1e-8)
    over = {"train.micro_batches": 2, "train.eps": 1e-3}
    cfg, mesh = _cfg(tmp_path, 2, **over), make_mesh(MESH)
    batches = [
        IterableData(
            Counting(),
            batch_size=B,
            seq_len=T,
            packing_mask=False,
            vocab_size=V,
            batch_sharding=Trainer(cfg, mesh=mesh).setup.batch_sharding,
        ).next()[0]
        for _ in range(2)
    ]
    runs = []
    for loss in (None, hand_xent):
        tr = Trainer(cfg, mesh=mesh, loss=loss)
        state, metrics = create_state(tr.setup), []
        with jax.set_mesh(mesh):
            step = jit_step(tr.setup)
            for b in batches:
                state, m = step(state, b)
                metrics.append(jax.device_get(m))
        runs.append((metrics, _leaves(state.params)))
    (m0, p0), (m1, p1) = runs
    for a, b in zip(m0, m1):
        np.testing.assert_allclose(
            [a["loss"], a["grad_norm"]], [b["loss"], b["grad_norm"]], rtol=1e-5
        )
    for a, b in zip(p0, p1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ a registered model


def mlp_init(cfg, key):
    k_embed, k_out, *k_layers = jax.random.split(key, 2 + 2 * cfg.n_layers)
    normal = lambda k, shape: cfg.init_std * jax.random.normal(k, shape, jnp.float32)  # noqa: E731
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    return {
        "embed_VD": normal(k_embed, (v, d)),
        "out_DV": normal(k_out, (d, v)),
        "layers": {
            str(i): {
                "up_DF": normal(k_layers[2 * i], (d, f)),
                "down_FD": normal(k_layers[2 * i + 1], (f, d)),
            }
            for i in range(cfg.n_layers)
        },
    }


def mlp_axes(cfg):
    return {
        "embed_VD": ("vocab", "embed"),
        "out_DV": ("embed", "vocab"),
        "layers": {
            str(i): {"up_DF": ("embed", "mlp"), "down_FD": ("mlp", "embed")}
            for i in range(cfg.n_layers)
        },
    }


def mlp_apply(cfg, params, tokens_BT, positions_BT=None, cache=None, segment_ids_BT=None):
    x_BTD = jnp.take(params["embed_VD"], tokens_BT, axis=0)
    for layer in params["layers"].values():
        x_BTD = x_BTD + jax.nn.relu(x_BTD @ layer["up_DF"]) @ layer["down_FD"]
    return (x_BTD @ params["out_DV"]).astype(jnp.float32), cache


def test_registered_model_trains_resumes_and_plans(tmp_path):
    models.register("mlp-lm", mlp_init, mlp_apply, mlp_axes, config=PRESETS["tiny"])
    cfg = _cfg(tmp_path, 3, preset="mlp-lm", **{"checkpoint.every": 2})
    tr = Trainer(cfg, mesh=make_mesh(MESH))
    first = tr.fit()
    assert first["steps"] == 3 and tr.state.params["layers"]["0"]["up_DF"].sharding.spec == jax.P(
        ("fsdp", "context", "expert"), "model"
    )
    again = Trainer(_cfg(tmp_path, 5, preset="mlp-lm"), mesh=make_mesh(MESH))
    out = again.fit()
    assert out["resumed_from"] == 3 and [r["step"] for r in again.history] == [4, 5]
    assert again.history[-1]["loss"] < tr.history[0]["loss"]
    report = analyze(again.setup)
    assert report["params"] == sum(x.size for x in jax.tree.leaves(tr.state.params))
    with pytest.raises(UserError, match="model 'mlp-lm' cannot generate text"):
        sample_text(again.setup, again.state.params, "hi", 4)


# ------------------------------------------------------------- optimizer state sharding, bad inputs


def test_optimizer_state_shardings_follow_params(tmp_path):
    """Adafactor's factored statistics: a [V,D] parameter's column statistic [V] keeps V's axes."""
    tr = Trainer(_cfg(tmp_path, 2), mesh=make_mesh(MESH))
    params, param_sh = abstract_state(tr.setup).params, tr.setup.state_shardings.params
    sh = train_state.like_params(
        optax.adafactor(1e-3, min_dim_size_to_factor=16), params, param_sh, tr.setup.mesh
    )
    named = {
        jax.tree_util.keystr(path): s for path, s in jax.tree_util.tree_flatten_with_path(sh)[0]
    }
    (v_col,) = [s for name, s in named.items() if name.endswith("v_col['embed_VD']")]
    assert (
        v_col.spec == jax.P(param_sh["embed_VD"].spec[0])
        and jax.P(param_sh["embed_VD"].spec[0]) != jax.P()
    )


def test_bad_inputs_are_one_line(tmp_path):
    cfg, mesh = _cfg(tmp_path, 2), make_mesh(MESH)
    data = IterableData(
        Counting(), batch_size=B, seq_len=T, packing_mask=False, batch_sharding=None, vocab_size=V
    )
    good = next(Counting())
    with pytest.raises(UserError, match=r"'targets' has shape \(8, 16\); expected \(8, 32\)"):
        data.check({**good, "targets": good["targets"][:, :16]}, "batch 1")
    with pytest.raises(UserError, match="missing key 'targets'"):
        data.check({"inputs": good["inputs"]}, "batch 1")
    with pytest.raises(
        UserError, match="unexpected key 'segment_ids' \\(only with --data.packing_mask true\\)"
    ):
        data.check({**good, "segment_ids": good["inputs"]}, "batch 1")
    tr = Trainer(cfg, mesh=mesh, loss=lambda logits, batch: jnp.mean(logits))
    with pytest.raises(UserError, match=r"loss=: returned \(\) float32; expected per-token losses"):
        compile_step(tr.setup, abstract_state(tr.setup), abstract_batch(tr.setup))

    def big_state(_):
        return {"table": jnp.zeros((300, 300))}

    unshardable = optax.GradientTransformation(big_state, lambda u, s, p=None: (u, s))
    with pytest.raises(
        UserError, match=r"optimizer state \S*\['table'\] \(300, 300\) matches no parameter"
    ):
        Trainer(cfg, mesh=mesh, optimizer=unshardable, schedule=0.1)
    with pytest.raises(UserError, match="also pass schedule="):
        Trainer(cfg, mesh=mesh, optimizer=optax.sgd(0.1))
    with pytest.raises(
        UserError, match="unknown preset 'nope'; valid presets: tiny.*; registered models:"
    ):
        build({"model.preset": "nope"})


def test_installed_packages_register_models_through_entry_points(monkeypatch):
    """`python -m train --model NAME` knows a model that an installed package registers."""
    from models import registry

    class EntryPoint:
        def load(self):
            models.register("ep-mlp", mlp_init, mlp_apply, mlp_axes)

    monkeypatch.setattr(registry, "_loaded_entry_points", False)
    monkeypatch.setattr(
        registry.importlib.metadata,
        "entry_points",
        lambda group: [EntryPoint()] if group == registry.ENTRY_POINTS else [],
    )
    cfg = build({"model.preset": "ep-mlp", "model.d_model": 32})
    assert cfg.model.arch == "ep-mlp" and cfg.model.d_model == 32 and "ep-mlp" in registry.names()
    assert set(model.param_axes(cfg.model)) == {"embed_VD", "out_DV", "layers"}
