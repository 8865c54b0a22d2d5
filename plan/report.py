"""The `plan` report: compile the train step ahead of time, without data or training, read
per-device memory, FLOPs and the collectives the compiler chose out of it, put theory next to
them (plan/theory.py). plan/render.py turns the report into text.

Everything is computed from abstract arrays (ShapeDtypeStructs with shardings), so a 70B plan
on 8 fake CPU devices allocates nothing.
"""

from __future__ import annotations

import dataclasses

import jax

from errors import expect
from mesh.shard import path_names, tree_shardings
from mesh.spec import mesh_text
from models import model
from models import pipeline as pipeline_lib
from models.flops import active_param_count, flops_per_token, param_count
from models.pieces import n_groups_and_tail
from plan.hlo import KINDS, parse_collectives, summarize
from plan.lora_memory import lora_parts
from plan.rollout_memory import merged_copy, rollout_memory
from plan.run_spec import local_bytes, rows_per_shard, run_spec
from plan.theory import on_backend, theory
from train.core import lora
from train.core.setup import (
    RunSetup,
    abstract_batch,
    abstract_state,
    compile_step,
    frozen_args,
    setup,
)
from train.core.shapes import batch_shards


def sharding_table(abstract_params) -> list[dict]:
    """One row per parameter: its shape, spec, and shape and bytes on one device."""
    rows = []
    for name, sds in path_names(abstract_params, is_leaf=lambda x: hasattr(x, "shape")):
        spec = sds.sharding.spec
        local = sds.sharding.shard_shape(sds.shape)
        rows.append(
            {
                "name": name,
                "shape": list(sds.shape),
                "spec": str(spec),
                "local_shape": list(local),
                "local_bytes": int(local_bytes(sds)),
            }
        )
    return rows


def backend_notes(platform: str, th: dict, measured: dict) -> list[str]:
    """Where this backend's lowering departs from what GPU/TPU would run."""
    notes = []
    rs = sum(
        v["operand_bytes"] - v.get("explicit_bytes", 0.0)
        for k, v in th.items()
        if k.startswith("reduce-scatter")
    )
    if rs and platform == "cpu":
        notes.append(
            f"the {platform} backend chose all-reduce + dynamic-slice instead of reduce-scatter"
            f" ({rs / 2**20:.1f} MiB ideal); GPU/TPU emit reduce-scatter, halving that traffic"
        )
    return notes


def memory_traffic(s: RunSetup, report: dict) -> dict:
    """Bytes each device reads and writes per step, from XLA's cost analysis ("bytes accessed":
    operands and results of every top-level op after fusion), for the roofline's memory term.

    The cost analysis counts a while loop's body once, so a lax.scan over layers shows one layer;
    with scan_layers the step is compiled once more, unrolled, on the same mesh, for its count
    (other loops, such as the MoE block scan, stay counted once)."""
    cost = {
        "bytes accessed": report["bytes_accessed_per_device_compiled"],
        "flops": report["flops_per_step_per_device_compiled"],
    }
    source = "the compiled step"
    m = s.cfg.model
    if m.scan_layers and m.n_layers > 1:
        unrolled = dataclasses.replace(s.cfg, model=dataclasses.replace(m, scan_layers=False))
        cost = _cost_analysis(compile_step(setup(unrolled, s.mesh)))
        source = "the step compiled once more with the layer scan unrolled"
    return {
        "bytes_accessed": float((cost or {}).get("bytes accessed", 0.0)),
        "flops": float((cost or {}).get("flops", 0.0)),
        "source": source,
    }


def _cost_analysis(compiled) -> dict | None:
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, (list, tuple)) else cost


def _memory(s: RunSetup, state, mem) -> dict:
    """Per-device memory by part: the state's own shards, and the compiler's memory analysis."""
    params_b = sum(local_bytes(x) for x in jax.tree.leaves(state.params))
    opt_b = sum(local_bytes(x) for x in jax.tree.leaves(state.opt_state))
    # LoRA: `params` (and so gradients and optimizer state) are the adapters; the frozen base is the
    # step's third argument and takes memory of its own, which `params_bytes` would otherwise hide
    base_b = (
        0
        if s.base_shardings is None
        else sum(
            local_bytes(x) for x in jax.tree.leaves(lora.abstract_base(s.cfg, s.base_shardings))
        )
    )
    # the weights the step forms from base and adapters (plan/lora_memory.py; part of temp)
    merge_b = (
        0
        if s.base_shardings is None
        else lora_parts(s.cfg.model, s.cfg.lora, s.mesh, s.rules, s.compute_dtype, False)["merge"]
    )
    # --objective dpo|ipo without LoRA: the frozen reference copy, the step's third argument
    ref_b = (
        0
        if s.ref_shardings is None
        else sum(local_bytes(x) for x in jax.tree.leaves(frozen_args(s)[0]))
    )
    out = {
        "params_bytes": params_b,
        "optimizer_bytes": opt_b,
        "gradient_bytes": params_b,
        "base_bytes": base_b,
        "merge_bytes": merge_b,
        "reference_bytes": ref_b,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "peak_bytes": getattr(mem, "peak_memory_in_bytes", 0),
    }
    return out | (_rollout(s, out) if s.cfg.post.grpo else {})


def _rollout(s: RunSetup, mem: dict) -> dict:
    """--objective grpo: the sampler's memory (plan/rollout_memory.py) and the run's peak with it:
    the larger of the update's (the compiled step's peak, or its argument + temp where the backend
    reports less) and the rollout's (the state's shards, a frozen reference or base, a LoRA run's
    merged weights, and the sampler's bytes: the update's activations and gradients are not live
    then)."""
    t, post = s.cfg.train, s.cfg.post
    parts = rollout_memory(
        s.cfg.model,
        t.batch_size * post.group_size,
        t.seq_len,
        post.max_new_tokens,
        s.mesh,
        s.rules,
        s.compute_dtype,
    )
    update = max(mem["peak_bytes"], mem["argument_bytes"] + mem["temp_bytes"])
    held = mem["params_bytes"] + mem["optimizer_bytes"] + mem["reference_bytes"] + mem["base_bytes"]
    held += merged_copy(s.cfg.lora, mem["base_bytes"])
    return {
        "rollout_bytes": parts["total"],
        "rollout_parts": parts,
        "update_live_bytes": update,
        "rollout_live_bytes": held + parts["total"],
        "peak_with_rollout_bytes": max(update, held + parts["total"]),
    }


def _collectives(measured: dict) -> dict:
    """The measured collectives: kind -> operand bytes per device per step (all mesh axes
    together), then the details."""
    return {
        "collectives": {k: measured[k]["operand_bytes"] for k in KINDS},
        "collectives_detail": {
            k: {kk: measured[k][kk] for kk in ("count", "operand_bytes", "wire_bytes", "async")}
            | {"by_axes": measured[k]["by_axes"]}
            for k in KINDS
        },
    }


def _theory_base(s: RunSetup) -> dict:
    """A LoRA run's base as the theory prices it: the weights it stands for at the compute dtype,
    sharded as a full fine-tune's: each layer casts (or dequantises) its shard before the
    all-gather, so that is what moves (a bfloat16 base under float32 compute moves float32; seen in
    the HLO)."""
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, s.compute_dtype, sharding=sh),
        model.abstract_params(s.cfg.model),
        tree_shardings(s.mesh, model.param_axes(s.cfg.model), s.rules),
    )


def analyze(s: RunSetup) -> dict:
    """Compile the step of the run `s` (train.core.setup.setup) and return the full report as a
    dict."""
    expect(
        "analyze",
        "s",
        s,
        RunSetup,
        "a RunSetup: train.core.setup.setup(cfg, mesh) or trainer.setup",
    )
    cfg, t, m = s.cfg, s.cfg.train, s.cfg.model
    state = abstract_state(s)
    compiled = compile_step(s, state, abstract_batch(s))
    cost = _cost_analysis(compiled)
    measured = summarize(parse_collectives(compiled.as_text(), s.mesh))
    # LoRA: the frozen base's weights are gathered, the adapters' gradients alone reduced
    th = theory(run_spec(s), state.params, None if s.base_shardings is None else _theory_base(s))
    th_backend = on_backend(th, jax.default_backend(), dict(s.mesh.shape))
    return {
        "mesh": mesh_text(s.mesh.shape),
        "devices": s.mesh.size,
        "backend": jax.default_backend(),
        "params": param_count(m),
        "active_params": active_param_count(m),
        "memory": _memory(s, state, compiled.memory_analysis()),
        "flops_per_step": flops_per_token(m, t.seq_len) * t.batch_size * t.seq_len,
        "flops_per_step_per_device_compiled": float(cost.get("flops", 0.0)) if cost else 0.0,
        "bytes_accessed_per_device_compiled": float(cost.get("bytes accessed", 0.0))
        if cost
        else 0.0,
        "sync_every": cfg.comm.sync_every,
        **_collectives(measured),
        "theory": _by_kind(th),
        "theory_on_backend": _by_kind(th_backend),
        "theory_detail": th,
        "theory_on_backend_detail": th_backend,
        "notes": backend_notes(jax.default_backend(), th, measured),
        "sharding": sharding_table(state.params),
    } | ({"pipeline": pipeline_report(s, measured)} if s.mesh.shape["pipeline"] > 1 else {})


def pipeline_report(s: RunSetup, measured: dict) -> dict:
    """The schedule, its bubble and the stage-to-stage traffic: collective-permutes over 'pipeline'
    in the compiled HLO next to models.pipeline.permute_bytes_theory's count (one micro-batch per
    tick and direction)."""
    m, t, pc, P = s.cfg.model, s.cfg.train, s.cfg.pipeline, s.mesh.shape["pipeline"]
    M_, R = pc.microbatches_for(P), pc.repeats
    n_groups = n_groups_and_tail(m)[0]
    shards = batch_shards(s.mesh, s.rules)
    th = pipeline_lib.permute_bytes_theory(
        batch=rows_per_shard(t.batch_size, t.micro_batches, shards),
        seq=t.seq_len,
        d_model=m.d_model,
        itemsize=jax.numpy.dtype(s.compute_dtype).itemsize,
        stages=P,
        microbatches=M_,
        repeats=R,
    )
    hlo = measured["collective-permute"]["by_axes"].get("pipeline", {"operand_bytes": 0})[
        "operand_bytes"
    ]
    return {
        "stages": P,
        "microbatches": M_,
        "repeats": R,
        "schedule": pc.schedule,
        "batch_shards": shards,
        "bubble": pipeline_lib.schedule_bubble(pc.schedule, P, M_, R),
        "permute_bytes_hlo": hlo,
        "permute_bytes_theory": th["sent"] * t.micro_batches,
        "permute_bytes_useful": th["useful"] * t.micro_batches,
        "chart": pipeline_lib.schedule_chart(P, M_, R, pc.schedule, n_layers=n_groups),
    }


def _by_kind(detail: dict) -> dict:
    out = {k: 0.0 for k in KINDS}
    for key, v in detail.items():
        out[key.partition("@")[0]] += v["operand_bytes"]
    return out
