"""Sharded training state and THE BACKBONE: sharding invariance.

A float32 run with a fixed seed must produce the same loss curve on one device and on every mesh;
every parameter and Adam moment must be laid out exactly as the logical-axis rules say, with real
per-device shards of global/(axis sizes); gradient accumulation must not change the gradients.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from equivalence import grads_and_loss
from jax.sharding import PartitionSpec as P

from mesh.rules import axis_rules, logical_to_spec
from mesh.shard import axes_size
from models import model as model_lib
from train.core.config import build
from train.core.setup import create_state
from train.data import make_pipeline
from train.run.loop import Trainer

MESHES = ["data=8", "fsdp=8", "data=2,fsdp=2,model=2", "model=4,fsdp=2"]
KV4 = {"model.n_heads": 4, "model.n_kv_heads": 4}  # so that model=4 divides the kv heads


def model_overrides(mesh: str) -> dict:
    return KV4 if "model=4" in mesh else {}


def make_cfg(mesh: str, run_dir, **over):
    # the classic FSDP head everywhere (where `auto` would pick the vocab-parallel one, at
    # 128 tokens per FSDP group on data=2,fsdp=2,model=2): tests/test_equivalence_head.py
    # compares that layout per step and by its raw gradient, with the Adam settings that make
    # such a comparison sharp
    d = {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "parallelism.mesh": mesh,
        "parallelism.vocab_parallel": "off",
        "train.batch_size": 8,
        "train.seq_len": 32,
        "train.steps": 5,
        "train.seed": 0,
        # Adam's eps well above the gradients' rounding (tests/equivalence.py): with the default
        # 1e-8 a coordinate whose gradient is rounding noise moves by a full +-lr on one mesh and
        # not the other, and the 5-step parameters differ by that, not by a bug
        "train.eps": 1e-3,
        "train.eval_every": 0,
        "train.sample_tokens": 0,
        "logging.log_every": 1,
        "logging.progress": False,
        "logging.tensorboard": False,
        "logging.run_dir": str(run_dir),
    }
    d.update(over)
    return build(d)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Trainer after a 5-step fit, keyed by (mesh, model variant); each compiles once."""
    cache = {}

    def get(mesh: str, kv4: bool = False) -> Trainer:
        key = (mesh, kv4)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("run")
            cfg = make_cfg(mesh, run_dir, **(KV4 if kv4 else {}))
            tr = Trainer(cfg, devices=jax.devices()[:1] if mesh == "" else None)
            tr.fit()
            cache[key] = tr
        return cache[key]

    return get


# ------------------------------------------------------------------ layout of the state


def _adam_states(opt_state):
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1, opt_state
    return found[0]


def _expected_shard_shape(mesh, shape, spec):
    entries = list(spec) + [None] * (len(shape) - len(spec))
    out = []
    for dim, e in zip(shape, entries):
        n = axes_size(mesh, e)
        assert dim % n == 0
        out.append(dim // n)
    return tuple(out)


def check_state_layout(tr: Trainer, state):
    mesh, rules = tr.setup.mesh, tr.setup.rules
    axes = model_lib.param_axes(tr.setup.model_cfg)
    want = jax.tree.map(
        lambda names: logical_to_spec(names, rules), axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    adam = _adam_states(state.opt_state)
    n_sharded = 0
    for tree_name, tree in (("params", state.params), ("mu", adam.mu), ("nu", adam.nu)):
        assert jax.tree.structure(tree) == jax.tree.structure(want), tree_name
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            spec = functools.reduce(lambda t, k: t[k.key], path, want)
            where = f"{tree_name}{jax.tree_util.keystr(path)} on {dict(mesh.shape)}"
            assert x.sharding.mesh.shape == mesh.shape, where
            assert x.sharding.spec == spec, (where, x.sharding.spec, spec)
            local = _expected_shard_shape(mesh, x.shape, spec)
            shards = x.addressable_shards
            assert len(shards) == mesh.size, where
            assert all(s.data.shape == local for s in shards), (where, shards[0].data.shape, local)
            assert x.sharding.shard_shape(x.shape) == local
            n_sharded += local != x.shape
    # counts, the step and everything else that is not a moment: replicated scalars
    moments = {id(x) for x in jax.tree.leaves((adam.mu, adam.nu))}
    others = [x for x in jax.tree.leaves(state.opt_state) if id(x) not in moments] + [state.step]
    assert others, "expected Adam/schedule counts in the optimizer state"
    for x in others:
        assert x.ndim == 0 and x.sharding.is_fully_replicated and x.sharding.spec == P(), x.sharding
    return n_sharded


@pytest.mark.parametrize("mesh", MESHES)
def test_trained_state_layout(fitted, mesh):
    tr = fitted(mesh, kv4="model=4" in mesh)
    n_sharded = check_state_layout(tr, tr.state)
    # 3 trees x 12 leaves (9 matrices, 3 norm scales); the mesh decides which are split
    assert (
        n_sharded
        == {"data=8": 0, "fsdp=8": 3 * 9, "data=2,fsdp=2,model=2": 3 * 9, "model=4,fsdp=2": 3 * 9}[
            mesh
        ]
    )


def test_concrete_shard_shapes(fitted):
    p = fitted("data=2,fsdp=2,model=2").state.params
    # w_gate [L=2, D=64 (fsdp), F=192 (model)]
    assert p["blocks"]["mlp"]["w_gate_DF"].addressable_shards[0].data.shape == (2, 32, 96)
    # wo [L, N=4 (model), H=16, D=64 (fsdp)]
    assert p["blocks"]["attn"]["wo_NHD"].addressable_shards[0].data.shape == (2, 2, 16, 32)
    # embed [V=264 (model), D=64 (fsdp)]; norms replicated
    assert p["embed_VD"].addressable_shards[0].data.shape == (132, 32)
    assert p["final_norm"]["scale"].addressable_shards[0].data.shape == (64,)
    p = fitted("fsdp=8").state.params
    assert p["blocks"]["attn"]["wq_DNH"].addressable_shards[0].data.shape == (2, 8, 4, 16)
    p = fitted("model=4,fsdp=2", kv4=True).state.params
    assert p["blocks"]["attn"]["wk_DKH"].addressable_shards[0].data.shape == (2, 32, 1, 16)
    assert p["lm_head_DV"].addressable_shards[0].data.shape == (32, 66)
    # the shards hold different slices of the global array
    x = p["lm_head_DV"]
    assert len({tuple((i.start, i.stop) for i in s.index) for s in x.addressable_shards}) == 8


# ------------------------------------------------------------------ THE BACKBONE


def _losses(tr):
    assert [r["step"] for r in tr.history] == [1, 2, 3, 4, 5]
    return np.array([r["loss"] for r in tr.history])


@pytest.mark.parametrize("mesh", MESHES)
def test_sharding_invariance(fitted, mesh):
    kv4 = "model=4" in mesh
    ref = _losses(fitted("", kv4))
    assert fitted("", kv4).setup.mesh.size == 1
    got = _losses(fitted(mesh, kv4))
    assert fitted(mesh, kv4).setup.mesh.size == 8
    assert np.all(np.isfinite(ref)) and ref[-1] < ref[0]  # it is training, not a constant
    np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=f"mesh {mesh} vs one device")
    ref_norm = [r["grad_norm"] for r in fitted("", kv4).history]
    np.testing.assert_allclose(
        [r["grad_norm"] for r in fitted(mesh, kv4).history], ref_norm, rtol=1e-4
    )


def test_trained_params_match_one_device(fitted):
    """Not just the losses: the parameters after 5 steps agree too."""
    ref = fitted("").state.params
    got = fitted("data=2,fsdp=2,model=2").state.params
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ gradient accumulation


@pytest.fixture(scope="module")
def micro_setup(tmp_path_factory):
    cfg = make_cfg(
        "data=2,fsdp=2,model=2", tmp_path_factory.mktemp("micro"), **{"train.batch_size": 16}
    )
    tr = Trainer(cfg)
    state = create_state(tr.setup)
    pipe = make_pipeline(
        tr.cfg.data,
        batch_size=16,
        seq_len=32,
        seed=0,
        batch_sharding=tr.setup.batch_sharding,
        vocab_size=264,
    )
    batch = pipe.device_batch(0)
    return tr, state, batch


def test_fresh_state_layout(micro_setup):
    tr, state, _ = micro_setup
    assert check_state_layout(tr, state) == 3 * 9
    assert int(state.step) == 0
    adam = _adam_states(state.opt_state)
    assert all(float(abs(x).max()) == 0.0 for x in jax.tree.leaves((adam.mu, adam.nu)))


def _grads(tr, state, batch, m, dp_axes=()):
    fn = jax.jit(
        functools.partial(grads_and_loss, tr.setup.model_cfg, micro_batches=m, dp_axes=dp_axes)
    )
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        return fn(state.params, batch)


@pytest.mark.parametrize("per_replica_sums", [False, True])
def test_micro_batches_same_loss_and_grads(micro_setup, per_replica_sums):
    """Also with data-parallel replicas keeping their own partial sums (one all-reduce per step)."""
    tr, state, batch = micro_setup
    dp_axes = tr.setup.dp_axes if per_replica_sums else ()
    assert dp_axes == (("data",) if per_replica_sums else ())
    loss1, g1 = _grads(tr, state, batch, 1)
    loss4, g4 = _grads(tr, state, batch, 4, dp_axes)
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-5)
    assert abs(float(loss1) - np.log(264)) < 0.5
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g4)[0], jax.tree.leaves(g1)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 0, path
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(), err_msg=str(path))
