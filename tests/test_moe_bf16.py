"""A bfloat16 MoE step on meshes whose expert shard_map sums gradients over axes (data, fsdp,
model, and micro-batches under vmap): it compiles and runs, and stays with the one-device
bfloat16 run. XLA:CPU aborted the whole process on these meshes ("Invalid binary instruction
opcode copy") when its float normalisation rewrote a bfloat16 all-reduce or reduce-scatter of the
shard_map into float32; on CPU those collectives now run in float32 (models.moe_comm
reduce_dtype)."""

import numpy as np
import pytest
from equivalence import initial_params, run_steps, synthetic_batches, trainer_cache

BF16 = {"model.preset": "moe-tiny", "model.dtype": "bfloat16"}
# each mesh sums some expert gradient over an axis the experts are not split on: the weights'
# over data (replicated there) or fsdp (gathered), the tokens' and gates' over model (experts
# split inside), and with micro-batches the sums shard_map itself adds under vmap
MESHES = [
    ("data=2,fsdp=2", {}),
    ("fsdp=2,expert=2,model=2", {}),
    ("data=2,expert=2,model=2", {"train.micro_batches": 2}),
]


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    return trainer_cache(tmp_path_factory, **BF16)


@pytest.mark.parametrize("mesh,over", MESHES, ids=[m for m, _ in MESHES])
def test_bf16_moe_step_runs_and_matches_one_device(trainers, mesh, over):
    batches = synthetic_batches(264)
    one = trainers("", True, **over)
    params0 = initial_params(one)
    ref = run_steps(one, batches, params0)["metrics"]
    got = run_steps(trainers(mesh, **over), batches, params0)["metrics"]
    for r, g in zip(ref, got, strict=True):
        assert np.isfinite(float(g["loss"]))
        # bfloat16 rounding in other orders: about 1e-3 of the loss apart over 5 steps
        np.testing.assert_allclose(float(g["loss"]), float(r["loss"]), rtol=1e-2)
