"""`plan --search N`: every mesh of N devices that the model allows, its predicted per-device
memory and communication, ranked by predicted step time. Analytic: nothing is compiled, so
N = 4096 takes seconds on a laptop.

The collective bytes come from `train.plan.theory` (the same ring formulas `plan` checks against
the compiled HLO), evaluated on an AbstractMesh of the candidate's shape; what a mesh accepts comes
from `validate_run`, the checks a real run makes before compiling (the rules table's divisibility,
the batch split, the pipeline schedule).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from mesh.spec import AXES, mesh_text
from errors import UserError
from mesh.rules import logical_to_spec, make_rules
from models import model as model_lib
from models.config import PipelineConfig
from train import cost
from train.config import TrainConfig
from train.hardware import Hardware
from train.shapes import batch_shards, validate_batch, validate_run

def factorizations(n: int, n_axes: int = len(AXES)) -> list[tuple[int, ...]]:
    """All ordered tuples of n_axes positive ints whose product is n."""
    if n_axes == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, n_axes - 1)]


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


@functools.lru_cache(maxsize=16)
def _model_arrays(cfg) -> tuple[dict, dict]:
    return model_lib.abstract_params(cfg), model_lib.param_axes(cfg)


@functools.lru_cache(maxsize=4)
def _optimizer_ratio(cfg, train_cfg: TrainConfig) -> float:
    """Optimizer-state bytes per parameter byte (AdamW: 2, plus scalars), from the real optimizer."""
    from train import optim
    params = _model_arrays(cfg)[0]
    opt = jax.eval_shape(optim.make(train_cfg).init, params)
    nbytes = lambda t: sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(t))
    return nbytes(opt) / nbytes(params)


def _stage_cfg(cfg, p: int):
    """The layers one pipeline stage holds (embedding and head counted on every stage: conservative)."""
    return cfg if p == 1 else dataclasses.replace(cfg, n_layers=cfg.n_layers // p)


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.get(a, 1) for a in AXES), AXES)


def check(cfg, sizes: dict[str, int], train_cfg: TrainConfig, pipeline_cfg: PipelineConfig, rules) -> str | None:
    """Why this mesh cannot run the model (one line), or None."""
    if sizes["expert"] > 1 and not getattr(cfg, "n_experts", 0):
        return "expert>1 on a dense model only duplicates data parallelism"
    try:
        validate_run(abstract_mesh(sizes), rules, cfg, train_cfg, pipeline_cfg)
    except UserError as e:
        return str(e)
    return None


def pipeline_choices(cfg, sizes: dict[str, int], train_cfg: TrainConfig, pipeline_cfg: PipelineConfig,
                     rules) -> list[PipelineConfig]:
    """The pipeline settings to price on this mesh: the run's own; with pipeline > 1 and
    --pipeline.microbatches unset (0), every micro-batch count the run would accept (validate_batch
    decides; only divisors of the rows per batch shard can split them evenly), so that the search
    can report the count that makes its best time."""
    p = sizes["pipeline"]
    if p == 1 or pipeline_cfg.microbatches:
        return [pipeline_cfg]
    mesh, t = abstract_mesh(sizes), train_cfg
    rows = t.batch_size // t.micro_batches // batch_shards(mesh, rules)
    out = []
    for m in range(p, rows + 1):
        if rows % m:
            continue
        pc = dataclasses.replace(pipeline_cfg, microbatches=m)
        try:
            validate_batch(mesh, rules, cfg, t, pc)
        except UserError:
            continue
        out.append(pc)
    return out


def _quick_reject(cfg, sizes: dict[str, int], batch_size: int, rules) -> bool:
    """Cheap integer tests that prune most of the factorisations before check(): necessary
    conditions under the default rules (heads, d_ff and vocab by model, d_model by fsdp)."""
    mdl = sizes["model"]
    return bool(cfg.n_heads % mdl or cfg.n_kv_heads % mdl or cfg.d_ff % mdl or cfg.vocab_size % mdl
                or cfg.d_model % sizes["fsdp"] or cfg.n_layers % sizes["pipeline"]
                or batch_size % batch_shards(abstract_mesh(sizes), rules))


def activation_bytes(cfg, sizes: dict[str, int], batch_size: int, seq_len: int, micro_batches: int,
                     act_bytes: int, fused_attention: bool, *, shards: int, pipeline_microbatches: int = 1) -> float:
    """Per-device activation memory estimate for the remat policy.

    Per token and layer the forward pass makes: 4 [D] (input, two norm outputs, residual), q/k/v
    before and after rotary, the attention output, two [D] projections, 4 [F] (gate, up, silu,
    product) with the head and F dims split by `model`; plus [N,T] scores and probabilities unless
    attention is fused (flash). `full` remat keeps only each layer's input, `dots` the matmul
    outputs; the backward pass of one layer needs its full set once more; the LM head's float32
    logits, softmax and gradient ([T,V/model] each) come on top. One forward pass holds
    batch / micro_batches rows split over `shards` (the rules' batch axes); gradient accumulation
    keeps one pass. A pipeline cuts the pass into `pipeline_microbatches` and keeps every one's
    saved activations until its backward pass (GPipe), so the saved set is still the whole pass's
    while a layer's backward works on one micro-batch; the LM head runs after the pipeline, on the
    whole pass."""
    tp, p = sizes["model"], sizes["pipeline"]
    d, f, n, k, h, v = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    pass_tokens = batch_size // micro_batches // shards * seq_len
    tokens = pass_tokens // (pipeline_microbatches if p > 1 else 1)
    every = 4 * d + (2 * n * h + 4 * k * h + n * h) / tp + 2 * d + 4 * f / tp
    if not fused_attention:
        every += 2 * n / tp * seq_len
    saved = {"none": every, "dots": d + (n * h + 2 * k * h) / tp + 2 * d + 2 * f / tp, "full": d}[cfg.remat]
    layers = cfg.n_layers // p
    return act_bytes * (saved * layers * pass_tokens + every * tokens) + 3 * 4 * pass_tokens * v / tp


def _train(train_cfg: TrainConfig | None, batch_size: int, seq_len: int, micro_batches: int) -> TrainConfig:
    return dataclasses.replace(train_cfg or TrainConfig(), batch_size=batch_size, seq_len=seq_len,
                               micro_batches=micro_batches)


def evaluate(cfg, sizes: dict[str, int], hw: Hardware, batch_size: int, seq_len: int, micro_batches: int = 1, *,
             rules=None, train_cfg: TrainConfig | None = None, dcn: dict[str, int] | None = None,
             platform: str | None = None, comm_cfg=None, pipeline_cfg: PipelineConfig | None = None) -> dict:
    """Predicted memory, communication and step time of one mesh (sizes over all of AXES).
    micro_batches: gradient accumulation (--micro-batches); pipeline_cfg: the schedule a pipeline
    mesh runs (--pipeline.*: its micro-batch count, repeats and schedule set the bubble).
    comm_cfg: the run's --comm settings (DiLoCo's sync_every amortises the data-parallel sync)."""
    sizes = {a: sizes.get(a, 1) for a in AXES}
    rules = rules or make_rules()
    pc = pipeline_cfg or PipelineConfig()
    platform = platform or hw.platform
    dtype = cfg.compute_dtype(platform)
    act_bytes = np.dtype(dtype).itemsize
    t = _train(train_cfg, batch_size, seq_len, micro_batches)
    why = check(cfg, sizes, t, pc, rules)
    if why:
        raise UserError(f"mesh {mesh_text(sizes)}: {why}")
    p = sizes["pipeline"]
    stage = _stage_cfg(cfg, p)
    mesh = abstract_mesh(sizes)
    shards, pipe_m = batch_shards(mesh, rules), pc.microbatches_for(p)
    params_abs, axes = _model_arrays(stage)
    params = jax.tree.map(lambda s, names: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(
        mesh, logical_to_spec(names, {**rules, "layers": ()}))), params_abs, axes, is_leaf=_is_names)
    param_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))

    from train.plan import (
        theory,  # the ring formulas plan checks against the compiled HLO
    )
    run = types.SimpleNamespace(train=t, comm=comm_cfg, pipeline=pc)
    view = types.SimpleNamespace(mesh=mesh, rules=rules, cfg=run, model_cfg=stage, compute_dtype=dtype,
                                 platform=platform)
    comm = theory(view, types.SimpleNamespace(params=params))
    comm.update(cost.pipeline_comm(cfg, sizes, batch_size, seq_len, micro_batches, act_bytes,
                                   pipeline_microbatches=pipe_m, repeats=pc.repeats, batch_shards=shards))

    memory = {"params": param_bytes, "grads": param_bytes, "optimizer": param_bytes * _optimizer_ratio(cfg, t),
              "activations": activation_bytes(cfg, sizes, batch_size, seq_len, micro_batches, act_bytes,
                                              hw.fused_attention, shards=shards, pipeline_microbatches=pipe_m)}
    memory["total"] = sum(memory.values())
    n = math.prod(sizes.values())
    pred = cost.predict(model_flops=cost.model_flops_per_step(cfg, batch_size, seq_len),
                        device_flops=cost.hardware_flops_per_step(cfg, batch_size, seq_len) / n,
                        comm=cost.ragged_all_to_all(comm, platform), sizes=sizes, hw=hw, dtype=dtype,
                        pipeline_microbatches=pipe_m, repeats=pc.repeats, dcn=dcn,
                        tokens_per_step=batch_size * seq_len)
    pipeline = {"microbatches": pipe_m, "repeats": pc.repeats, "schedule": pc.schedule} if p > 1 else {}
    return {"mesh": mesh_text(sizes), "sizes": sizes, "micro_batches": micro_batches, "pipeline": pipeline,
            "memory": memory, "fits": memory["total"] <= hw.hbm_bytes * hw.usable_memory, "theory": comm, **pred}


def search(cfg, n_devices: int, hw: Hardware, batch_size: int, seq_len: int, micro_batches: int = 1, *,
           rules=None, train_cfg: TrainConfig | None = None, comm_cfg=None,
           pipeline_cfg: PipelineConfig | None = None) -> list[dict]:
    """Every valid mesh of n_devices, best first: those that fit in memory by predicted step time,
    then those that do not, by memory. Validity is the run's own (validate_run). Pipeline meshes
    price the run's --pipeline settings; with --pipeline.microbatches unset, every micro-batch count
    the run would accept, keeping the fastest (the row says which)."""
    rules = rules or make_rules()
    pc = pipeline_cfg or PipelineConfig()
    t = _train(train_cfg, batch_size, seq_len, micro_batches)
    default_rules = rules == make_rules()
    rows = []
    for shape in factorizations(n_devices):
        sizes = dict(zip(AXES, shape))
        if default_rules and _quick_reject(cfg, sizes, batch_size, rules):
            continue
        best = None
        for choice in pipeline_choices(cfg, sizes, t, pc, rules):
            if check(cfg, sizes, t, choice, rules):
                continue
            row = evaluate(cfg, sizes, hw, batch_size, seq_len, micro_batches, rules=rules, train_cfg=t,
                           comm_cfg=comm_cfg, pipeline_cfg=choice)
            if best is None or (row["fits"], -row["t_step_s"]) > (best["fits"], -best["t_step_s"]):
                best = row
        if best is not None:
            rows.append(best)
    # ties (compute-bound meshes whose traffic all hides) go to less traffic, then less memory
    return sorted(rows, key=lambda r: (not r["fits"], r["t_step_s"] if r["fits"] else r["memory"]["total"],
                                       r["t_comm_s"], r["memory"]["total"]))


def run_flags(row: dict) -> str:
    """The flags that run `row`'s layout as priced: the gradient accumulation and, on a pipeline
    mesh, the pipeline schedule (its micro-batch count, repeats and schedule set the bubble)."""
    out = f"--mesh {row['mesh']} --micro-batches {row['micro_batches']}"
    pp = row["pipeline"]
    if pp:
        out += (f" --pipeline.microbatches {pp['microbatches']} --pipeline.repeats {pp['repeats']}"
                f" --pipeline.schedule {pp['schedule']}")
    return out


def render(rows: list[dict], top: int, hw: Hardware, n_devices: int) -> str:
    fit = [r for r in rows if r["fits"]]
    usable = hw.usable_memory * hw.hbm_bytes / 2**30
    width = max([36] + [len(r["mesh"]) + 2 for r in fit[:top]])
    lines = [f"search: {len(rows)} valid meshes of {n_devices} x {hw.name}, {len(fit)} fit in {usable:.0f} GiB"
             f" per device; best {min(top, len(fit))} by predicted step time:",
             f"{'mesh':<{width}}{'pp-mb':>6}{'mem GiB':>9}{'step s':>9}{'MFU':>7}{'bubble':>7}"
             f"  comm per step (GiB sent per device, link, s)"]
    for r in fit[:top]:
        comm = "; ".join(f"{k} {v['wire_bytes'] / 2**30:.2f} {v['link']} {v['time_s']:.3f}"
                         for k, v in sorted(r["comm"].items()))
        pp_mb = r["pipeline"].get("microbatches", "-")  # --pipeline.microbatches this row is priced at
        lines.append(f"{r['mesh']:<{width}}{pp_mb:>6}{r['memory']['total'] / 2**30:>9.1f}"
                     f"{r['t_step_s']:>9.3f}{100 * r['mfu']:>6.1f}%{100 * r['bubble']:>6.1f}%  {comm or '-'}")
    if not fit and rows:
        r = rows[0]
        lines.append(f"nothing fits: the smallest is {r['mesh']} at {r['memory']['total'] / 2**30:.1f} GiB per device;"
                     f" use more devices, full remat or a smaller batch")
    return "\n".join(lines)


# -- `python -m train plan` flags -----------------------------------------------------------------
def add_args(parser) -> None:
    g = parser.add_argument_group("cost model (--hardware) and mesh search (--search)")
    g.add_argument("--hardware", metavar="NAME", default="",
                   help="predict step time, MFU and goodput on: h100, h200, a100, tpu-v5p, cpu")
    g.add_argument("--devices", type=int, default=0, metavar="N",
                   help="with --hardware: predict --mesh on N devices from formulas, without compiling")
    g.add_argument("--search", type=int, default=0, metavar="N",
                   help="rank every valid mesh of N devices by predicted step time (with --hardware)")
    g.add_argument("--top", type=int, default=10, metavar="K", help="--search: meshes shown")
    g.add_argument("--cluster-size", type=int, default=0, metavar="N",
                   help="devices whose failure stops the job, for goodput (0 = the mesh's devices)")
    g.add_argument("--fail-rate", type=float, default=0.001, metavar="X",
                   help="failures per device per day (default 0.1%%: 10 a day on 10,000 GPUs)")
    g.add_argument("--restart-s", type=float, default=300.0, metavar="S",
                   help="seconds to reschedule, restart and recompile after a failure (restore time is added)")
    g.add_argument("--ckpt-write-gbps", type=float, default=0.0, metavar="X",
                   help="GB/s per device to checkpoint storage (0 = the profile's)")


def _hardware(ns, n_devices: int, cfg) -> Hardware:
    from train import hardware
    if not ns.hardware:
        raise UserError(f"--search/--devices need --hardware NAME; valid: {', '.join(hardware.PROFILES)}")
    for flag in ("search", "devices", "top", "cluster_size"):
        if getattr(ns, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(ns, flag)}")
    return hardware.get(ns.hardware, n_devices, cfg.model.compute_dtype("cpu"))  # dtype: for the CPU profile


def _goodput(ns, cfg, pred: dict, state_bytes: float, hw: Hardware) -> dict:
    c = cfg.checkpoint
    return cost.goodput(pred["t_step_s"], state_bytes, ns.cluster_size or pred["devices"], hw,
                        ckpt_every=c.every, async_save=c.async_save, fail_rate=ns.fail_rate,
                        restart_s=ns.restart_s, write_bw=ns.ckpt_write_gbps * 1e9 or None, steps=cfg.train.steps)


def analytic(ns, cfg) -> tuple[dict, str]:
    """`plan --search N` / `plan --devices N`: no compile. -> (JSON-able report, text)."""
    from mesh.spec import resolve
    t, p = cfg.train, cfg.parallelism
    n = ns.search or ns.devices
    hw = _hardware(ns, n, cfg)
    rules = make_rules(p.rules)
    if ns.search:
        rows = search(cfg.model, n, hw, t.batch_size, t.seq_len, t.micro_batches, rules=rules, train_cfg=t,
                      comm_cfg=cfg.comm, pipeline_cfg=cfg.pipeline)
        fit = [r for r in rows if r["fits"]]
        text = render(rows, ns.top, hw, n)
        report = {"devices": n, "hardware": hw.name, "valid": len(rows), "fit": len(fit), "top": fit[:ns.top]}
        if fit:
            best = fit[0]
            report["goodput"] = _goodput(ns, cfg, best, best["memory"]["params"] + best["memory"]["optimizer"], hw)
            text += f"\nbest mesh: {run_flags(best)}\n" + cost.render(best, report["goodput"])
        return report, text
    shape = resolve(p.mesh, n, p.mesh_dcn)
    dcn = dict(zip(AXES, shape.dcn))
    row = evaluate(cfg.model, shape.as_dict(), hw, t.batch_size, t.seq_len, t.micro_batches, rules=rules,
                   train_cfg=t, dcn=dcn, comm_cfg=cfg.comm, pipeline_cfg=cfg.pipeline)
    row["goodput"] = _goodput(ns, cfg, row, row["memory"]["params"] + row["memory"]["optimizer"], hw)
    m = row["memory"]
    text = (f"plan (formulas, not compiled): {run_flags(row)} on {n} x {hw.name}\n"
            f"memory per device (estimate): params {m['params'] / 2**30:.2f} GiB, grads {m['grads'] / 2**30:.2f},"
            f" optimizer {m['optimizer'] / 2**30:.2f}, activations {m['activations'] / 2**30:.2f},"
            f" total {m['total'] / 2**30:.2f} GiB -> {'fits' if row['fits'] else 'does NOT fit'} in"
            f" {hw.usable_memory * hw.hbm_bytes / 2**30:.0f} GiB\n" + cost.render(row, row["goodput"]))
    return row, text


def with_cost(report: dict, ns, cfg, mesh) -> str:
    """Add report['cost'] (and report['goodput']) for a compiled plan; -> the text lines."""
    t = cfg.train
    sizes = {a: mesh.shape[a] for a in AXES}
    hw = _hardware(ns, mesh.size, cfg)
    from mesh.spec import resolve
    dcn = dict(zip(AXES, resolve(cfg.parallelism.mesh, mesh.size, cfg.parallelism.mesh_dcn).dcn))
    pred = cost.from_plan(report, hw, cfg.model, t.batch_size, t.seq_len, t.micro_batches, sizes, dcn)
    mem = report["memory"]
    good = _goodput(ns, cfg, pred, mem["params_bytes"] + mem["optimizer_bytes"], hw)
    report["cost"], report["goodput"] = pred, good
    return f"collectives from the {pred['comm_source']}\n" + cost.render(pred, good)
