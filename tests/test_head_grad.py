"""The LM head's hand-written gradients against plain autodiff: `models.layers.head_logits` (a
custom VJP that writes the weight gradient as one [D, V] contraction) against the einsum it
replaces, and `models.loss.token_xent`'s gathered target logit against the masked sum, per call
and through the real sharded train step (fsdp=8, both head layouts) in float32 after the warm-up:
loss, gradient norm and every parameter."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import (
    assert_runs_match,
    initial_params,
    run_steps,
    synthetic_batches,
    trainer_cache,
)

from models import layers, pieces
from models import loss as loss_mod

VOCAB = 264


def einsum_head(x, head):
    return jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)


def masked_xent(logits_BTV, targets_BT):
    """The cross-entropy with the target's logit picked by a masked sum (autodiff's gradient)."""
    shifted_BTV = logits_BTV - jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1, keepdims=True))
    lse_BT = jnp.log(jnp.sum(jnp.exp(shifted_BTV), axis=-1))
    vocab_V = jax.lax.broadcasted_iota(targets_BT.dtype, logits_BTV.shape, logits_BTV.ndim - 1)
    return lse_BT - jnp.sum(jnp.where(vocab_V == targets_BT[..., None], shifted_BTV, 0.0), axis=-1)


# the chunked loss's [B,S,C,D] too
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 5), (2, 1, 3, 5)])
def test_head_logits_matches_autodiff(shape):
    x = jax.random.normal(jax.random.key(0), (*shape[:-1], 16))
    head = jax.random.normal(jax.random.key(1), (16, 40))
    w = jax.random.normal(jax.random.key(2), (*shape[:-1], 40))

    def value_and_grads(fn):
        return jax.value_and_grad(lambda a, b: jnp.sum(fn(a, b) * w), argnums=(0, 1))(x, head)

    (got, (gx, gh)), (want, (wx, wh)) = (
        value_and_grads(layers.head_logits),
        value_and_grads(einsum_head),
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(gx, wx, rtol=1e-5, atol=1e-5 * float(jnp.abs(wx).max()))
    np.testing.assert_allclose(gh, wh, rtol=1e-5, atol=1e-5 * float(jnp.abs(wh).max()))


def test_head_logits_keeps_the_input_dtypes():
    x, head = jnp.ones((2, 3, 8), jnp.bfloat16), jnp.ones((8, 6), jnp.bfloat16)
    gx, gh = jax.grad(lambda a, b: jnp.sum(layers.head_logits(a, b)), argnums=(0, 1))(x, head)
    wx, wh = jax.grad(lambda a, b: jnp.sum(einsum_head(a, b)), argnums=(0, 1))(x, head)
    assert layers.head_logits(x, head).dtype == jnp.float32
    assert (gx.dtype, gh.dtype) == (wx.dtype, wh.dtype) == (jnp.bfloat16, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(wx, np.float32))
    np.testing.assert_array_equal(np.asarray(gh, np.float32), np.asarray(wh, np.float32))


def test_head_backward_multiplies_in_the_compute_dtype():
    """With bf16 compute the float32 logits' gradient is cast to bf16 before the two backward
    matmuls (accumulating in float32), as the forward's operands are: no float32 matmul over
    [tokens, V]. The gradients stay within bf16 rounding of the float32 ones."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 16), jnp.bfloat16)
    head = jax.random.normal(jax.random.key(1), (16, 40), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (2, 3, 40))

    def loss(a, b):
        return jnp.sum(layers.head_logits(a, b) * w)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, head)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    inner = [e for d in jaxpr.jaxpr.eqns for e in _sub_eqns(d) if e.primitive.name == "dot_general"]
    operand_dtypes = {str(v.aval.dtype) for e in dots + inner for v in e.invars}
    assert len(dots + inner) == 3 and operand_dtypes == {"bfloat16"}, operand_dtypes
    gx, gh = jax.grad(loss, argnums=(0, 1))(x, head)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    wx, wh = jax.grad(lambda a, b: jnp.sum(einsum_head(a, b) * w), argnums=(0, 1))(
        f32(x), f32(head)
    )
    np.testing.assert_allclose(f32(gx), wx, rtol=0, atol=2e-2 * float(jnp.abs(wx).max()))
    np.testing.assert_allclose(f32(gh), wh, rtol=0, atol=2e-2 * float(jnp.abs(wh).max()))


def _sub_eqns(eqn):
    """The equations of the jaxprs inside one (a custom VJP's call, a pjit)."""
    for p in eqn.params.values():
        for j in p if isinstance(p, (tuple, list)) else (p,):
            inner = getattr(j, "jaxpr", None)
            inner = getattr(inner, "jaxpr", inner)
            if hasattr(inner, "eqns"):
                for e in inner.eqns:
                    yield e
                    yield from _sub_eqns(e)


def test_token_xent_matches_the_masked_sum_outside_the_vocabulary_too():
    """A target outside [0, V) picks nothing (its shifted logit counts as 0: the loss is the
    log-sum-exp less the max logit, the gradient the softmax), as the masked sum does; a gather
    alone would wrap -1 to the last entry."""
    logits = jax.random.normal(jax.random.key(3), (2, 4, 11)) * 3
    targets = jnp.array([[0, 10, -1, 11], [5, 3, 3, 7]])
    weights = jax.random.uniform(jax.random.key(4), (2, 4))

    def f(xent):
        return jax.value_and_grad(lambda z: jnp.sum(xent(z, targets) * weights))(logits)

    (got, g), (want, w) = f(loss_mod.token_xent), f(masked_xent)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    row = logits[0, 2]
    np.testing.assert_allclose(
        loss_mod.token_xent(logits, targets)[0, 2], jax.nn.logsumexp(row) - row.max(), rtol=1e-6
    )


@contextlib.contextmanager
def autodiff_head():
    """Trace the model with the plain einsum head and the masked-sum cross-entropy; yields the
    names of the replacements that were traced (so that a test can tell they were)."""
    saved = pieces.head_logits, loss_mod.head_logits, pieces.token_xent, loss_mod.token_xent
    traced = set()

    def head(x, h):
        traced.add("head")
        return einsum_head(x, h)

    def xent(logits, targets):
        traced.add("xent")
        return masked_xent(logits, targets)

    pieces.head_logits = loss_mod.head_logits = head
    pieces.token_xent = loss_mod.token_xent = xent
    try:
        yield traced
    finally:
        pieces.head_logits, loss_mod.head_logits, pieces.token_xent, loss_mod.token_xent = saved


@pytest.mark.slow
# both head layouts and both loss forms, in two compiles: vocab-parallel with the whole logits (the
# peer shape's path), the classic head with the chunked loss
@pytest.mark.parametrize("layout,chunk", [("on", 0), ("off", 8)])
def test_sharded_step_matches_autodiff_head(tmp_path_factory, layout, chunk):
    """The real jitted step on fsdp=8 (vocab-parallel or classic head; whole or chunked loss)."""
    tr = trainer_cache(tmp_path_factory)(
        "fsdp=8", **{"parallelism.vocab_parallel": layout, "model.loss_chunk": chunk}
    )
    batches, params0 = synthetic_batches(VOCAB), initial_params(tr)
    got = run_steps(tr, batches, params0)
    with autodiff_head() as traced:
        want = run_steps(tr, batches, params0)
    assert traced == {"head", "xent"}
    assert_runs_match(
        got,
        want,
        f"head_logits + gathered target vs autodiff, vocab_parallel={layout}, chunk={chunk}",
    )
