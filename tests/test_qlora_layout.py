"""Where a quantised base lives (train/core/qlora.py, models/quant.py): on the default preset's
FSDP mesh every scale and double-quantisation step is split over the devices as its codes are
(read from the compiled step's input shardings), never held whole; the base's bytes per device
(the shardings' count, which `plan`'s formula matches to the byte) within the targets against the
bfloat16 base on the default and 1b presets as a user runs them; a run resumed on another mesh
rebuilds the same base, bit for bit, and goes on as the uninterrupted run. 8 fake CPU devices."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from equivalence import make_trainer
from test_lora import TINY, _save_base

from checkpoint.manager import open_checkpoint
from mesh.build import make_mesh
from models import model, quant
from plan.lora_memory import lora_parts
from train.core import lora, qlora
from train.core.config import build
from train.core.setup import compile_step, setup

RUN = {"lora.rank": 16, "lora.allow_random_base": True, "model.dtype": "bfloat16"}
RUN |= {"train.batch_size": 8, "train.seq_len": 64, "train.skip_memory_check": True}


def _at(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _parts(node) -> dict:
    return {
        "codes": node.codes,
        "scales": node.scales,
        "steps": node.scale_scales,
        "offset": node.scale_offset,
    }


def _split(sharding, shape) -> int:
    """How many ways `sharding` splits an array of `shape`."""
    return math.prod(shape) // math.prod(sharding.shard_shape(shape))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_scales_shard_with_their_codes_on_fsdp8(fmt):
    """The default preset (d_model 256: 32 values a shard on fsdp=8, where blocks of 64 along
    d_model straddled two shards and their scales were held whole on every device), the embedding
    and head quantised too: in the compiled step every codes, scales and steps array of the base
    is split 8 ways (the per-layer offsets, [L, 1, ...], are one value a layer)."""
    over = {**RUN, "model.preset": "default", "lora.base_dtype": fmt}
    over |= {"lora.quantize_embeddings": True, "parallelism.mesh": "fsdp=8"}
    cfg = build(over)
    s = setup(cfg, make_mesh("fsdp=8"))
    held = lora.abstract_base(cfg, s.base_shardings)
    compiled = compile_step(s).input_shardings[0][2]  # step(state, batch, base)
    weights = qlora.weights(cfg.model, lora.TARGET_WEIGHTS, True)
    assert len(weights) == 9
    for w in weights:
        arrays, shardings = _parts(_at(held, w.path)), _parts(_at(compiled, w.path))
        for name, a in arrays.items():
            if a is None or name == "offset":
                continue
            assert _split(shardings[name], a.shape) == 8, (w.path, name, a.shape, shardings[name])


def _ratios(preset: str, mesh_spec: str) -> dict:
    """base_dtype -> (its base's bytes per device, by the shardings and by `plan`'s formula)."""
    mesh = make_mesh(mesh_spec)
    out = {}
    for fmt in ("bfloat16", "int8", "nf4"):
        cfg = build({**RUN, "model.preset": preset, "lora.base_dtype": fmt})
        s = setup(cfg, mesh)
        held = lora.abstract_base(cfg, s.base_shardings)
        local = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(held)
        )
        parts = lora_parts(cfg.model, cfg.lora, mesh, s.rules, "bfloat16")
        out[fmt] = (local, parts["base"])
    return out


@pytest.mark.parametrize(
    "preset, mesh_spec", [("default", "fsdp=8"), ("default", "data=2,fsdp=4"), ("1b", "fsdp=8")]
)
def test_base_bytes_within_the_targets(preset, mesh_spec):
    """The frozen base's bytes per device against the bfloat16 base's: int8 <= 0.55, NF4 <= 0.30,
    with the defaults (blocks of 64, double quantisation, the embedding and head quantised); byte
    counts of the shardings (what the compiled step's arguments hold), equal to `plan`'s."""
    got = _ratios(preset, mesh_spec)
    for fmt, (local, planned) in got.items():
        assert local == planned, (fmt, local, planned)
    ref = got["bfloat16"][0]
    assert got["int8"][0] <= 0.55 * ref, got["int8"][0] / ref
    assert got["nf4"][0] <= 0.30 * ref, got["nf4"][0] / ref


QLORA = {
    **TINY,
    "model.remat": "none",
    "lora.rank": 4,
    "lora.alpha": 8.0,
    "lora.block_size": 32,
    "lora.base_dtype": "nf4",
    "lora.quantize_embeddings": True,
    "train.lr": 1e-2,
    "train.steps": 4,
    "train.warmup_steps": 1,
    "data.source": "synthetic",
    "checkpoint.async": False,
}


@pytest.mark.slow
def test_resume_on_another_mesh_rebuilds_the_same_base(tmp_path):
    """A QLoRA run checkpointed on fsdp=8 at step 2 and resumed on fsdp=2,model=2 (a different
    split of every weight, its blocks and scales) rebuilds the quantised base from the pointer
    bit-identical to the first run's, and ends where the uninterrupted run ends."""
    directory = str(tmp_path / "base")
    params = jax.device_get(jax.jit(lambda k: model.init(build(TINY).model, k))(jax.random.key(7)))
    _save_base(directory, params)
    first = make_trainer(
        "fsdp=8",
        tmp_path / "a",
        **QLORA,
        **{"checkpoint.every": 2, "checkpoint.init_from": directory},
    )
    first.fit()
    step2 = open_checkpoint(first.cfg.logging.run_dir)[0].step_dir(2)
    again = make_trainer("fsdp=2,model=2", tmp_path / "b", **QLORA, **{"checkpoint.resume": step2})
    again.fit()
    a, b = jax.device_get(first.base), jax.device_get(again.base)
    leaves = jax.tree.leaves(a)
    assert any(
        isinstance(x, quant.QuantizedWeight) for x in jax.tree.leaves(a, is_leaf=quant.is_lazy)
    )
    for x, y in zip(leaves, jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(
        jax.tree.leaves(jax.device_get(first.state.params)),
        jax.tree.leaves(jax.device_get(again.state.params)),
        strict=True,
    ):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    assert int(again.state.step) == 4
