"""What a mesh can run, checked before anything is built or compiled: the one set of checks a
training run and the mesh search (`plan --search`) both apply, so that a mesh the search offers
is one the run accepts."""

from __future__ import annotations

import math

from jax.sharding import Mesh

from errors import UserError
from mesh.expert_layout import expert_layout
from mesh.rules import HINTS, logical_to_spec
from mesh.shard import axes_size, check_divisible
from models import model, pipeline
from models.config import PipelineConfig
from models.moe_dispatch import exchange_for
from models.pieces import n_groups_and_tail
from models.pipeline import explicit
from train.core.config import TrainConfig


def batch_shards(mesh, rules) -> int:
    """Devices one forward pass's batch is split over: the mesh axes the rules give 'batch'."""
    return axes_size(mesh, logical_to_spec(("batch",), rules)[0])


def validate_batch(
    mesh, rules, model_cfg, train_cfg: TrainConfig, pipeline_cfg: PipelineConfig
) -> None:
    """The batch split over the rules' batch axes and, with pipeline > 1, the schedule
    (models.pipeline.validate on layer groups: models.pieces.n_groups_and_tail)."""
    t, m = train_cfg, model_cfg
    if t.batch_size % t.micro_batches:
        raise UserError(
            f"--batch-size {t.batch_size} is not divisible by --micro-batches {t.micro_batches}"
        )
    spec = logical_to_spec(("batch",), rules)[0]
    n = axes_size(mesh, spec)
    per_micro = t.batch_size // t.micro_batches
    if per_micro % n:
        axes = (spec,) if isinstance(spec, str) else spec
        layout = "x".join(f"{a}={mesh.shape[a]}" for a in axes)
        raise UserError(
            f"--batch-size {t.batch_size} (/ --micro-batches {t.micro_batches} = {per_micro}) is"
            f" not divisible by the batch mesh axes {layout} = {n}; use a multiple of"
            f" {n * t.micro_batches}"
        )
    stages = mesh.shape["pipeline"]
    if stages > 1:  # before compiling: a bad schedule is one line, not a trace error
        pc = pipeline_cfg
        pipeline.validate(
            n_layers=n_groups_and_tail(m)[0],
            batch=per_micro,
            stages=stages,
            microbatches=pc.microbatches_for(stages),
            repeats=pc.repeats,
            schedule=pc.schedule,
            batch_shards=n,
        )
        if pc.schedule in pipeline.EXPLICIT:
            explicit.check_model(m, pc.schedule)
            if isinstance(mesh, Mesh):  # a run's devices, not the search's abstract mesh
                explicit.check_backend(m, pc.schedule)


def seq_shards(mesh, rules, name: str = "seq") -> int:
    """Devices the sequence of a [B, T, ...] activation is split over (context parallelism; with
    name="res_seq", the residual stream's, which sequence parallelism also splits over model)."""
    return axes_size(mesh, logical_to_spec(("batch", name), rules)[1])


def validate_sequence(mesh, rules, train_cfg: TrainConfig) -> None:
    """--seq-len split over the axes that shard the sequence: 2 x context chunks (the zigzag layout
    of models/context.py), and the residual stream's shards (sequence parallelism) too."""
    t = train_cfg.seq_len
    n_ctx, n_res = seq_shards(mesh, rules), seq_shards(mesh, rules, "res_seq")
    need = math.lcm(2 * n_ctx if n_ctx > 1 else 1, n_res)
    if t % need:
        why = [f"context {n_ctx} x 2 zigzag chunks"] if n_ctx > 1 else []
        why += [f"the residual stream's {n_res} sequence shards"] if n_res > n_ctx else []
        raise UserError(
            f"--seq-len {t} is not divisible by {need} ({' and '.join(why)}); use a multiple of"
            f" {need}"
        )


def validate_run(
    mesh, rules, model_cfg, train_cfg: TrainConfig, pipeline_cfg: PipelineConfig
) -> None:
    """Raise a one-line UserError for a config `mesh` cannot run, before anything is built or
    compiled: the one set of checks a training run and the mesh search both apply (parameter dims
    by their mesh axes, then the batch and the pipeline schedule)."""
    check_divisible(
        mesh, model.abstract_params(model_cfg), model.param_axes(model_cfg), rules, HINTS
    )
    validate_batch(mesh, rules, model_cfg, train_cfg, pipeline_cfg)
    validate_sequence(mesh, rules, train_cfg)


def expert_rules(rules, mode: str, sizes, m, t: TrainConfig, act_bytes: int, platform: str) -> dict:
    """`rules` with the MoE experts' layout over the FSDP axes that --parallelism.experts_over_fsdp
    `mode` picks for model `m` and train section `t` on `platform` (mesh/expert_layout.py)."""
    return expert_layout(rules, mode, sizes, **moe_traffic(rules, sizes, m, t, act_bytes, platform))


def moe_traffic(rules, sizes, m, t: TrainConfig, act_bytes: int, platform: str) -> dict:
    """mesh.expert_layout.moved_bytes' keywords for model `m` and train section `t` on
    `platform`: one device's tokens, the exchange's kind, the dtypes' bytes."""
    shards = math.prod(sizes.get(a, 1) for a in (*rules["batch"], *rules["seq"]))
    # the emulated ragged exchange (a CPU test path) sends fixed-size buffers
    exchange = "capacity" if m.dispatch == "capacity" else exchange_for(m, platform)
    exchange = "fixed" if exchange == "emulated" else exchange
    return dict(
        n_experts=m.n_experts,
        k=m.experts_per_token,
        tokens=max(t.batch_size // t.micro_batches * t.seq_len // shards, 1),
        d_model=m.d_model,
        d_ff=m.expert_width,
        act_bytes=act_bytes,
        # the gradients' reduce-scatter runs in float32 on CPU (models/moe_comm.py reduce_dtype)
        grad_bytes=4 if platform == "cpu" else act_bytes,
        exchange=exchange,
        capacity_factor=m.capacity_factor,
        remat=m.remat != "none",
    )
