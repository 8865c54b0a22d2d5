"""What the collective formulas read of a run (`RunSpec`), and the per-device sizes every formula
shares: a shard's bytes, the rows and tokens of one forward pass on one device, the batch axes the
vocabulary is split on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
from jax.sharding import AbstractMesh

from mesh.rules import logical_to_spec
from mesh.shard import axes_size, spec_axes
from mesh.spec import AXES
from models.config import ModelConfig, PipelineConfig
from train.core.config import CommConfig, LoraConfig, TrainConfig
from train.core.shapes import batch_shards, seq_shards

if TYPE_CHECKING:
    from train.core.setup import RunSetup


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What the formulas read of a run. `sizes`: mesh axis -> size (every axis of AXES)."""

    model: ModelConfig
    train: TrainConfig
    comm: CommConfig
    pipeline: PipelineConfig
    sizes: dict[str, int]
    rules: dict
    compute_dtype: str
    context_strategy: str = "all_gather"  # --parallelism.context_strategy
    packed: bool = False  # segment ids in the batch (--data.packing_mask)
    lora: LoraConfig | None = None  # a LoRA/QLoRA run's section: the adapters train

    @property
    def mesh(self) -> AbstractMesh:
        """The mesh's shape without devices: what the sharding helpers read."""
        return abstract_mesh(self.sizes)

    @property
    def itemsize(self) -> int:
        """Bytes of one activation element."""
        return jax.numpy.dtype(self.compute_dtype).itemsize


def run_spec(s: RunSetup) -> RunSpec:
    """The spec of a run set up on a real mesh (train.setup.setup)."""
    c = s.cfg
    return RunSpec(
        model=c.model,
        train=c.train,
        comm=c.comm,
        pipeline=c.pipeline,
        sizes=dict(s.mesh.shape),
        rules=s.rules,
        compute_dtype=s.compute_dtype,
        context_strategy=c.parallelism.context_strategy,
        packed=c.data.packing_mask,
        lora=c.lora,
    )


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh of these axis sizes (missing axes: 1) and no devices."""
    return AbstractMesh(tuple(sizes.get(a, 1) for a in AXES), AXES)


def local_bytes(sds) -> float:
    """Bytes of one device's shard of a ShapeDtypeStruct with a NamedSharding (real or abstract
    mesh)."""
    sh = sds.sharding
    return (
        math.prod(sds.shape)
        * sds.dtype.itemsize
        / math.prod(axes_size(sh.mesh, e) for e in sh.spec)
    )


def rows_per_shard(batch_size: int, micro_batches: int, shards: int) -> int:
    """Rows of one forward pass (the batch over --micro-batches) on one of the `shards` devices the
    rules split the batch over: the leading dim of a device's activations, before a pipeline cuts
    it."""
    return batch_size // micro_batches // shards


def tokens_per_device(run: RunSpec) -> int:
    """Tokens of one micro-batch on one device."""
    t = run.train
    rows = rows_per_shard(t.batch_size, t.micro_batches, batch_shards(run.mesh, run.rules))
    return rows * t.seq_len // seq_shards(run.mesh, run.rules)


def axes_key(axes) -> str:
    return ",".join(a for a in AXES if a in axes)


def vocab_parallel_axes(run: RunSpec) -> list[str]:
    """The batch axes the vocabulary dim is sharded on (mesh.rules.vocab_parallel), size > 1."""
    batch = spec_axes(logical_to_spec(("batch",), run.rules))
    return [
        a
        for a in spec_axes(logical_to_spec(("vocab",), run.rules))
        if a in batch and run.sizes[a] > 1
    ]
