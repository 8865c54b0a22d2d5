"""models/dense_attention.py: the dense attention's hand-written backward against autodiff of
jax.nn.dot_product_attention (XLA's), and a bf16 train step's matmuls all in bf16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import dense_attention
from models import model as model_lib
from models.blockwise import visible
from models.presets import PRESETS


def _inputs(dtype, b=2, t=12, n=4, k=2, h=8):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk = jax.random.normal(keys[1], (b, t, k, h), dtype)
    v = jax.random.normal(keys[2], (b, t, k, h), dtype)
    w = jax.random.normal(keys[3], (b, t, n, h))  # a cotangent that weighs every output
    return q, kk, v, w


def _value_and_grads(fn, q, k, v, w):
    return jax.value_and_grad(
        lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w), argnums=(0, 1, 2)
    )(q, k, v)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("segments", [False, True])
def test_matches_xla_attention_in_float32(window, segments):
    """Grouped-query heads, causal, with a sliding window and packed segments: the values and the
    three gradients as jax.nn.dot_product_attention's (implementation "xla") to float32 rounding."""
    q, k, v, w = _inputs(jnp.float32)
    t = q.shape[1]
    seg_BT = jnp.array([[0] * 5 + [1] * 7, [0] * 12])
    seen_1TS = visible(
        jnp.arange(t)[None, :, None], jnp.arange(t)[None, None, :], None, None, window
    )
    if segments:
        seen_1TS = seen_1TS & (seg_BT[:, :, None] == seg_BT[:, None, :])
    mask_B1TS = jnp.broadcast_to(seen_1TS, (2, t, t))[:, None]
    (got, g_got) = _value_and_grads(lambda *a: dense_attention.attend(*a, seen_1TS), q, k, v, w)
    (want, g_want) = _value_and_grads(
        lambda *a: jax.nn.dot_product_attention(*a, mask=mask_B1TS, implementation="xla"),
        q,
        k,
        v,
        w,
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(b).max()))


def test_bf16_within_bf16_rounding_of_float32():
    q, k, v, w = _inputs(jnp.bfloat16)
    t = q.shape[1]
    seen_1TS = visible(jnp.arange(t)[None, :, None], jnp.arange(t)[None, None, :], None, None, 0)
    _, g_bf16 = _value_and_grads(lambda *a: dense_attention.attend(*a, seen_1TS), q, k, v, w)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    _, g_f32 = _value_and_grads(lambda *a: dense_attention.attend(*a, seen_1TS), *f32, w)
    for a, b in zip(g_bf16, g_f32):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            a.astype(jnp.float32), b, rtol=0, atol=3e-2 * float(jnp.abs(b).max())
        )


def _dot_operand_dtypes(jaxpr) -> set[str]:
    """The operand dtypes of every dot_general in a jaxpr, nested jaxprs (scans, custom VJPs,
    remat) included."""
    out = set()
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out |= {str(v.aval.dtype) for v in e.invars}
        for p in e.params.values():
            for j in p if isinstance(p, (tuple, list)) else (p,):
                inner = j if hasattr(j, "eqns") else getattr(j, "jaxpr", None)
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    out |= _dot_operand_dtypes(inner)
    return out


def test_a_bf16_train_step_multiplies_in_bf16_only():
    """Forward, remat and backward of the tiny decoder at bf16 compute: every matmul takes bf16
    operands (accumulating in float32). Autodiff of XLA's attention multiplied the float32 score
    gradient by q and k promoted to float32."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16", n_layers=2, vocab_size=64)
    params = model_lib.init(cfg, jax.random.key(0))
    tokens = jnp.zeros((2, 17), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss(p):
        return model_lib.objective(cfg, p, batch)[0]

    assert _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr) == {"bfloat16"}
