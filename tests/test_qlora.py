"""QLoRA (--lora.base_dtype int8|nf4, models/quant.py, train/core/qlora.py): dequantise(quantise(w))
against a numpy reference of each format (int8 per output channel; NF4 with the paper's 16 values,
with and without double quantisation) within its error bound; the QLoRA step on fsdp, fsdp x model
and pipeline meshes equal to one device after the warm-up; the step's program holds the base at
the quantised size and no [L, ...] full-precision copy of it; a checkpoint holds the adapters and
the base's pointer, a resume is exact, and the HF export (the adapters merged into the
full-precision base) computes the quantised model's logits within the quantisation's own error;
bad inputs, one line each. Float32, the tiny preset, 8 fake CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import (
    COMPARED,
    SEQ,
    WARMUP,
    assert_runs_match,
    make_trainer,
    synthetic_batches,
)
from test_lora import LORA, _save_base

from checkpoint import hf
from checkpoint.manager import open_checkpoint
from errors import UserError
from mesh.rules import axis_rules
from models import model, quant
from train.core import lora, qlora
from train.core.config import build
from train.core.setup import compile_step, create_state
from train.core.state import TrainState

TINY = {"model.preset": "tiny", "model.dtype": "float32"}
# the tiny model's d_model is 64: two NF4 blocks of 32 per row
QLORA = {**LORA, "lora.block_size": 32}
# Appendix E of Dettmers et al. 2023 (arXiv:2305.14314), as bitsandbytes ships it
NF4_VALUES = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)


def _int8_reference(w: np.ndarray, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale) of per-output-channel absmax int8: scale = max |w| over the input dims / 127."""
    scale = np.abs(w).max(axis=tuple(range(1, 1 + n_in)), keepdims=True) / 127
    return np.clip(np.round(w / scale), -127, 127), scale


def _nf4_reference(w: np.ndarray, block_dim: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(dequantised w, absmax per element's block) of NF4 blocks along `block_dim`."""
    shape = w.shape
    split = (*shape[:block_dim], shape[block_dim] // block, block, *shape[block_dim + 1 :])
    blocks = w.reshape(split)
    absmax = np.abs(blocks).max(axis=block_dim + 1, keepdims=True)
    nearest = np.abs(blocks[..., None] / absmax[..., None] - NF4_VALUES).argmin(-1)
    deq = NF4_VALUES[nearest] * absmax
    return deq.reshape(shape), np.broadcast_to(absmax, split).reshape(shape)


@pytest.mark.parametrize(
    "shape, n_in", [((3, 64, 4, 16), 1), ((2, 4, 16, 64), 2), ((2, 192, 64), 1)]
)
def test_int8_round_trip_matches_numpy(shape, n_in):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 0.02
    q = quant.quantize(w, "int8", n_in=n_in, block_dim=1)
    codes, scale = _int8_reference(w, n_in)
    assert q.codes.dtype == jnp.int8 and q.scales.shape == scale.shape
    np.testing.assert_allclose(np.asarray(q.scales), scale, rtol=1e-6)
    # codes equal but at rounding ties of w / scale (float32 division in another order)
    assert np.mean(np.asarray(q.codes) == codes) > 0.999
    err = np.abs(np.asarray(q.dequantize()) - w)
    assert np.all(err <= scale / 2 * (1 + 1e-5)), "int8 error above half a step"
    assert err.max() > scale.min() / 10  # not the identity


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape, block_dim", [((3, 64, 4, 16), 1), ((2, 4, 16, 128), 3)])
def test_nf4_round_trip_matches_numpy(shape, block_dim, double_quant):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(
        0.005, 0.05, shape[:1] + (1,) * (len(shape) - 1)
    ).astype(np.float32)
    q = quant.quantize(w, "nf4", n_in=1, block_dim=block_dim, block=32, double_quant=double_quant)
    deq_ref, absmax = _nf4_reference(w, block_dim, 32)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (*shape[:-1], shape[-1] // 2)
    got = np.asarray(q.dequantize())
    half_gap = np.diff(NF4_VALUES).max() / 2  # between -1 and -0.696
    if not double_quant:
        np.testing.assert_allclose(np.asarray(q.block_scales()).max(), absmax.max(), rtol=1e-6)
        # the nearest value but at ties: the same reconstruction almost everywhere
        assert np.mean(np.isclose(got, deq_ref, rtol=1e-5, atol=1e-9)) > 0.999
        assert np.all(np.abs(got - w) <= absmax * half_gap * (1 + 1e-5))
    else:
        # the scales are off by at most half an int8 step of their centred range
        scales = np.asarray(q.block_scales())
        split = list(scales.shape)
        exact = np.abs(w.reshape(*shape[:block_dim], split[block_dim], 32, *shape[block_dim + 1 :]))
        exact = exact.max(axis=block_dim + 1)
        centred = exact - exact.mean(axis=tuple(range(1, w.ndim)), keepdims=True)
        step = np.abs(centred).max(axis=block_dim, keepdims=True) / 127
        assert np.all(np.abs(scales - exact) <= step / 2 * (1 + 1e-4) + 1e-9)
        scale_err = np.repeat(step / 2, shape[block_dim], axis=block_dim)
        assert np.all(np.abs(got - w) <= absmax * half_gap * (1 + 1e-4) + scale_err * (1 + 1e-4))
    assert np.abs(got - w).max() > 0


def test_pack_round_trip():
    codes = jnp.asarray(np.random.default_rng(2).integers(0, 16, (3, 5, 8)), jnp.uint8)
    packed = quant.pack(codes)
    assert packed.shape == (3, 5, 4) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(quant.unpack(packed)), np.asarray(codes))
