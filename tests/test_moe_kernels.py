"""models/moe_kernels.py and the router's top-k: the padded-block kernel's hand-written backward
against autodiff of a per-row reference (skewed loads, empty experts, padding rows), the top-k by
argmaxes against lax.top_k, and what the compiled MoE layer moves between devices. float32."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from mesh.build import make_mesh
from mesh.rules import axis_rules, logical_to_spec, make_rules
from models import moe, moe_router
from models.moe_kernels import gmm_blocks
from models.presets import PRESETS

D, F = 16, 24


def _weights(x_count, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (x_count, D, F)) / D**0.5,
        jax.random.normal(ks[1], (x_count, D, F)) / D**0.5,
        jax.random.normal(ks[2], (x_count, F, D)) / F**0.5,
    )


def ffn(x_RD, wg_DF, wu_DF, wd_FD):
    return (jax.nn.silu(x_RD @ wg_DF) * (x_RD @ wu_DF)) @ wd_FD


def _per_row(x_RD, g_R, wg, wu, wd):
    """Each row through its own expert's FFN, padding rows (id == X) to 0: autodiff's reference."""
    x_count = wg.shape[0]

    def one(x, g):
        w = jnp.minimum(g, x_count - 1)
        return jnp.where(g < x_count, ffn(x[None], wg[w], wu[w], wd[w])[0], 0)

    return jax.vmap(one)(x_RD, g_R)


@pytest.mark.parametrize("case", ["balanced", "one expert takes all", "empty experts and padding"])
def test_blocks_kernel_equals_per_row_with_gradients(case):
    rows, x_count, block = 40, 4, 8
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (rows, D))
    g = {
        "balanced": jax.random.randint(ks[1], (rows,), 0, x_count),
        "one expert takes all": jnp.full((rows,), 2, jnp.int32),
        "empty experts and padding": jnp.where(
            jnp.arange(rows) < 25, jax.random.randint(ks[1], (rows,), 1, 3), x_count
        ),
    }[case].astype(jnp.int32)
    w = _weights(x_count)
    probe = jax.random.normal(ks[2], (rows, D))
    got_fn = lambda x, *w: jnp.sum(gmm_blocks(x, g, *w, block) * probe)  # noqa: E731
    ref_fn = lambda x, *w: jnp.sum(_per_row(x, g, *w) * probe)  # noqa: E731
    np.testing.assert_allclose(
        jax.jit(lambda x, *w: gmm_blocks(x, g, *w, block))(x, *w),
        _per_row(x, g, *w),
        atol=1e-5,
        rtol=1e-5,
    )
    got = jax.jit(jax.grad(got_fn, argnums=(0, 1, 2, 3)))(x, *w)
    ref = jax.jit(jax.grad(ref_fn, argnums=(0, 1, 2, 3)))(x, *w)
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), got, ref):
        assert float(jnp.max(jnp.abs(b))) > 0, name
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)


def test_blocks_kernel_in_bfloat16_follows_float32():
    """bf16 inputs: forward and gradients within bf16 rounding of the float32 kernel (the weight
    gradients accumulate in float32 across blocks)."""
    rows, x_count, block = 64, 4, 8
    x = jax.random.normal(jax.random.key(2), (rows, D))
    g = jax.random.randint(jax.random.key(3), (rows,), 0, x_count).astype(jnp.int32)
    w = _weights(x_count, seed=4)
    loss = lambda x, *w: jnp.sum(gmm_blocks(x, g, *w, block).astype(jnp.float32) ** 2)  # noqa: E731
    f32 = jax.grad(loss, argnums=(0, 1, 2, 3))(x, *w)
    bf16 = jax.grad(loss, argnums=(0, 1, 2, 3))(*(a.astype(jnp.bfloat16) for a in (x, *w)))
    for a, b in zip(bf16, f32):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(a, np.float32), b, atol=0.05 * float(jnp.max(jnp.abs(b)))
        )


def test_top_k_by_argmax_equals_lax_top_k_with_ties():
    s = jax.random.normal(jax.random.key(5), (3, 7, 8))
    s = s.at[0, 0].set(
        jnp.array([1, 3, 3, 0, 3, 2, 2, 1.0])
    )  # ties: the lower index first, as lax.top_k
    for k in (1, 2, 4):
        np.testing.assert_array_equal(moe_router.top_k(s, k), lax.top_k(s, k)[1])


def test_router_stays_on_each_devices_tokens():
    """On a batch-sharded mesh the compiled MoE layer (forward and backward) never gathers the
    router's [B, T, E] scores: each device ranks its own tokens (lax.top_k made GSPMD gather them
    onto every device)."""
    cfg = dataclasses.replace(PRESETS["moe-tiny"], dtype="float32")
    b, t, d, e = 8, 8, cfg.d_model, cfg.n_experts
    ks = jax.random.split(jax.random.key(6), 5)
    x = jax.random.normal(ks[0], (b, t, d))
    w = (
        0.3 * jax.random.normal(ks[1], (d, e)),
        *(
            jax.random.normal(k, s) / 8
            for k, s in zip(ks[2:], ((e, d, cfg.expert_width),) * 2 + ((e, cfg.expert_width, d),))
        ),
    )

    def loss(x, router, wg, wu, wd):
        idx, gate, _ = moe.route(cfg, x, router)
        return jnp.sum(moe.experts(cfg, x, idx, gate, wg, wu, wd)[0] ** 2)

    with jax.set_mesh(make_mesh("fsdp=2,expert=4")), axis_rules(make_rules()):
        x = jax.device_put(x, logical_to_spec(moe.TOKENS_BT))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, *w).compile().as_text()
    gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
    assert any(shape.startswith(f"f32[{e // 4},") for shape in gathered), (
        gathered
    )  # the experts' FSDP gather
    assert not [shape for shape in gathered if f"[{b},{t},{e}]" in shape], gathered
