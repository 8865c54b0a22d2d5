"""QLoRA (--lora.base_dtype int8|nf4, models/quant.py, train/core/qlora.py): dequantise(quantise(w))
against a numpy reference of each format (int8 per output channel; NF4 with the paper's 16 values,
with and without double quantisation) within its error bound; the QLoRA step on fsdp, fsdp x model
and pipeline meshes equal to one device after the warm-up; the step's program holds the base at
the quantised size and no [L, ...] full-precision copy of it; a checkpoint holds the adapters and
the base's pointer, a resume is exact, and the HF export (the adapters merged into the
full-precision base) computes the quantised model's logits within the quantisation's own error;
bad inputs, one line each. Float32, the tiny preset, 8 fake CPU devices."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import (
    SEQ,
    make_trainer,
    synthetic_batches,
)
from test_lora import LORA, _save_base

from checkpoint import hf
from checkpoint.layout import merged
from checkpoint.manager import open_checkpoint
from errors import UserError
from mesh.build import make_mesh
from models import model, quant
from train.core import lora, qlora
from train.core.config import build
from train.core.setup import compile_step, setup

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
    """(codes, scale) of per-output-channel int8: scale = max |w| over the input dims / 127."""
    scale = np.abs(w).max(axis=tuple(range(1, 1 + n_in)), keepdims=True) / 127
    return np.clip(np.round(w / scale), -127, 127), scale


def _tiles(x: np.ndarray, tile: tuple[int, ...]) -> np.ndarray:
    """x [.., n, ..] -> [.., n / t, t, ..] per dim."""
    return x.reshape([p for n, t in zip(x.shape, tile) for p in (n // t, t)])


def _per_tile(x: np.ndarray, tile: tuple[int, ...]) -> np.ndarray:
    """A value per tile (`x`, of shape / tile) repeated over its tile: np.kron with ones."""
    return np.kron(x, np.ones(tile, x.dtype))


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _nf4_reference(w: np.ndarray, tile: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(dequantised w, absmax per element's block) of NF4 blocks of shape `tile`: the nearest of
    the paper's 16 values (an argmin) to w / absmax."""
    odd = tuple(range(1, 2 * w.ndim, 2))
    absmax = _per_tile(np.abs(_tiles(w, tile)).max(axis=odd), tile)
    nearest = np.abs((w / absmax)[..., None] - NF4_VALUES).argmin(-1)
    return NF4_VALUES[nearest] * absmax, absmax


@pytest.mark.parametrize(
    "shape, n_in", [((3, 64, 4, 16), 1), ((2, 4, 16, 64), 2), ((2, 192, 64), 1)]
)
def test_int8_round_trip_matches_numpy(shape, n_in):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 0.02
    q = quant.quantize(w, "int8", in_dims=tuple(range(1, 1 + n_in)))
    codes, scale = _int8_reference(w, n_in)
    assert q.codes.dtype == jnp.int8 and q.scales.shape == scale.shape
    np.testing.assert_allclose(np.asarray(q.scales), scale, rtol=1e-6)
    # codes equal but at rounding ties of w / scale (float32 division in another order)
    assert np.mean(np.asarray(q.codes) == codes) > 0.999
    err = np.abs(np.asarray(q.dequantize()) - w)
    assert np.all(err <= scale / 2 * (1 + 1e-5)), "int8 error above half a step"
    assert err.max() > scale.min() / 10  # not the identity


# (shape, NF4 block tile, double-quantisation group of the scales): blocks along one dim, along
# two (whole heads of 16), a group along two dims of the scales
NF4_CASES = [
    ((3, 64, 4, 16), (1, 1, 2, 16), (1, 8, 2, 1)),
    ((2, 4, 16, 128), (1, 1, 1, 32), (1, 2, 4, 4)),
    ((2, 96, 64), (1, 32, 1), (1, 3, 16)),
]


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape, tile, group", NF4_CASES)
def test_nf4_round_trip_matches_numpy(shape, tile, group, double_quant):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(
        0.005, 0.05, shape[:1] + (1,) * (len(shape) - 1)
    ).astype(np.float32)
    q = quant.quantize(w, "nf4", in_dims=(1,), tile=tile, group=group if double_quant else ())
    deq_ref, absmax = _nf4_reference(w, tile)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (*shape[:-1], shape[-1] // 2)
    scales_shape = tuple(n // t for n, t in zip(shape, tile))
    assert q.scales.shape == scales_shape
    got = np.asarray(q.dequantize())
    half_gap = np.diff(NF4_VALUES).max() / 2  # between -1 and -0.696
    if not double_quant:
        assert q.scales.dtype == jnp.float32 and q.scale_scales is None
        np.testing.assert_allclose(_per_tile(np.asarray(q.scales), tile), absmax, rtol=1e-6)
        # the nearest value but at ties: the same reconstruction almost everywhere
        assert np.mean(np.isclose(got, deq_ref, rtol=1e-5, atol=1e-9)) > 0.999
        assert np.all(np.abs(got - w) <= absmax * half_gap * (1 + 1e-5))
    else:
        # the layout: int8 codes of the scales, a float32 step per group of them, a float32
        # offset per layer
        assert q.scales.dtype == jnp.int8 and q.scale_scales.dtype == jnp.float32
        assert q.scale_scales.shape == tuple(n // g for n, g in zip(scales_shape, group))
        assert q.scale_offset.shape == (shape[0],) + (1,) * (len(shape) - 1)
        # the scales are off by at most half an int8 step of their group's centred range
        exact = np.abs(_tiles(w, tile)).max(axis=tuple(range(1, 2 * w.ndim, 2)))
        rest = tuple(range(1, w.ndim))
        centred = exact - (exact.max(rest, keepdims=True) + exact.min(rest, keepdims=True)) / 2
        odd = tuple(range(1, 2 * w.ndim, 2))
        step = _per_tile(np.abs(_tiles(centred, group)).max(axis=odd) / 127, group)
        scales = np.asarray(q.block_scales())
        assert np.all(np.abs(scales - exact) <= step / 2 * (1 + 1e-4) + 1e-9)
        assert np.abs(scales - exact).max() > 0  # really quantised
        scale_err = _per_tile(step / 2, tile)
        assert np.all(np.abs(got - w) <= absmax * half_gap * (1 + 1e-4) + scale_err * (1 + 1e-4))
    assert np.abs(got - w).max() > 0


def test_double_quantisation_costs_about_an_eighth_of_a_bit():
    """The paper's section 3: 8-bit block scales and a float32 per 256 of them, 8 / 64 + 32 /
    (64 x 256) = 0.127 bits per value (with the offset, one float32 per layer), against 0.5 for
    float32 block scales: one layer of each of the 1b preset's projections (groups of 256)."""
    cfg = build({"model.preset": "1b", "lora.base_dtype": "nf4"})
    full = model.abstract_params(cfg.model)
    for w in qlora.weights(cfg.model, lora.TARGET_WEIGHTS):
        shape = _at(full, w.path).shape
        one = (1, *shape[1:])  # one layer
        tile = qlora.nf4_tile(w, one, 64)
        scales = tuple(n // t for n, t in zip(one, tile))
        group = qlora.dq_group(scales, 1)
        assert np.prod(group) == 256, (w.path, group)
        got = jax.eval_shape(
            lambda a, tile=tile, group=group: quant.quantize(
                a, "nf4", in_dims=(1,), tile=tile, group=group
            ),
            jax.ShapeDtypeStruct(one, jnp.float32),
        )
        scale_bits = sum(
            np.prod(a.shape) * np.dtype(a.dtype).itemsize * 8
            for a in (got.scales, got.scale_scales, got.scale_offset)
        )
        assert scale_bits / np.prod(one) == pytest.approx(8 / 64 + 32 / (64 * 256), abs=1e-4)


def test_pack_round_trip():
    codes = jnp.asarray(np.random.default_rng(2).integers(0, 16, (3, 5, 8)), jnp.uint8)
    packed = quant.pack(codes)
    assert packed.shape == (3, 5, 4) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(quant.unpack(packed)), np.asarray(codes))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(the full-precision base's checkpoint directory, its params on the host)."""
    directory = str(tmp_path_factory.mktemp("base"))
    params = jax.device_get(jax.jit(lambda k: model.init(build(TINY).model, k))(jax.random.key(7)))
    _save_base(directory, params)
    return directory, params


def _hlo_and_arguments(cfg) -> tuple[str, int]:
    """The compiled step's optimized HLO and its argument bytes, on one device."""
    s = setup(cfg, make_mesh("data=1", devices=jax.devices()[:1]))
    compiled = compile_step(s)
    return compiled.as_text(), compiled.memory_analysis().argument_size_in_bytes


def test_step_holds_the_base_quantised_and_no_full_precision_stack():
    """The step's program takes the base at its quantised size, and no float32 array of a whole
    layer stack's weight shape ([L, D, F]) appears in it: each layer's weights are dequantised
    inside the scan (the float32 base's LoRA step, the control, holds them whole)."""
    over = {**TINY, "model.n_layers": 4, "model.remat": "none", "lora.rank": 4}
    over |= {"lora.quantize_embeddings": False}  # the projections' bytes alone
    over |= {"lora.allow_random_base": True, "train.batch_size": 2, "train.seq_len": 16}
    stack = "f32[4,64,192]"  # w_gate_DF / w_up_DF of the 4-layer stack
    cfg = build(over)
    hlo, full_bytes = _hlo_and_arguments(cfg)
    assert stack in hlo
    full = model.abstract_params(cfg.model)
    base_bytes = sum(x.size * 4 for x in jax.tree.leaves(full))
    proj_bytes = 0
    for w in qlora.weights(cfg.model, lora.TARGET_WEIGHTS):
        node = full
        for key in w.path:
            node = node[key]
        proj_bytes += node.size * 4
    # bits per value of the projections: 8 (+ a float32 scale per output channel), 4 (+ 8 bits per
    # 32-value block and a float32 per row of blocks)
    for fmt, low, high in (("int8", 0.25, 0.27), ("nf4", 0.125, 0.15)):
        hlo, got = _hlo_and_arguments(
            build({**over, "lora.base_dtype": fmt, "lora.block_size": 32})
        )
        assert stack not in hlo, f"{fmt}: a full-precision stack of the base is materialised"
        assert "f32[64,192]" in hlo  # one layer's gate (and up), dequantised
        # the step's other arguments (adapters, optimizer state, batch) are the float32 run's;
        # the embedding, head and norms stay float32 (the compute dtype here)
        got_proj = got - (full_bytes - base_bytes) - (base_bytes - proj_bytes)
        assert low * proj_bytes < got_proj < high * proj_bytes, (fmt, got_proj / proj_bytes)


@pytest.mark.slow
def test_checkpoint_resume_and_export_merge(base, tmp_path):
    """fit() saves the adapters (and their optimizer state) with the base's pointer; a resume from
    step 2 rebuilds the quantised base and ends bit-identical; the export merges the adapters into
    the full-precision base, whose logits differ from the quantised model's by about the
    quantisation's own effect on the base."""
    over = {**QLORA, "lora.base_dtype": "nf4", "checkpoint.every": 2, "checkpoint.async": False}
    tr = make_trainer(
        "fsdp=2,model=2", tmp_path / "run", **over, **{"checkpoint.init_from": base[0]}
    )
    tr.fit()
    src, last = open_checkpoint(tr.cfg.logging.run_dir)
    names = [name for name, _, _ in src.arrays(last)]
    params = [n for n in names if n.startswith("params/")]
    assert params and all(n.endswith(("/lora_a", "/lora_b")) for n in params), params
    saved = src.meta(last)["config"]
    assert saved["lora"]["base_dtype"] == "nf4" and saved["lora"]["base_fingerprint"]
    assert saved["checkpoint"]["init_from"].startswith(base[0])

    again = make_trainer(
        "fsdp=2,model=2", tmp_path / "again", **over, **{"checkpoint.resume": src.step_dir(2)}
    )
    again.fit()  # no --init-from: the base comes from the pointer, quantised again
    a, b = jax.device_get(again.state.params), jax.device_get(tr.state.params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)

    exported = hf.load_checkpoint(tr.cfg.logging.run_dir)
    hf.save_pretrained(exported, str(tmp_path / "hf"))
    plain = hf.from_pretrained(str(tmp_path / "hf"), dtype="float32")
    tokens = synthetic_batches(264, n=1)[0]["inputs"][:2, :SEQ]
    logits = jax.jit(lambda p: model.apply(tr.cfg.model, p, tokens)[0])
    cfg = tr.cfg
    quantised_base = jax.jit(lambda p: qlora.quantize_base(cfg, lora.TARGET_WEIGHTS, p))(base[1])
    export, qlora_run = logits(plain.params), logits(tr.model_params(tr.state))
    full_base, deq_base = logits(base[1]), logits(quantised_base)
    quant_effect = float(np.abs(np.asarray(full_base) - np.asarray(deq_base)).max())
    gap = float(np.abs(np.asarray(export) - np.asarray(qlora_run)).max())
    moved = float(np.abs(np.asarray(export) - np.asarray(full_base)).max())
    assert 0 < gap <= 1.5 * quant_effect + 1e-5, (gap, quant_effect)
    # the quantised model is exactly the dequantised base with the adapters merged
    adapters = jax.device_get(tr.state.params)
    dequantised = merged(quant.materialise(quantised_base), adapters, lora.scale(cfg.lora))
    np.testing.assert_allclose(logits(dequantised), qlora_run, rtol=1e-5, atol=1e-5)
    assert moved > 1e-3, "the export must hold the adapters' change"


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"lora.base_dtype": "int4"}, "--lora.base_dtype: 'int4' is not one of auto, float32,"),
        (
            {"lora.base_dtype": "nf4", "lora.block_size": 48},
            "--lora.block_size 48 does not tile blocks/attn/wq_DNH (nf4 blocks run along its"
            " heads=4 x head_dim=16, innermost first); valid: e.g. 16, 32",
        ),
        ({"lora.base_dtype": "nf4", "lora.block_size": 0}, "--lora.block_size 0: must be"),
        (
            {"lora.base_dtype": "int8", "model.matmul_precision": "fp8"},
            "--lora.base_dtype int8: not with --model.matmul_precision fp8",
        ),
        (
            {"lora.base_dtype": "nf4", "lora.block_size": 1, "model.d_ff": 191},
            "--lora.base_dtype nf4: blocks/mlp/w_gate_DF's last dim is odd",
        ),
        (
            {"lora.base_dtype": "nf4", "lora.block_size": 32, "model.vocab_size": 263},
            "--lora.base_dtype nf4: lm_head_DV's last dim is odd (263); nf4 packs two codes a byte"
            " along it: use --lora.base_dtype int8 or --lora.quantize_embeddings false",
        ),
    ],
)
def test_bad_inputs(flags, message):
    with pytest.raises(UserError, match=re.escape(message)) as err:
        lora.check_run(build({"model.preset": "tiny", "lora.rank": 4, **flags}))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line(tmp_path):
    flags = ["--model", "tiny", "--lora.rank", "4", "--lora.base_dtype", "nf4"]
    flags += ["--lora.block_size", "48", "--lora.allow_random_base", "true", "--steps", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "train", *flags, "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--lora.block_size 48 does not tile blocks/attn/wq_DNH" in lines[0]
