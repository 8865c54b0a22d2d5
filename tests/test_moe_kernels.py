"""models/moe_kernels.py and the router's top-k: the padded-block kernel's hand-written backward,
its einsum slots (every row fits, exactly fits, one row too many) and the ragged_dot kernel against
autodiff of a per-row reference (block sizes, partial blocks,
skewed loads, empty experts, padding rows), the top-k by argmaxes against lax.top_k, and what the
compiled MoE layer moves between devices. float32."""

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
from models.moe_kernels import gmm_blocks, gmm_ragged
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

    def one(x_D, g):
        e = jnp.minimum(g, x_count - 1)
        return jnp.where(g < x_count, ffn(x_D[None], wg[e], wu[e], wd[e])[0], 0)

    return jax.vmap(one)(x_RD, g_R)


def _routing(kind: str, rows: int, x_count: int, rng) -> np.ndarray:
    """Expert ids of `rows` rows (x_count: a padding row, which must come out 0)."""
    if kind == "balanced":
        return rng.integers(0, x_count, rows)
    if kind == "round robin":  # every expert the same number of rows
        return np.arange(rows) % x_count
    if (
        kind == "skewed"
    ):  # 7 of 8 rows to expert 0, the rest to the last; the experts between get none
        return np.where(rng.random(rows) < 7 / 8, 0, x_count - 1)
    if kind == "one expert":
        return np.full(rows, x_count // 2)
    if kind == "empty experts and padding":  # the first and last expert get none; 3/8 padding
        return np.where(
            np.arange(rows) < rows * 5 // 8, rng.integers(1, x_count - 1, rows), x_count
        )
    assert kind == "all padding", kind
    return np.full(rows, x_count)


KERNEL_CASES = [  # rows, experts, block, routing
    (40, 4, 8, "balanced"),  # partial last blocks
    (40, 4, 8, "skewed"),
    (40, 4, 8, "one expert"),  # 5 whole blocks of one expert
    (40, 4, 8, "empty experts and padding"),
    (64, 4, 16, "round robin"),  # whole blocks only
    (1, 4, 8, "balanced"),  # one row: one block, 7 padding rows
    (7, 3, 1, "balanced"),  # a block per row: no padding
    (33, 3, 4, "skewed"),  # odd sizes: every used expert ends in a partial block
    (40, 4, 64, "balanced"),  # a block longer than all the rows
    (96, 8, 16, "skewed"),
    (16, 4, 8, "all padding"),  # no used block: output and gradients 0
]


@pytest.mark.parametrize(
    "rows,x_count,block,kind",
    KERNEL_CASES,
    ids=[f"{r}x{x}-b{b}-{k}" for r, x, b, k in KERNEL_CASES],
)
def test_kernels_equal_per_row_with_gradients(rows, x_count, block, kind):
    """gmm_blocks (the hand-written backward) and gmm_ragged against autodiff of the per-row
    reference: the output and the gradients of the rows and the three expert weights."""
    rng = np.random.default_rng(rows * 100 + block)
    g = jnp.asarray(_routing(kind, rows, x_count, rng), jnp.int32)
    ks = jax.random.split(jax.random.key(rows), 2)
    x, probe = jax.random.normal(ks[0], (rows, D)), jax.random.normal(ks[1], (rows, D))
    w = _weights(x_count, seed=block)
    most = int(np.max(np.bincount(np.asarray(g), minlength=x_count + 1)[:x_count]))
    kernels = {
        "blocks": lambda x, *w: gmm_blocks(x, g, *w, block),
        # with einsum slots: every row fits (the slots' einsum), the fullest expert fills its
        # slots exactly, and one row too many for them (the blocks)
        "slots": lambda x, *w: gmm_blocks(x, g, *w, block, capacity=rows),
        "slots, full": lambda x, *w: gmm_blocks(x, g, *w, block, capacity=max(most, 1)),
        "past the slots": lambda x, *w: gmm_blocks(x, g, *w, block, capacity=max(most - 1, 1)),
        "ragged": lambda x, *w: gmm_ragged(x, g, *w),
        "per row": lambda x, *w: _per_row(x, g, *w),
    }

    def outputs_and_grads(x, *w):
        out = {}
        for name, f in kernels.items():
            y, vjp = jax.vjp(f, x, *w)
            out[name] = (y, *vjp(probe))
        return out

    got = jax.jit(outputs_and_grads)(x, *w)
    ref = got.pop("per row")
    used = bool(np.any(np.asarray(g) < x_count))
    for kernel, values in got.items():
        for what, a, b in zip(("output", "x", "w_gate", "w_up", "w_down"), values, ref):
            scale = float(jnp.max(jnp.abs(b)))
            assert (scale > 0) == used, (kernel, what, scale)
            np.testing.assert_allclose(
                a, b, rtol=1e-5, atol=1e-5 * max(scale, 1.0), err_msg=f"{kernel} {what}"
            )


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
