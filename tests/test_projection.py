"""The projections' einsum (models/projection.py): autodiff's values and gradients, the weight
gradient contracted in the weight's order, and the same residuals under remat."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from models.projection import projection

# (spec, x shape, w shape): the MLP's, the fused q/k/v's, the output projection's and the stacked
# gate/up's and k/v's einsums
SPECS = [
    ("btd,df->btf", (2, 8, 16), (16, 64)),
    ("btf,fd->btd", (2, 8, 64), (64, 16)),
    ("btd,dkqh->btkqh", (2, 8, 16), (16, 2, 3, 4)),
    ("btnh,nhd->btd", (2, 8, 4, 4), (4, 4, 16)),
    ("btd,dzf->btzf", (2, 8, 16), (16, 2, 64)),
]


def operands(x_shape, w_shape, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), dtype)
    w = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(x_shape[-1]), dtype)
    return x, w


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS, ids=[s for s, *_ in SPECS])
def test_values_and_both_gradients_match_autodiff(spec, x_shape, w_shape):
    x, w = operands(x_shape, w_shape)
    g = jnp.asarray(np.random.default_rng(1).standard_normal(jnp.einsum(spec, x, w).shape))

    def loss(f):
        return lambda x, w: jnp.sum(f(spec, x, w) * g)

    np.testing.assert_allclose(projection(spec, x, w), jnp.einsum(spec, x, w), rtol=1e-6)
    got = jax.grad(loss(projection), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jnp.einsum), argnums=(0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16_gradients_keep_their_dtypes_and_values():
    spec = "btd,df->btf"
    x, w = operands((2, 8, 16), (16, 64), jnp.bfloat16)
    got = jax.grad(lambda x, w: jnp.sum(projection(spec, x, w)), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.einsum(spec, x, w)), argnums=(0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2)


def primitives(jaxpr) -> list[str]:
    """The primitives of a jaxpr, with those of the jaxprs inside its equations (jit, pjit)."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)  # a ClosedJaxpr holds its Jaxpr
            if hasattr(inner, "eqns"):
                names += primitives(inner)
    return names


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS[:4], ids=[s for s, *_ in SPECS[:4]])
def test_weight_gradient_is_one_dot_in_the_weights_order(spec, x_shape, w_shape):
    """Autodiff's weight gradient is a dot into [output dims, x dims] and a transpose; this one is
    a dot straight into the weight's dims; the input gradient is the same dot in both."""
    x, w = operands(x_shape, w_shape)

    def weight_grad(f):
        grads = jax.grad(lambda x, w: jnp.sum(f(spec, x, w) ** 2), argnums=(0, 1))
        return jax.make_jaxpr(grads)(x, w).jaxpr

    got, want = primitives(weight_grad(projection)), primitives(weight_grad(jnp.einsum))
    assert "transpose" in want  # the test can tell them apart
    assert "transpose" not in got and got.count("dot_general") == want.count("dot_general")


@pytest.mark.parametrize("policy", ["dots_with_no_batch_dims_saveable", "nothing_saveable"])
def test_remat_saves_the_same_residuals(policy):
    """The remat policies see the forward's dot as autodiff's: `dots` still saves the projection
    outputs and nothing else, `full` nothing."""
    x, w1 = operands((2, 8, 16), (16, 64))
    w2 = operands((2, 8, 64), (64, 16))[1]

    def residuals(f):
        def mlp(x, w1, w2):
            return jnp.sum(f("btf,fd->btd", jax.nn.silu(f("btd,df->btf", x, w1)), w2))

        checkpointed = jax.checkpoint(mlp, policy=getattr(jax.checkpoint_policies, policy))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(checkpointed, x, w1, w2)
        # one line per residual: its type and what it is (without the source line)
        return sorted(line.split(" from ")[0] for line in out.getvalue().splitlines())

    got, want = residuals(projection), residuals(jnp.einsum)
    assert got == want
    assert ("f32[2,8,64] output of dot_general" in got) == (policy != "nothing_saveable")
