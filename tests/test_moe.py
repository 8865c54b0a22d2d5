"""models/moe.py: the Mixture-of-Experts layer against a per-token reference, capacity dispatch,
expert parallelism invariance on 8 fake devices, load balancing (aux loss and the aux-loss-free
bias), bad input. float32 throughout."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import grads_and_loss
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.build import make_mesh
from mesh.rules import axis_rules, logical_to_spec, make_rules
from models import model as model_lib
from models import moe, moe_dispatch, moe_router
from models.flops import active_param_count, matmul_param_count, param_count
from models.presets import PRESETS
from plan.hlo import parse_collectives
from train.core.config import build
from train.core.setup import create_state, jit_step
from train.run.loop import Trainer

CFG = dataclasses.replace(PRESETS["moe-tiny"], dtype="float32")
N_B, N_T = 4, 8


def _layer_inputs(cfg, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_width
    x = jax.random.normal(ks[0], (N_B, N_T, d))
    w = {
        "router": 0.3 * jax.random.normal(ks[1], (d, e)),
        "wg": jax.random.normal(ks[2], (e, d, f)) / d**0.5,
        "wu": jax.random.normal(ks[3], (e, d, f)) / d**0.5,
        "wd": jax.random.normal(ks[4], (e, f, d)) / f**0.5,
    }
    return x, w


def moe_layer(cfg, x, w, kernel=None):
    idx, gate, stats = moe.route(cfg, x, w["router"])
    y, dropped = moe.experts(cfg, x, idx, gate, w["wg"], w["wu"], w["wd"], kernel)
    return y, dropped, stats


def reference(cfg, x, w):
    """Per token: its router scores, its chosen experts one by one, their weighted sum."""

    def one_token(xt):
        logits = xt @ w["router"]
        probs = jax.nn.softmax(logits) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
        top = jnp.argsort(-probs, stable=True)[: cfg.experts_per_token]
        gates = probs[top] / jnp.sum(probs[top])
        y = 0.0
        for j in range(cfg.experts_per_token):
            e = top[j]
            y = y + gates[j] * (jax.nn.silu(xt @ w["wg"][e]) * (xt @ w["wu"][e])) @ w["wd"][e]
        return y

    return jax.vmap(one_token)(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def _loss(fn):
    probe = jax.random.normal(jax.random.key(9), (N_B, N_T, CFG.d_model))
    return lambda x, w: jnp.sum(fn(x, w) * probe)


@pytest.mark.parametrize("kernel,router", [("blocks", "softmax"), ("ragged", "sigmoid")])
def test_dropless_equals_per_token_loop(kernel, router):
    cfg = dataclasses.replace(CFG, router=router)
    x, w = _layer_inputs(cfg)
    y, dropped, _ = jax.jit(lambda x, w: moe_layer(cfg, x, w, kernel))(x, w)
    ref = jax.jit(functools.partial(reference, cfg))(x, w)
    np.testing.assert_allclose(y, ref, atol=1e-5, rtol=1e-5)
    assert float(dropped) == 0.0
    got_g = jax.jit(jax.grad(_loss(lambda x, w: moe_layer(cfg, x, w, kernel)[0]), argnums=(0, 1)))(
        x, w
    )
    ref_g = jax.jit(jax.grad(_loss(lambda x, w: reference(cfg, x, w)), argnums=(0, 1)))(x, w)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got_g)[0], jax.tree.leaves(ref_g)):
        assert float(jnp.max(jnp.abs(b))) > 0, path
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=str(path))


def test_capacity_large_equals_dropless_small_drops_what_routing_implies():
    x, w = _layer_inputs(CFG, seed=1)
    dropless, _, _ = jax.jit(functools.partial(moe_layer, CFG))(x, w)
    big = dataclasses.replace(
        CFG, dispatch="capacity", capacity_factor=CFG.n_experts / CFG.experts_per_token
    )
    y, dropped, _ = jax.jit(functools.partial(moe_layer, big))(x, w)
    np.testing.assert_allclose(y, dropless, atol=1e-6)
    assert float(dropped) == 0.0
    # small capacity: count by hand, first choices of all tokens before any second choice
    small = dataclasses.replace(CFG, dispatch="capacity", capacity_factor=0.5)
    n, k, e = N_B * N_T, CFG.experts_per_token, CFG.n_experts
    cap = int(np.ceil(0.5 * n * k / e))
    idx, _, _ = moe.route(small, x, w["router"])
    seen, expect_drop, kept = np.zeros(e, int), 0, set()
    for kk in range(k):
        for t, ex in enumerate(np.asarray(idx).reshape(n, k)[:, kk]):
            if seen[ex] < cap:
                seen[ex] += 1
                kept.add((t, kk))
            else:
                expect_drop += 1
    y, dropped, _ = jax.jit(functools.partial(moe_layer, small))(x, w)
    assert expect_drop > 0 and float(dropped) == expect_drop
    # a token with every choice dropped gets exactly 0 from the layer (it skips via the residual)
    lost = [t for t in range(n) if all((t, kk) not in kept for kk in range(k))]
    for t in lost:
        assert float(jnp.max(jnp.abs(y.reshape(n, -1)[t]))) == 0.0


# ------------------------------------------------------------------ expert parallelism

# One mesh with every axis an expert layer meets (fsdp, expert, model): the expert=8 and data x
# expert meshes are compared step by step, gradients included, in test_equivalence_moe.py; this run
# adds DeepSeek-V3 routing (sigmoid, bias balancing) and the load metrics.
MESHES = ["fsdp=2,expert=2,model=2"]
BIAS_RATE = 0.01
# DeepSeek-V3 routing (sigmoid + aux-loss-free bias) on top of the aux and z
# losses: every path at once
MOE_OVER = {"model.router": "sigmoid", "model.router_bias_rate": BIAS_RATE}


def make_trainer(mesh: str, tmp_path, **over):
    d = {
        "model.preset": "moe-tiny",
        "model.dtype": "float32",
        "parallelism.mesh": mesh,
        "train.batch_size": 8,
        "train.seq_len": 32,
        "train.steps": 5,
        "train.seed": 0,
        "train.eval_every": 0,
        "train.sample_tokens": 0,
        "logging.run_dir": str(tmp_path),
    }
    d.update(over)
    return Trainer(build(d), devices=jax.devices()[:1] if mesh == "" else None)


def run_steps(tr, n=5):
    state = create_state(tr.setup)
    rng = np.random.default_rng(0)
    history = []
    step = jit_step(tr.setup)
    tok = rng.integers(0, 256, (8, 33)).astype(
        np.int32
    )  # one batch, seen again: the loss must fall
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        for _ in range(n):
            batch = jax.device_put(
                {
                    "inputs": tok[:, :-1],
                    "targets": tok[:, 1:],
                    "weights": np.ones((8, 32), np.float32),
                },
                tr.setup.batch_sharding,
            )
            state, m = step(state, batch)
            history.append(jax.device_get(m))
    return state, history


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(mesh):
        if mesh not in cache:
            cache[mesh] = run_steps(make_trainer(mesh, tmp_path_factory.mktemp("moe"), **MOE_OVER))
        return cache[mesh]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_expert_parallel_invariance(runs, mesh):
    _, ref = runs("")
    state, got = runs(mesh)
    losses = np.array([m["loss"] for m in ref])
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    np.testing.assert_allclose([m["loss"] for m in got], losses, rtol=1e-5, err_msg=mesh)
    for key in ("moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean"):
        np.testing.assert_allclose(
            [m[key] for m in got], [m[key] for m in ref], rtol=1e-4, err_msg=key
        )
    # the experts really are split: each device holds n_experts / expert of them
    w = state.params["moe_blocks"]["moe"]["w_gate_EDF"]
    n_ep = dict(zip(w.sharding.mesh.axis_names, w.sharding.mesh.devices.shape))["expert"]
    assert w.addressable_shards[0].data.shape[1] == CFG.n_experts // n_ep


def test_metrics_keys(runs):
    _, hist = runs("")
    m = hist[-1]
    assert {"loss", "grad_norm", "lr", "skipped_steps"} <= set(m)
    moe_keys = {k for k in m if k.startswith("moe/")}
    assert moe_keys == {
        "moe/load_max_over_mean",
        "moe/load_min_over_mean",
        "moe/dropped_fraction",
        "moe/aux_loss",
        "moe/z_loss",
    }
    for k in moe_keys:
        assert m[k].shape == () and m[k].dtype == np.float32, k
    assert m["moe/load_min_over_mean"] <= 1.0 <= m["moe/load_max_over_mean"]
    # E sum f P >= 1 at uniform P
    assert m["moe/dropped_fraction"] == 0.0 and m["moe/aux_loss"] >= 1.0 - 1e-5


# ------------------------------------------------------------------ balance


def _skewed(cfg, seed=0):
    """Inputs with a common direction that the router prefers for experts 0 and 1."""
    x, w = _layer_inputs(cfg, seed)
    mu = jax.random.normal(jax.random.key(7), (cfg.d_model,))
    x = x + 2.0 * mu
    w["router"] = w["router"].at[:, :2].add(1.0 * mu[:, None] / jnp.linalg.norm(mu))
    return x, w


def _imbalance(counts):
    return float(jnp.max(counts) / jnp.mean(counts))


def test_aux_loss_evens_out_the_load():
    cfg = dataclasses.replace(CFG, aux_loss_coef=1.0)
    x, w = _skewed(cfg)

    def aux(router):
        return moe.route(cfg, x, router)[2]["aux"]

    @jax.jit
    def step(router):
        return router - 0.05 * jax.grad(aux)(router)

    before = _imbalance(moe.route(cfg, x, w["router"])[2]["counts"])
    router = w["router"]
    for _ in range(40):
        router = step(router)
    after = _imbalance(moe.route(cfg, x, router)[2]["counts"])
    assert before > 3.5 and after < 2.5, (before, after)  # 4 = every token on experts 0 and 1


def test_bias_balancing_evens_out_the_load():
    cfg = dataclasses.replace(CFG, router="sigmoid", router_bias_rate=0.02)
    x, w = _skewed(cfg)
    counts = jax.jit(lambda b: moe.route(cfg, x, w["router"], b)[2]["counts"])
    bias = jnp.zeros((cfg.n_experts,))
    before = _imbalance(counts(bias))
    for _ in range(60):
        bias = moe_router.bias_update(bias[None], counts(bias)[None], cfg.router_bias_rate)[0]
    assert before > 3.5 and _imbalance(counts(bias)) < 2.5, (before, _imbalance(counts(bias)))


def test_bias_lives_in_params_and_follows_the_loads(runs):
    state, hist = runs("")
    bias = np.asarray(state.params["moe_blocks"]["moe"]["router_bias_E"])
    assert bias.shape == (CFG.n_layers, CFG.n_experts) and np.any(bias != 0)
    # 5 sign steps of 0.01: no gradient and no weight decay reach it
    steps = bias / BIAS_RATE
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    assert np.abs(steps).max() <= 5
    adam_mu = [
        x
        for p, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
        if "router_bias_E" in str(p)
    ]
    assert adam_mu and all(float(np.abs(m).max()) == 0.0 for m in adam_mu)


# ------------------------------------------------------------------ model-level


@pytest.mark.slow
def test_moe_every_groups_and_shared_experts():
    cfg = dataclasses.replace(CFG, n_layers=4, moe_every=2, n_shared_experts=1)
    p = model_lib.init(cfg, jax.random.key(0))
    assert p["blocks"]["mlp"]["w_gate_DF"].shape[0] == 2 and p["moe_blocks"]["moe"][
        "w_gate_EDF"
    ].shape[:2] == (2, 8)
    assert p["moe_blocks"]["moe"]["shared"]["w_up_DF"].shape == (2, cfg.d_model, cfg.expert_width)
    axes = model_lib.param_axes(cfg)
    assert axes["moe_blocks"]["moe"]["w_down_EFD"] == (
        "layers",
        "experts",
        "expert_mlp",
        "expert_embed",
    )
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    scan, stats = jax.jit(lambda p, t: model_lib.forward(cfg, p, t))(p, tok)
    unrolled, _ = jax.jit(
        lambda p, t: model_lib.forward(dataclasses.replace(cfg, scan_layers=False), p, t)
    )(p, tok)
    np.testing.assert_allclose(unrolled, scan, rtol=1e-5, atol=1e-5)
    # the [L,...] KV cache is split between the dense and MoE layers of each group and put back
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    cached, cache = jax.jit(lambda p, t, c: model_lib.apply(cfg, p, t, pos, c))(
        p, tok, model_lib.init_cache(cfg, 2, 16)
    )
    np.testing.assert_allclose(cached, scan, rtol=1e-4, atol=1e-4)
    assert cache.k.shape[0] == 4 and np.asarray(cache.index).tolist() == [16] * 4
    assert float(jnp.abs(cache.k[2]).max()) > 0  # every layer wrote its keys
    assert stats["counts"].shape == (2, 8) and np.all(
        np.asarray(stats["counts"]).sum(-1) == 2 * 16 * 2
    )


def test_active_params_and_flops():
    n_total, n_active = param_count(CFG), active_param_count(CFG)
    expert = 3 * CFG.d_model * CFG.expert_width
    assert n_total - n_active == CFG.n_layers * (CFG.n_experts - CFG.experts_per_token) * expert
    assert (
        matmul_param_count(CFG)
        == n_active - CFG.d_model * (2 * CFG.n_layers + 1) - CFG.vocab_size * CFG.d_model
    )


@pytest.mark.parametrize(
    "change,needles",
    [
        (dict(experts_per_token=9), ["experts_per_token=9", "n_experts=8"]),
        (dict(moe_every=3), ["moe_every=3", "n_layers=2", "[1, 2]"]),
        (dict(router="relu"), ["router", "'relu'", "softmax, sigmoid"]),
        (dict(dispatch="random"), ["dispatch", "dropless, capacity"]),
        (dict(capacity_factor=0.0), ["capacity_factor"]),
        (dict(ep_exchange="nccl"), ["ep_exchange", "'nccl'", "auto, fixed, ragged"]),
        (
            dict(ep_exchange="ragged", dispatch="capacity"),
            ["ep_exchange", "dropless", "'capacity'"],
        ),
    ],
)
def test_bad_moe_config(change, needles):
    with pytest.raises(UserError) as ei:
        dataclasses.replace(CFG, **change).validate()
    assert all(n in str(ei.value) for n in needles), str(ei.value)


def test_experts_not_divisible_by_expert_axis(tmp_path):
    with pytest.raises(UserError, match="n_experts|experts=6") as ei:
        make_trainer("expert=4,data=2", tmp_path, **{"model.n_experts": 6})
    assert "expert=4" in str(ei.value) and "\n" not in str(ei.value)


# ------------------------------------------------------------------ ragged exchange


def test_ragged_all_to_all_emulation_follows_the_documented_example():
    """The example of lax.ragged_all_to_all's docstring (jax 0.10), on a 2-device axis."""
    mesh = jax.make_mesh(
        (2,), ("x",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,)
    )
    args = [
        np.array(a, np.float32 if i < 2 else np.int32)
        for i, a in enumerate(
            [
                [[1, 2, 2], [3, 4, 0]],
                [[0] * 4] * 2,
                [[0, 1], [0, 1]],
                [[1, 2], [1, 1]],
                [[0, 0], [1, 2]],
                [[1, 1], [2, 1]],
            ]
        )
    ]

    def body(*a):
        return moe_dispatch.ragged_all_to_all_emulated(*(x[0] for x in a), axis_name="x")[None]

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))(*args)
    np.testing.assert_array_equal(out, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_exchange_choice_per_backend():
    assert jax.default_backend() == "cpu"
    for asked, got in (("auto", "fixed"), ("fixed", "fixed"), ("ragged", "emulated")):
        assert moe_dispatch.exchange_for(dataclasses.replace(CFG, ep_exchange=asked)) == got


def _exchange_loss(x, w, cfg, exchange, kernel, probe):
    idx, gate, _ = moe.route(cfg, x, w["router"])
    y, _ = moe.experts(cfg, x, idx, gate, w["wg"], w["wu"], w["wd"], kernel, exchange)
    return jnp.sum(y * probe), y


def _layer_on_mesh(spec):
    x, w = _layer_inputs(CFG, seed=3)
    # [8,8,D]: the skewed half sends most rows to device 0
    x = jnp.concatenate([x, _skewed(CFG, seed=4)[0]])
    w["router"] = (
        w["router"]
        .at[:, :2]
        .add(2.0 * jax.random.normal(jax.random.key(7), (CFG.d_model, 1)) / CFG.d_model**0.5)
    )
    probe = jax.random.normal(jax.random.key(9), x.shape)
    mesh = make_mesh(spec)
    return mesh, x, w, probe


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["expert=8", "data=2,expert=4"])
def test_ragged_exchange_equals_fixed(mesh_spec):
    """Dropless with the ragged exchange (CPU: the emulation) against the fixed buffers, forward and
    gradients, with both grouped-matmul kernels; the routing is skewed so that one device receives
    most rows (the static receive buffer must hold them)."""
    mesh, x, w, probe = _layer_on_mesh(mesh_spec)
    with jax.set_mesh(mesh), axis_rules(make_rules()):
        x = jax.device_put(x, logical_to_spec(moe.TOKENS_BT))
        out = {}
        for exchange, kernel in (
            ("fixed", "blocks"),
            ("emulated", "blocks"),
            ("emulated", "ragged"),
        ):
            loss = functools.partial(
                _exchange_loss, cfg=CFG, exchange=exchange, kernel=kernel, probe=probe
            )
            out[exchange, kernel] = jax.device_get(
                jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
            )
    idx = np.asarray(moe.route(CFG, x, w["router"])[0])
    n_dev = dict(zip(mesh.axis_names, mesh.devices.shape))["expert"]
    share0 = np.mean(idx // (CFG.n_experts // n_dev) == 0)
    assert share0 > 2.0 / n_dev, share0  # device 0 gets more than twice its fair share
    ref = out["fixed", "blocks"]
    for key, got in out.items():
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref)):
            assert np.abs(b).max() > 0, path
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"{key} {path}")


def test_ragged_exchange_lowers_the_real_primitive():
    """exchange="ragged" emits ragged_all_to_all (XLA:CPU lowers it to StableHLO but cannot compile
    it): two in the forward pass, their transposes (jax's own rule) in the backward pass."""
    mesh, x, w, probe = _layer_on_mesh("data=2,expert=4")
    loss = functools.partial(
        _exchange_loss, cfg=CFG, exchange="ragged", kernel="ragged", probe=probe
    )
    with jax.set_mesh(mesh), axis_rules(make_rules()):
        x = jax.device_put(x, logical_to_spec(moe.TOKENS_BT))
        fwd = jax.jit(loss).lower(x, w).as_text()
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True)).lower(x, w).as_text()
    call = re.compile(r"custom_call @ragged_all_to_all")
    assert len(call.findall(fwd)) == 2 and len(call.findall(bwd)) == 4
    assert "stablehlo.all_to_all" not in fwd  # no fixed-size buffers left


# ------------------------------------------------------------------ micro-batches


@pytest.mark.slow
@pytest.mark.parametrize(
    "over",
    [{}, {"model.dropless_kernel": "ragged", "model.ep_exchange": "ragged"}],
    ids=["cpu-defaults", "gpu-defaults"],
)
def test_moe_micro_batches_reduce_data_parallel_grads_once(tmp_path, over):
    """MoE under the data-parallel micro-batch vmap: the same loss and gradients as one batch, and
    the data-axis gradient all-reduce runs once per step, outside the micro-batch loop.
    (aux loss off: f_e P_e of a micro-batch is not additive, so it differs by construction.)
    gpu-defaults: the ragged exchange (emulated here) and the ragged_dot kernel, whose weights are
    made to follow the vmap's batching (models.moe_kernels.batched_like)."""
    tr = make_trainer(
        "data=2,expert=4", tmp_path, **{"train.batch_size": 16, "model.aux_loss_coef": 0.0, **over}
    )
    assert tr.setup.dp_axes == ("data",)
    state = create_state(tr.setup)
    tok = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        batch = jax.device_put(
            {
                "inputs": tok[:, :-1],
                "targets": tok[:, 1:],
                "weights": np.ones((16, 32), np.float32),
            },
            tr.setup.batch_sharding,
        )
        fns = {
            m: jax.jit(
                functools.partial(
                    grads_and_loss, tr.setup.model_cfg, micro_batches=m, dp_axes=tr.setup.dp_axes
                )
            )
            .lower(state.params, batch)
            .compile()
            for m in (1, 2)
        }
        (loss1, g1), (loss2, g2) = (jax.device_get(fns[m](state.params, batch)) for m in (1, 2))
        hlo = fns[2].as_text()
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g2)[0], jax.tree.leaves(g1)):
        assert np.abs(b).max() > 0, path
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=str(path))
    on_data = [
        c
        for c in parse_collectives(hlo, tr.setup.mesh)
        if c.kind == "all-reduce" and "data" in c.axes
    ]
    local_grad_bytes = sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params)
    )
    assert [c.count for c in on_data] == [1] and on_data[0].operand_bytes >= local_grad_bytes, (
        on_data
    )
