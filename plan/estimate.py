"""One mesh priced from the formulas: whether the run accepts it (the checks a real run makes
before compiling), and its predicted per-device memory, collective traffic and step time
(`evaluate`, what `plan --devices N` prints and the mesh search ranks). Nothing is compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from errors import UserError
from mesh.rules import head_layout, logical_to_spec, make_rules
from mesh.rules import sequence_parallel as sequence_parallel_rules
from mesh.shard import is_axis_names
from mesh.spec import AXES, mesh_text
from models import model as model_lib
from models.config import PipelineConfig
from models.pieces import stage_layers
from plan import cost
from plan.activation_memory import activation_bytes, attention_on
from plan.hardware import Hardware
from plan.lora_memory import lora_memory, lora_parts
from plan.rollout_memory import merged_copy, rollout_memory
from plan.run_spec import RunSpec, abstract_mesh
from plan.theory import theory
from train.core import lora, optim
from train.core.config import CommConfig, TrainConfig
from train.core.shapes import batch_shards, expert_rules, seq_shards, validate_run


@functools.lru_cache(maxsize=16)
def _model_arrays(cfg) -> tuple[dict, dict]:
    return model_lib.abstract_params(cfg), model_lib.param_axes(cfg)


@functools.lru_cache(maxsize=4)
def _optimizer_ratio(cfg, train_cfg: TrainConfig) -> float:
    """Optimizer-state bytes per parameter byte (AdamW: 2, plus scalars), from the real
    optimizer."""
    params = _model_arrays(cfg)[0]
    opt = jax.eval_shape(optim.make(train_cfg).init, params)

    def nbytes(tree) -> int:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    return nbytes(opt) / nbytes(params)


def _stage_cfg(cfg, p: int):
    """The layers one pipeline stage holds (models.pieces.stage_layers: its 1/p of the repeating
    groups and, whole, the dense first layers and the tail; the multi-token prediction modules,
    the embedding and the head on every stage too). Splitting n_layers itself would put the first
    layers into the split: DeepSeek-V3's 61 layers at pipeline 2 gave 3 + 27 MoE layers a stage,
    not 3 + 29, 652B parameters held, not 698B."""
    if p == 1:
        return cfg
    return dataclasses.replace(cfg, n_layers=stage_layers(cfg, p)[0])


def _sharded_params(stage, mesh, rules, arrays=None, dtype=None) -> dict:
    """The stage's parameters (or `arrays`: (abstract arrays, their logical axes), a LoRA run's
    adapters) as ShapeDtypeStructs sharded by the rules on the abstract mesh (the layer stack
    unsplit: a stage holds its own layers whole), in `dtype` (default: their own)."""
    params_abs, axes = arrays or _model_arrays(stage)
    return jax.tree.map(
        lambda s, names: jax.ShapeDtypeStruct(
            s.shape,
            dtype or s.dtype,
            sharding=NamedSharding(mesh, logical_to_spec(names, {**rules, "layers": ()})),
        ),
        params_abs,
        axes,
        is_leaf=is_axis_names,
    )


def _trained_and_frozen(stage, mesh, rules, dtype: str, lora_cfg) -> tuple[dict, dict | None]:
    """(what trains, the frozen base or None), sharded, as plan.theory.theory takes them: a LoRA
    run's adapters and its base at the compute dtype (what the layers gather); else the
    parameters."""
    params = _sharded_params(stage, mesh, rules)
    if not lora.enabled(lora_cfg):
        return params, None
    adapters = (lora.abstract_adapters(stage, lora_cfg), lora.adapter_axes(stage, lora_cfg))
    return _sharded_params(stage, mesh, rules, adapters), _sharded_params(
        stage, mesh, rules, dtype=dtype
    )


def _shard_bytes(x) -> int:
    """Bytes of one device's shard of a sharded ShapeDtypeStruct."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def _memory(params, ratio: float, t: TrainConfig, on_device: float, on_host: float) -> dict:
    """Per-device memory by part; `total` is device memory, what is offloaded to the host apart.
    With the optimizer state offloaded the update holds about one parameter's state at a time."""
    param_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(params))
    optimizer, host_optimizer = param_bytes * ratio, 0.0
    if t.offload_optimizer:
        largest = max(_shard_bytes(x) for x in jax.tree.leaves(params))
        optimizer, host_optimizer = largest * ratio, optimizer
    memory = {
        "params": param_bytes,
        "grads": param_bytes,
        "optimizer": optimizer,
        "activations": on_device,
    }
    memory["total"] = sum(memory.values())
    memory["host_activations"], memory["host_optimizer"] = on_host, host_optimizer
    return memory


def check(
    cfg, sizes: dict[str, int], train_cfg: TrainConfig, pipeline_cfg: PipelineConfig, rules
) -> str | None:
    """Why this mesh cannot run the model (one line), or None."""
    if sizes["expert"] > 1 and not getattr(cfg, "n_experts", 0):
        return "expert>1 on a dense model only duplicates data parallelism"
    try:
        validate_run(abstract_mesh(sizes), rules, cfg, train_cfg, pipeline_cfg)
    except UserError as e:
        return str(e)
    return None


def with_batch(
    train_cfg: TrainConfig | None, batch_size: int, seq_len: int, micro_batches: int
) -> TrainConfig:
    """The run's train settings (the defaults without `train_cfg`) at this batch shape."""
    return dataclasses.replace(
        train_cfg or TrainConfig(),
        batch_size=batch_size,
        seq_len=seq_len,
        micro_batches=micro_batches,
    )


def _checked_rules(
    cfg,
    sizes,
    rules,
    t: TrainConfig,
    pc: PipelineConfig,
    act_bytes: int,
    layouts: tuple[str, bool, str],
    platform: str,
) -> dict:
    """The run's logical-axis rules on this mesh: `layouts` (--parallelism.vocab_parallel,
    sequence_parallel, experts_over_fsdp) applied to `rules` (the defaults without it): sequence
    parallelism, the experts' layout (expert_rules) and the LM head's (head_layout). A mesh the run
    would refuse is bad input, named with the reason."""
    vocab_parallel, sequence_parallel, experts_over_fsdp = layouts
    rules = rules or make_rules()
    rules = sequence_parallel_rules(rules) if sequence_parallel else rules
    rules = expert_rules(rules, experts_over_fsdp, sizes, cfg, t, act_bytes, platform)
    rules = head_layout(
        rules,
        vocab_parallel,
        sizes,
        vocab=cfg.vocab_size,
        batch_tokens=t.batch_size // t.micro_batches * t.seq_len,
        act_bytes=act_bytes,
        param_bytes=np.dtype(cfg.param_dtype).itemsize,
    )
    why = check(cfg, sizes, t, pc, rules)
    if why:
        raise UserError(f"mesh {mesh_text(sizes)}: {why}")
    return rules


def _collectives(
    cfg, run: RunSpec, params, act_bytes: int, pipe_m: int, shards: int, frozen=None
) -> dict:
    """The step's collective traffic: the ring formulas plan checks against the compiled HLO, and
    the pipeline's stage-to-stage sends. `frozen`: a LoRA run's base (plan.theory.theory)."""
    t, pc = run.train, run.pipeline
    comm = theory(run, params, frozen)
    comm.update(
        cost.pipeline_comm(
            cfg,
            run.sizes,
            t.batch_size,
            t.seq_len,
            t.micro_batches,
            act_bytes,
            pipeline_microbatches=pipe_m,
            repeats=pc.repeats,
            batch_shards=shards,
        )
    )
    return comm


def _activations(
    cfg,
    run: RunSpec,
    hw: Hardware,
    mesh,
    act_bytes: int,
    pipe_m: int,
    shards: int,
    sequence_parallel: bool,
) -> tuple[float, float]:
    """Activation bytes per device: (on the device, offloaded to the host)."""
    t, pc = run.train, run.pipeline
    return activation_bytes(
        cfg,
        run.sizes,
        t.batch_size,
        t.seq_len,
        t.micro_batches,
        act_bytes,
        attention_on(cfg, hw, t.seq_len),
        shards=shards,
        seq_shards=seq_shards(mesh, run.rules),
        sequence_parallel=sequence_parallel,
        pipeline_microbatches=pipe_m,
        schedule=pc.schedule,
        repeats=pc.repeats,
    )


def _predict(cfg, run: RunSpec, hw: Hardware, comm: dict, platform: str, pipe_m: int, dcn) -> dict:
    """The step time from the flops, the collective traffic and the hardware (cost.predict)."""
    t, pc, sizes = run.train, run.pipeline, run.sizes
    p = sizes["pipeline"]
    return cost.predict(
        model_flops=cost.model_flops_per_step(cfg, t.batch_size, t.seq_len),
        device_flops=cost.hardware_flops_per_step(
            cfg, t.batch_size, t.seq_len, pc.schedule if p > 1 else "gpipe"
        )
        / math.prod(sizes.values()),
        comm=cost.ragged_all_to_all(comm, platform),
        sizes=sizes,
        hw=hw,
        dtype=run.compute_dtype,
        pipeline_microbatches=pipe_m,
        repeats=pc.repeats,
        dcn=dcn,
        tokens_per_step=t.batch_size * t.seq_len,
        schedule=pc.schedule,
    )


def _count_host_offload(comm: dict, host: float) -> None:
    """Add the host link's traffic to `comm`: activations go out and come back, the optimizer
    state comes in for the update and goes out again, so twice what lives on the host."""
    if host:
        moved = 2 * host
        comm[cost.HOST_OFFLOAD] = {"operand_bytes": moved, "wire_bytes": moved, "count": 0}


def _pipeline_entry(pc: PipelineConfig, p: int, pipe_m: int) -> dict:
    """The pipeline schedule the prediction assumed ({} without a pipeline axis)."""
    if p == 1:
        return {}
    return {"microbatches": pipe_m, "repeats": pc.repeats, "schedule": pc.schedule}


def _run_memory(cfg, stage, t, params, where, lora_cfg, post_cfg, acts) -> dict:
    """Per-device memory by part: a LoRA run's (the adapters train; the frozen base and its merge
    apart) or a full fine-tune's, with --objective grpo's rollout. `where`: (mesh, rules, compute
    dtype); `acts`: the activation bytes (on the device, offloaded to the host)."""
    mesh, rules, dtype = where
    if lora.enabled(lora_cfg):
        parts = lora_parts(stage, lora_cfg, mesh, rules, dtype)
        memory = lora_memory(parts, _optimizer_ratio(cfg, t), *acts)
    else:
        memory = _memory(params, _optimizer_ratio(cfg, t), t, *acts)
    _with_rollout(memory, cfg, t, post_cfg, where, lora_cfg)
    return memory


def _with_rollout(memory: dict, cfg, t: TrainConfig, post, where, lora_cfg) -> None:
    """--objective grpo: memory['rollout'], the sampler's bytes (plan/rollout_memory.py, the
    whole model's cache: the sampler runs every layer), and the total the larger of the update's
    and the rollout's: the step's gradients, activations and formed weights are not live during the
    rollout, the rest is, and a LoRA run's merged weights (merged_copy) besides. Nothing without
    --objective grpo. `where`: (mesh, rules, compute dtype)."""
    if post is None or not post.grpo:
        return
    mesh, rules, dtype = where
    rollout = rollout_memory(
        cfg, t.batch_size * post.group_size, t.seq_len, post.max_new_tokens, mesh, rules, dtype
    )["total"]
    step_only = memory["grads"] + memory["activations"] + memory.get("merge", 0.0)
    memory["rollout"] = rollout
    merged = merged_copy(lora_cfg, memory.get("base", 0.0))
    memory["total"] = max(memory["total"], memory["total"] - step_only + merged + rollout)


def evaluate(
    cfg,
    sizes: dict[str, int],
    hw: Hardware,
    batch_size: int,
    seq_len: int,
    micro_batches: int = 1,
    *,
    rules=None,
    train_cfg: TrainConfig | None = None,
    dcn: dict[str, int] | None = None,
    platform: str | None = None,
    comm_cfg=None,
    pipeline_cfg: PipelineConfig | None = None,
    vocab_parallel: str = "auto",
    sequence_parallel: bool = False,
    lora_cfg=None,
    post_cfg=None,
    experts_over_fsdp: str = "auto",
) -> dict:
    """Predicted memory, communication and step time of one mesh (sizes over all of AXES).
    micro_batches: gradient accumulation (--micro-batches); pipeline_cfg: the schedule a pipeline
    mesh runs (--pipeline.*: its micro-batch count, repeats and schedule set the bubble).
    comm_cfg: the run's --comm settings (DiLoCo's sync_every amortises the data-parallel sync).
    vocab_parallel, experts_over_fsdp: --parallelism.*, the head's and the experts' layouts
    (head_layout, expert_rules). lora_cfg: a LoRA/QLoRA run's section. post_cfg: --post."""
    sizes = {a: sizes.get(a, 1) for a in AXES}
    pc = pipeline_cfg or PipelineConfig()
    platform = platform or hw.platform
    dtype = cfg.compute_dtype(platform)
    act_bytes = np.dtype(dtype).itemsize
    t = with_batch(train_cfg, batch_size, seq_len, micro_batches)
    layouts = (vocab_parallel, sequence_parallel, experts_over_fsdp)
    rules = _checked_rules(cfg, sizes, rules, t, pc, act_bytes, layouts, platform)
    p = sizes["pipeline"]
    stage = _stage_cfg(cfg, p)
    mesh = abstract_mesh(sizes)
    shards, pipe_m = batch_shards(mesh, rules), pc.microbatches_for(p)
    run = RunSpec(stage, t, comm_cfg or CommConfig(), pc, sizes, rules, dtype, lora=lora_cfg)
    params, frozen = _trained_and_frozen(stage, mesh, rules, dtype, lora_cfg)
    comm = _collectives(cfg, run, params, act_bytes, pipe_m, shards, frozen)
    on_device, on_host = _activations(
        cfg, run, hw, mesh, act_bytes, pipe_m, shards, sequence_parallel
    )
    memory = _run_memory(
        cfg, stage, t, params, (mesh, rules, dtype), lora_cfg, post_cfg, (on_device, on_host)
    )
    _count_host_offload(comm, on_host + memory["host_optimizer"])
    pred = _predict(cfg, run, hw, comm, platform, pipe_m, dcn)
    return {
        "mesh": mesh_text(sizes),
        "sizes": sizes,
        "micro_batches": micro_batches,
        "pipeline": _pipeline_entry(pc, p, pipe_m),
        "sequence_parallel": sequence_parallel,
        "memory": memory,
        "fits": memory["total"] <= hw.hbm_bytes * hw.usable_memory,
        "theory": comm,
        **pred,
    }
