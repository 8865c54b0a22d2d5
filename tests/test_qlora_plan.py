"""`plan` prices a LoRA/QLoRA fine-tune (plan/lora_memory.py): the 70B preset with an NF4 base at
sequence 4096 fits on 8 H100s of 80 GB with FSDP, its base a quarter of the bfloat16 base's bytes
and the dequantisation temporary one layer's; a bfloat16-base LoRA of it fits there too, its base
3.6x as large; `plan --search N --smallest` finds the fewest devices that fit;
the compiled plan of a QLoRA run counts the quantised base. Formulas only but the last (tiny,
compiled on 8 fake CPU devices)."""

from __future__ import annotations

import json
import math

import jax
import pytest

from mesh.build import make_mesh
from models import model
from plan import cli
from plan.estimate import evaluate
from plan.hardware import get as hardware
from plan.report import analyze
from train.core import lora, qlora
from train.core.config import build
from train.core.setup import setup

RUN = {"model.preset": "70b", "lora.rank": 16, "lora.allow_random_base": True}


def _row(base_dtype: str, mesh: dict, embeddings: bool = False) -> dict:
    over = {**RUN, "lora.base_dtype": base_dtype, "lora.quantize_embeddings": embeddings}
    cfg = build(over)
    return evaluate(
        cfg.model, mesh, hardware("h100"), 8, 4096, train_cfg=cfg.train, lora_cfg=cfg.lora
    )


def test_70b_qlora_nf4_fits_on_8_h100():
    nf4, bf16 = _row("nf4", {"fsdp": 8}), _row("bfloat16", {"fsdp": 8})
    m = nf4["memory"]
    assert nf4["fits"] and m["total"] < 80e9 * 0.9
    # the projections at 4 bits plus double-quantised scales, the embedding and head at bfloat16
    cfg = build({**RUN, "lora.base_dtype": "nf4", "lora.quantize_embeddings": False})
    full = model.abstract_params(cfg.model)
    proj = 0
    for w in qlora.weights(cfg.model, lora.TARGET_WEIGHTS):
        node = full
        for key in w.path:
            node = node[key]
        proj += node.size
    total = sum(x.size for x in jax.tree.leaves(full))
    want = (proj * (4 + 8 / 64) / 8 + (total - proj) * 2) / 8
    assert m["base"] == pytest.approx(want, rel=0.01)
    assert m["base"] < 0.32 * bf16["memory"]["base"]
    # the dequantisation temporary: a layer's projections gathered over fsdp, forward and backward
    per_layer = proj / cfg.model.n_layers
    assert m["merge"] == pytest.approx(2 * per_layer * 2, rel=0.01)
    # the adapters are what trains: their optimizer state is AdamW's two moments
    assert m["optimizer"] == pytest.approx(2 * m["params"], rel=0.01)
    # each layer multiplies by its weights and adapters factored (models/adapters.py), whatever
    # the base: a bfloat16 base's temporary is the same two layers, not a merged stack and its
    # gradient (64 GiB per device), and its LoRA fits 8 H100s too
    assert bf16["memory"]["merge"] == pytest.approx(m["merge"], rel=0.01)
    assert bf16["fits"] and bf16["memory"]["total"] > m["total"] + 11e9
    # the default quantises the embedding and head too: 2 x 128,256 x 8,192 values at 4.13 bits
    # instead of 16, and the head dequantised once, each device its vocabulary shard (the
    # vocab-parallel head at this batch) at bfloat16
    q = _row("nf4", {"fsdp": 8}, embeddings=True)["memory"]
    emb = cfg.model.vocab_size * cfg.model.d_model
    assert m["base"] - q["base"] == pytest.approx(2 * emb * (2 - (4 + 8 / 64) / 8) / 8, rel=0.01)
    assert q["merge"] - m["merge"] == pytest.approx(emb / 8 * 2, rel=0.01)


def test_search_smallest_finds_the_fewest_devices(capsys):
    argv = ["--model", "70b", "--lora.rank", "16", "--lora.allow_random_base", "true"]
    argv += ["--batch-size", "8", "--seq-len", "4096", "--hardware", "h100"]
    out = {}
    for base_dtype in ("nf4", "bfloat16"):
        flags = [*argv, "--lora.base_dtype", base_dtype, "--search", "64", "--smallest", "--json"]
        assert cli.main(flags) == 0
        out[base_dtype] = json.loads(capsys.readouterr().out)
    nf4, bf16 = out["nf4"], out["bfloat16"]
    assert nf4["smallest"] is not None and bf16["smallest"] is not None
    assert nf4["smallest"] < bf16["smallest"] <= 64
    assert math.log2(nf4["smallest"]).is_integer() and nf4["top"][0]["fits"]


@pytest.mark.slow
def test_compiled_plan_counts_the_quantised_base(tmp_path):
    over = {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "parallelism.mesh": "fsdp=4,model=2",
        "train.batch_size": 8,
        "train.seq_len": 32,
        "logging.run_dir": str(tmp_path),
        "lora.rank": 4,
        "lora.allow_random_base": True,
        "lora.block_size": 32,
    }
    mesh = make_mesh("fsdp=4,model=2")
    full = analyze(setup(build(over), mesh))["memory"]
    nf4 = analyze(setup(build({**over, "lora.base_dtype": "nf4"}), mesh))["memory"]
    assert 0 < nf4["base_bytes"] < 0.5 * full["base_bytes"]
    assert nf4["argument_bytes"] < full["argument_bytes"]
    assert nf4["params_bytes"] == full["params_bytes"]  # the same adapters
