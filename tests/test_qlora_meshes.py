"""QLoRA on meshes: a QLoRA run of the tiny model (NF4 with double quantisation, the embedding and
head quantised as by default and at the compute dtype, and int8) on fsdp, fsdp x model and
pipeline (GPipe, 1F1B) meshes equals the same run on one device after the warm-up (loss, gradient
norm, adapters over 5 steps), each quantising the same full-precision base at load
(lora.load_base, as a run does) into its own shardings, to the same codes. Float32, 8 fake CPU
devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from equivalence import (
    COMPARED,
    COMPARISON_COMPILE,
    WARMUP,
    assert_runs_match,
    make_trainer,
    synthetic_batches,
)
from test_lora import TINY, _save_base

from mesh.rules import axis_rules
from models import model, quant
from train.core import lora
from train.core.config import build
from train.core.setup import create_state, jit_step
from train.core.state import TrainState

# the tiny model's d_model is 64: two NF4 blocks of 32 per row; a rate high enough that five steps
# on one batch lower the loss
QLORA = {
    "model.preset": "tiny",
    "model.remat": "none",
    "lora.rank": 4,
    "lora.alpha": 8.0,
    "lora.block_size": 32,
    "train.lr": 1e-2,
    "data.source": "synthetic",
}
MICRO = 4
# name -> (mesh, overrides)
CASES = {
    "fsdp-nf4": ("fsdp=8", {"lora.base_dtype": "nf4"}),
    "fsdp-model-int8": ("fsdp=4,model=2", {"lora.base_dtype": "int8"}),
    "fsdp-model-nf4": ("fsdp=4,model=2", {"lora.base_dtype": "nf4"}),
    # the embedding and head at the compute dtype (quantised by default)
    "fsdp-model-nf4-plain-embeddings": (
        "fsdp=4,model=2",
        {"lora.base_dtype": "nf4", "lora.quantize_embeddings": False},
    ),
    "gpipe-nf4": (
        "pipeline=2,fsdp=2,model=2",
        {"lora.base_dtype": "nf4", "pipeline.microbatches": MICRO, "pipeline.schedule": "gpipe"},
    ),
    "1f1b-int8": (
        "pipeline=2,fsdp=2,model=2",
        {"lora.base_dtype": "int8", "pipeline.microbatches": MICRO, "pipeline.schedule": "1f1b"},
    ),
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("base"))
    params = jax.device_get(jax.jit(lambda k: model.init(build(TINY).model, k))(jax.random.key(7)))
    _save_base(directory, params)
    return directory


def _run(tr, batches, adapters0) -> dict:
    """The real jitted QLoRA step over `batches` from `adapters0`, on the base quantised at load."""
    s = tr.setup
    base, _, _, _ = lora.load_base(tr.cfg, s.mesh, s.rules, s.base_shardings, {})
    state = jax.device_put(
        TrainState(step=np.zeros((), np.int32), params=adapters0, opt_state=s.tx.init(adapters0)),
        s.state_shardings,
    )
    out = {"params0": jax.device_get(state.params), "metrics": [], "params": []}
    with jax.set_mesh(s.mesh), axis_rules(s.rules):
        batch0 = jax.device_put(batches[0], s.batch_sharding)
        step = jit_step(s).lower(state, batch0, base).compile(COMPARISON_COMPILE)
        for b in batches:
            state, m = step(state, jax.device_put(b, s.batch_sharding), base)
            out["metrics"].append(jax.device_get(m))
            out["params"].append(jax.device_get(state.params))
    out["base"] = base
    return out


@pytest.fixture(scope="module")
def one_device(base_dir, tmp_path_factory):
    """(format, embeddings quantised) -> the one-device run (and its initial adapters), computed
    once."""
    cache = {}

    def get(fmt: str, embeddings: bool):
        if (fmt, embeddings) not in cache:
            over = {"lora.base_dtype": fmt, "lora.quantize_embeddings": embeddings}
            tr = make_trainer(
                "",
                tmp_path_factory.mktemp("one"),
                True,
                **QLORA,
                **over,
                **{"checkpoint.init_from": base_dir},
            )
            adapters0 = jax.device_get(create_state(tr.setup).params)
            batches = synthetic_batches(264, n=1) * (WARMUP + COMPARED)
            cache[fmt, embeddings] = adapters0, batches, _run(tr, batches, adapters0)
        return cache[fmt, embeddings]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_qlora_mesh_matches_one_device(case, base_dir, one_device, tmp_path):
    mesh, over = CASES[case]
    embeddings = build({**QLORA, **over}).lora.quantize_embeddings
    adapters0, batches, want = one_device(over["lora.base_dtype"], embeddings)
    tr = make_trainer(mesh, tmp_path, **QLORA, **over, **{"checkpoint.init_from": base_dir})
    got = _run(tr, batches, adapters0)
    assert_runs_match(got, want, f"QLoRA {case} on {mesh}")
    losses = [float(m["loss"]) for m in got["metrics"]]
    assert losses[-1] < losses[0] - 0.05, losses
    # the base really is quantised and split: the codes of wq as its weight's sharding says
    q = got["base"]["blocks"]["attn"]["wq_DNH"]
    assert isinstance(q, quant.QuantizedWeight) and q.fmt == over["lora.base_dtype"]
    full = tr.setup.base_shardings["blocks"]["attn"]["wq_DNH"].codes.spec
    local = q.codes.addressable_shards[0].data.shape
    assert np.prod(local) < np.prod(q.codes.shape), (full, local)
    # the same codes on every mesh: quantisation does not depend on the sharding
    np.testing.assert_array_equal(
        np.asarray(jax.device_get(q.codes)),
        np.asarray(jax.device_get(want["base"]["blocks"]["attn"]["wq_DNH"].codes)),
    )
    embed = got["base"]["embed_VD"]
    assert isinstance(embed, quant.QuantizedWeight) == embeddings
