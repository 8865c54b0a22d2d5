"""models/pipeline/split_backward.py: a backward pass split into the input gradient (B) and the
weight gradients (W) gives exactly jax.vjp's values, and W holds the weight-gradient matmuls only:
no recomputed forward, no input-gradient chain."""

import jax
import jax.numpy as jnp
import numpy as np

from models.pipeline.split_backward import Split

K = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(K[0], (6, 8))
W = jax.random.normal(K[1], (3, 8, 8)) * 0.3
G = jax.random.normal(K[2], (6, 8))


def stack(x, w):
    """A pipeline stage as models/pipeline/explicit.py runs it: a scan over layers, each
    rematerialised, the weights closed over and picked by the layer index (their gradient is a scan
    carry)."""
    layer = jax.checkpoint(lambda h, k: h + jnp.tanh(jnp.sin(h) @ w[k]) @ w[k].T)
    return jax.lax.scan(lambda h, k: (layer(h, k), None), x, jnp.arange(w.shape[0]))[0]


def backward(x, w, g):
    _, vjp = jax.vjp(stack, x, w)
    dx, dw = vjp(g)
    return dx, dw


def primitives(jaxpr, out=None):
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        if "jaxpr" in eqn.params:  # scan bodies
            j = eqn.params["jaxpr"]
            primitives(getattr(j, "jaxpr", j), out)
    return out


def test_split_equals_vjp_and_w_is_matmuls_only():
    split = Split(backward, (X, W, G), keep_argnums=(1,))
    dx, saved = jax.jit(split.b)(X, W, G)
    dw = jax.jit(split.w)(saved, W)
    want_dx, want_dw = jax.jit(backward)(X, W, G)
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-6, atol=1e-6)
    # W: two matmuls per layer (w and its transpose) and their sums; nothing of the forward
    w_prims = primitives(jax.make_jaxpr(split.w)(saved, W).jaxpr)
    assert w_prims.count("dot_general") == 2 and "tanh" not in w_prims and "sin" not in w_prims, (
        w_prims
    )
    # B computes no weight gradient: the same matmuls as the input-gradient-only vjp
    b_prims = primitives(jax.make_jaxpr(split.b)(X, W, G).jaxpr)
    dx_only = primitives(
        jax.make_jaxpr(lambda x, w, g: jax.vjp(lambda x: stack(x, w), x)[1](g))(X, W, G).jaxpr
    )
    assert b_prims.count("dot_general") == dx_only.count("dot_general")
    # what W reads: per layer, stacked [3, ...] (the layer inputs and output
    # gradients it multiplies)
    assert all(s.shape[0] == 3 for s in saved), [s.shape for s in saved]


def test_split_under_vmap_and_with_atomic_loops():
    """b and w batch under vmap (the pipeline's stage dim); a while loop producing both kinds of
    output stays whole in B and W reads its result."""

    def with_loop(x, w, g):
        dx, dw = backward(x, w, g)
        # a loop that needs dx: atomic, in B; its result also feeds a weight-gradient output
        acc = jax.lax.fori_loop(0, 3, lambda i, a: a + dx.sum() * i, jnp.float32(0))
        return dx * acc, (dw * acc, dw.sum())

    split = Split(with_loop, (X, W, G), keep_argnums=(1,))
    xs, gs = jnp.stack([X, 2 * X]), jnp.stack([G, -G])
    now, saved = jax.vmap(split.b, in_axes=(0, None, 0))(xs, W, gs)
    later = jax.vmap(split.w, in_axes=(0, None))(saved, W)
    want = jax.vmap(with_loop, in_axes=(0, None, 0))(xs, W, gs)
    np.testing.assert_allclose(now, want[0], rtol=1e-6)
    for got, exp in zip(jax.tree.leaves(later), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)


def test_plan_counts_the_w_inputs_zb_h1_keeps(monkeypatch):
    """plan prices zb_h1's memory with 8 [D] + (2NH + 2KH + 4F)/tp values per token and layer for
    the W inputs (plan/search.py activation_bytes); that is what the split of the tiny decoder's
    stage backward keeps, counted here from the real program."""
    import dataclasses

    from mesh.build import make_mesh
    from mesh.rules import axis_rules, make_rules
    from models import model
    from models.config import PipelineConfig
    from models.pipeline import split_backward
    from models.presets import PRESETS

    cfg = dataclasses.replace(PRESETS["tiny"], dtype="float32")
    kept = []
    b = split_backward.Split.b
    monkeypatch.setattr(
        split_backward.Split, "b", lambda self, *a: kept.append(b(self, *a)[1]) or b(self, *a)
    )
    params = model.abstract_params(cfg)
    B, T, P = 8, 16, 2
    batch = {
        "inputs": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "targets": jax.ShapeDtypeStruct((B, T), jnp.int32),
        "weights": jax.ShapeDtypeStruct((B, T), jnp.float32),
    }
    with jax.set_mesh(make_mesh("pipeline=2,model=4")), axis_rules(make_rules("")):
        jax.eval_shape(
            jax.grad(
                lambda p, bt: model.objective(
                    cfg,
                    p,
                    bt,
                    pipeline=PipelineConfig(schedule="zb_h1", microbatches=P),
                    token_loss=lambda lg, mb: lg[..., 0],
                )[0]
            ),
            params,
            batch,
        )
    # the per-layer values leave the stage's layer scan stacked: [J, P stages, replicas, ...]
    J = cfg.n_layers // P
    per_layer = sum(x.size for x in kept[0] if x.ndim >= 5 and x.shape[:2] == (J, P))
    per_token_layer = per_layer / (J * P * (B // P) * T)
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    assert per_token_layer == 8 * d + 2 * n * h + 2 * k * h + 4 * f, (
        per_token_layer,
        [x.shape for x in kept[0]],
    )
