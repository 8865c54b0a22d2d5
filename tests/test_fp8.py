"""FP8 matmuls (models/fp8.py): per-tensor current scaling, e4m3 operands, e5m2 output gradients.
Checked against the same rounding done by hand with ml_dtypes' float8 types in numpy."""

import equivalence
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from errors import UserError
from models import fp8
from models.config import ModelConfig


def hand_round(x: np.ndarray, dtype) -> np.ndarray:
    """Per-tensor scaling by hand: max|x| onto the format's largest finite value, round, scale back."""
    top = float(ml_dtypes.finfo(dtype).max)
    scale = np.abs(x).max() / top
    return np.clip(x / scale, -top, top).astype(dtype).astype(np.float32) * scale


def operands(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    w = (0.1 * rng.standard_normal((32, 48))).astype(np.float32)
    g = rng.standard_normal((2, 8, 48)).astype(np.float32)
    return x, w, g


def test_rounding_is_per_tensor_and_within_the_formats_precision():
    x, _, _ = operands()
    for dtype, mantissa_bits in ((fp8.FORWARD, 3), (fp8.BACKWARD, 2)):
        got = np.asarray(fp8.round_scaled(jnp.asarray(x), dtype))
        np.testing.assert_allclose(got, hand_round(x, dtype), rtol=1e-6)
        # the largest magnitude lands on the format's top value, so it comes back (almost) unchanged
        assert abs(np.abs(got).max() - np.abs(x).max()) <= 1e-6 * np.abs(x).max()
        # normal values are off by at most half a unit in the last place: 2^-(bits+1) relative
        normal = np.abs(x) > np.abs(x).max() / 2**6
        assert np.all(
            np.abs(got - x)[normal] <= 2.0 ** -(mantissa_bits + 1) * np.abs(x)[normal] * 1.0001
        )
        assert np.any(got != x)  # it does round
    zeros = np.asarray(fp8.round_scaled(jnp.zeros((3, 3)), fp8.FORWARD))
    assert np.all(zeros == 0) and np.all(np.isfinite(zeros))


def test_fp8_einsum_forward_and_both_gradients_match_the_hand_recipe():
    x, w, g = operands()
    xq, wq = hand_round(x, ml_dtypes.float8_e4m3fn), hand_round(w, ml_dtypes.float8_e4m3fn)
    gq = hand_round(g, ml_dtypes.float8_e5m2)

    def loss(x, w):
        return jnp.sum(fp8.einsum("btd,df->btf", x, w, True) * g)

    y = fp8.einsum("btd,df->btf", jnp.asarray(x), jnp.asarray(w), True)
    np.testing.assert_allclose(
        np.asarray(y), np.einsum("btd,df->btf", xq, wq), rtol=1e-5, atol=1e-6
    )
    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(jnp.asarray(x), jnp.asarray(w))
    # input gradient: e5m2 output gradient times the e4m3 weight; weight gradient: the e4m3 input
    # times the e5m2 output gradient (what an FP8 GEMM computes in the backward)
    np.testing.assert_allclose(
        np.asarray(gx), np.einsum("btf,df->btd", gq, wq), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(gw), np.einsum("btd,btf->df", xq, gq), rtol=1e-5, atol=1e-6
    )


def test_off_is_the_plain_einsum():
    x, w, _ = operands(1)
    got = fp8.einsum("btd,df->btf", jnp.asarray(x), jnp.asarray(w), False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.einsum("btd,df->btf", x, w)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_output_keeps_the_compute_dtype(dtype):
    x, w, _ = operands(2)
    assert (
        fp8.einsum("btd,df->btf", jnp.asarray(x, dtype), jnp.asarray(w, dtype), True).dtype == dtype
    )


def test_fp8_training_on_a_mesh_tracks_the_plain_run(tmp_path):
    """FP8 projections on data=2,fsdp=2,model=2 (the per-tensor scale is a max over the sharded
    tensor) train as the float32 model does: each step's loss within 1% and gradient norm within 5%,
    and not equal to it (the rounding is on)."""
    batches = equivalence.synthetic_batches(256)
    runs = {}
    for precision in ("default", "fp8"):
        tr = equivalence.make_trainer(
            "data=2,fsdp=2,model=2", tmp_path / precision, **{"model.matmul_precision": precision}
        )
        runs[precision] = equivalence.run_steps(tr, batches, equivalence.initial_params(tr))[
            "metrics"
        ]
    for plain, rounded in zip(runs["default"], runs["fp8"]):
        assert np.isfinite(float(rounded["loss"]))
        assert abs(float(rounded["loss"]) / float(plain["loss"]) - 1) < 0.01
        assert abs(float(rounded["grad_norm"]) / float(plain["grad_norm"]) - 1) < 0.05
    assert any(float(r["loss"]) != float(p["loss"]) for p, r in zip(runs["default"], runs["fp8"]))


def test_attention_kind_by_backend_and_length_and_cudnn_off_a_gpu_is_one_line():
    cfg, auto = ModelConfig(attention="cudnn"), ModelConfig()
    assert cfg.attention_kind("gpu", 1024) == "cudnn"
    assert (
        auto.attention_kind("cpu", 1024) == "dense"
        and auto.attention_kind("cpu", 2048) == "blockwise"
    )
    assert (
        auto.attention_kind("gpu", 8192) == "jax"
        and auto.attention_kind("gpu", 8192, packed=True) == "blockwise"
    )
    with pytest.raises(
        UserError, match="attention 'cudnn' needs an NVIDIA GPU.*valid here: auto, dense, blockwise"
    ):
        cfg.attention_kind("cpu", 1024)
