"""A LoRA/QLoRA step's collectives, read from its compiled HLO: each layer multiplies by its frozen
weight and its adapters factored (models/adapters.py), so the gradient reduction over the batch's
mesh axes moves the adapters' bytes, not a full fine-tune's; and `plan`'s theory (plan/theory.py:
the base gathered, the adapters alone reduced) matches the compiled step on two meshes, as the
formulas `plan --devices` and `plan --search` price do. Compile only; nothing is trained."""

import math

import jax
import pytest

from mesh.build import make_mesh
from models import model
from plan.estimate import evaluate
from plan.hardware import get as hardware
from plan.report import analyze
from train.core import lora
from train.core.config import build
from train.core.setup import setup

MESHES = ("fsdp=8", "data=2,fsdp=4")
REDUCTIONS = ("all-reduce", "reduce-scatter")


def cfg(mesh: str, base_dtype: str):
    # the shape of tests/test_plan.py's theory checks (batch 16 x seq 256: XLA:CPU gathers the
    # FSDP embedding table rather than exchanging rows); rank 4 of d_model 64: the adapters are
    # 1/12 of the weights they adapt. The embedding and head at the compute dtype: the theory
    # gathers a quantised head dequantised, where XLA:CPU gathers its codes (6% less on this tiny
    # head, in the theory's favour; a vocab-parallel head is not gathered at all)
    return build(
        {
            "model.preset": "tiny",
            "model.dtype": "float32",
            "parallelism.mesh": mesh,
            "train.batch_size": 16,
            "train.seq_len": 256,
            "lora.rank": 4,
            "lora.base_dtype": base_dtype,
            "lora.block_size": 32,
            "lora.allow_random_base": True,
            "lora.quantize_embeddings": False,
        }
    )


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def get(mesh: str, base_dtype: str) -> dict:
        if (mesh, base_dtype) not in cache:
            cache[mesh, base_dtype] = analyze(setup(cfg(mesh, base_dtype), make_mesh(mesh)))
        return cache[mesh, base_dtype]

    return get


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _sizes(c) -> tuple[int, int]:
    """(the adapters' bytes, the bytes of the weights they adapt), whole, float32."""
    adapters = lora.abstract_adapters(c.model, c.lora)
    base = model.abstract_params(c.model)
    adapted = [base[s][m][w] for s in adapters for m in adapters[s] for w in adapters[s][m]]
    return _bytes(adapters), _bytes(adapted)


@pytest.mark.parametrize("base_dtype", ["float32", "nf4"])
@pytest.mark.parametrize("mesh", MESHES)
def test_step_reduces_adapter_sized_gradients(reports, mesh, base_dtype):
    """The reductions' operand bytes per device are the adapters' (XLA:CPU's FSDP reduce-scatter
    is an all-reduce of the whole operand; on data=2,fsdp=4 the FSDP-sharded adapters' shards are
    all-reduced over `data` too: + 1/4 of those), far below the adapted weights' (with the merged
    weight W + s A B they were above them: its W-sized gradient was reduced)."""
    r = reports(mesh, base_dtype)
    adapters, adapted = _sizes(cfg(mesh, base_dtype))
    assert adapted > 10 * adapters
    got = sum(r["collectives_detail"][k]["operand_bytes"] for k in REDUCTIONS)
    assert 0.5 * adapters < got <= 1.25 * adapters, (got, adapters, adapted)


@pytest.mark.parametrize("base_dtype", ["float32", "nf4"])
@pytest.mark.parametrize("mesh", MESHES)
def test_theory_matches_the_compiled_lora_step(reports, mesh, base_dtype):
    """Every collective of the theory as XLA:CPU lowers it next to the compiled step's, by kind
    and mesh axes: the base's all-gathers (forward and remat) and the adapters' reductions. A
    quantised base is gathered dequantised, at the compute dtype (plus its scales: 2%)."""
    r = reports(mesh, base_dtype)
    th = r["theory_on_backend_detail"]
    measured = {
        f"{kind}@{axes}": v["operand_bytes"]
        for kind, c in r["collectives_detail"].items()
        for axes, v in c["by_axes"].items()
        if v["operand_bytes"] > 0.001 * th["all-gather@fsdp"]["operand_bytes"]
    }
    assert set(measured) >= {k for k, v in th.items() if v["operand_bytes"] > 0}
    for key, want in th.items():
        assert measured.get(key, 0.0) == pytest.approx(want["operand_bytes"], rel=0.03), key
    # where GPU/TPU reduce-scatter, the theory has the adapters only
    adapters, _ = _sizes(cfg(mesh, base_dtype))
    reduced = sum(
        v["operand_bytes"] for k, v in r["theory_detail"].items() if k.startswith(REDUCTIONS)
    )
    assert reduced <= 1.25 * adapters


@pytest.mark.parametrize("mesh", MESHES)
def test_formulas_price_the_lora_step_as_compiled(reports, mesh):
    """`plan --devices` / `--search` (plan/estimate.py, no compile) give the compiled plan's
    theory for a LoRA run."""
    c = cfg(mesh, "float32")
    sizes = dict(make_mesh(mesh).shape)
    row = evaluate(c.model, sizes, hardware("cpu"), 16, 256, train_cfg=c.train, lora_cfg=c.lora)
    compiled = reports(mesh, "float32")["theory_detail"]
    for key, want in compiled.items():
        assert row["theory"][key]["operand_bytes"] == pytest.approx(want["operand_bytes"]), key
