"""The `plan` report: compile the train step ahead of time, without data or training, read
per-device memory, FLOPs and the collectives the compiler chose out of it, put theory next to
them (plan/theory.py); and every text `plan` prints (the report, the search table, the cost model).

Everything is computed from abstract arrays (ShapeDtypeStructs with shardings), so a 70B plan
on 8 fake CPU devices allocates nothing.
"""

from __future__ import annotations

import dataclasses

import jax

from errors import expect
from mesh.shard import path_names
from mesh.spec import mesh_text
from models import pipeline as pipeline_lib
from models.flops import active_param_count, flops_per_token, param_count
from models.pieces import layers_per_group
from plan.hardware import Hardware
from plan.hlo import KINDS, parse_collectives, summarize
from plan.theory import local_bytes, on_backend, rows_per_shard, run_spec, theory
from train.core import lora
from train.core.setup import RunSetup, abstract_batch, abstract_state, compile_step, setup
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


def analyze(s: RunSetup) -> dict:
    """Compile the step of the run `s` (train.core.setup.setup) and return the full report as a dict."""
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
    mem = compiled.memory_analysis()
    cost = _cost_analysis(compiled)
    measured = summarize(parse_collectives(compiled.as_text(), s.mesh))
    # LoRA: the frozen base's weights are the ones that move (its adapters are tiny and replicated)
    th = theory(
        run_spec(s),
        state.params if s.base_shardings is None else lora.abstract_base(s.cfg, s.base_shardings),
    )
    th_backend = on_backend(th, jax.default_backend(), dict(s.mesh.shape))
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
    return {
        "mesh": mesh_text(s.mesh.shape),
        "devices": s.mesh.size,
        "backend": jax.default_backend(),
        "params": param_count(m),
        "active_params": active_param_count(m),
        "memory": {
            "params_bytes": params_b,
            "optimizer_bytes": opt_b,
            "gradient_bytes": params_b,
            "base_bytes": base_b,
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes,
            "peak_bytes": getattr(mem, "peak_memory_in_bytes", 0),
        },
        "flops_per_step": flops_per_token(m, t.seq_len) * t.batch_size * t.seq_len,
        "flops_per_step_per_device_compiled": float(cost.get("flops", 0.0)) if cost else 0.0,
        "bytes_accessed_per_device_compiled": float(cost.get("bytes accessed", 0.0))
        if cost
        else 0.0,
        "sync_every": cfg.comm.sync_every,
        # kind -> operand bytes per device per step (all mesh axes together), then the details
        "collectives": {k: measured[k]["operand_bytes"] for k in KINDS},
        "collectives_detail": {
            k: {kk: measured[k][kk] for kk in ("count", "operand_bytes", "wire_bytes", "async")}
            | {"by_axes": measured[k]["by_axes"]}
            for k in KINDS
        },
        "theory": _by_kind(th),
        "theory_on_backend": _by_kind(th_backend),
        "theory_detail": th,
        "theory_on_backend_detail": th_backend,
        "notes": backend_notes(jax.default_backend(), th, measured),
        "sharding": sharding_table(state.params),
    } | ({"pipeline": pipeline_report(s, measured)} if s.mesh.shape["pipeline"] > 1 else {})


def pipeline_report(s: RunSetup, measured: dict) -> dict:
    """The schedule, its bubble and the stage-to-stage traffic: collective-permutes over 'pipeline'
    in the compiled HLO next to models.pipeline.permute_bytes_theory's count (one micro-batch per tick and direction)."""
    m, t, pc, P = s.cfg.model, s.cfg.train, s.cfg.pipeline, s.mesh.shape["pipeline"]
    M_, R = pc.microbatches_for(P), pc.repeats
    n_groups = m.n_layers // layers_per_group(m)
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


def _mib(b: float) -> str:
    return f"{b / 2**20:10.2f} MiB"


def render(r: dict, show_sharding: bool) -> str:
    """The compiled report (analyze) as text."""
    m = r["memory"]
    active = (
        f" ({r['active_params'] / 1e6:.2f}M active per token)"
        if r["active_params"] != r["params"]
        else ""
    )
    lines = [
        f"plan: {r['params'] / 1e6:.2f}M params{active} on {r['devices']} {r['backend']} devices,"
        f" mesh {r['mesh']}",
        "memory per device:",
    ]
    for k in (
        "params_bytes",
        "optimizer_bytes",
        "gradient_bytes",
        "argument_bytes",
        "output_bytes",
        "temp_bytes",
        "peak_bytes",
    ):
        lines.append(f"  {k[:-6]:<12}{_mib(m[k])}")
        if k == "gradient_bytes" and m.get("base_bytes"):
            lines.append(
                f"  {'base':<12}{_mib(m['base_bytes'])} (the LoRA run's frozen base; params above: its adapters)"
            )
    lines.append(
        f"model FLOPs per step: {r['flops_per_step']:.3e} (compiler, per device:"
        f" {r['flops_per_step_per_device_compiled']:.3e})"
    )
    lines.append(
        "collectives per step, per device (measured from the compiled HLO | theory as this backend lowers it):"
    )
    for kind in KINDS:
        c = r["collectives_detail"][kind]
        if not c["count"]:
            continue
        for axes, v in sorted(c["by_axes"].items()):
            th = r["theory_on_backend_detail"].get(f"{kind}@{axes}")
            ref = f"| theory {_mib(th['operand_bytes'])}" if th else ""
            if (
                th and "sync_every" in th
            ):  # the HLO holds the lax.cond branch once: one sync's bytes
                ref = (
                    f"| theory {_mib(th['per_sync_operand_bytes'])} per sync; every {th['sync_every']} steps:"
                    f" {_mib(th['operand_bytes']).strip()} per step"
                )
            lines.append(
                f"  {kind:<19}{axes or '-':<18} x{v['count']:<5}{_mib(v['operand_bytes'])} operand,"
                f" {_mib(v['wire_bytes'])} on the wire {ref}"
            )
    for key, th in sorted(r["theory_on_backend_detail"].items()):
        kind, _, axes = key.partition("@")
        if axes not in r["collectives_detail"][kind]["by_axes"]:
            lines.append(
                f"  {kind:<19}{axes:<18} (not emitted)      | theory {_mib(th['operand_bytes'])}"
            )
    lines += [f"note: {n}" for n in r["notes"]]
    if "pipeline" in r:
        pp = r["pipeline"]
        lines += [
            pp["chart"],
            f"pipeline: stage-to-stage collective-permute per device per step: HLO"
            f" {_mib(pp['permute_bytes_hlo']).strip()} vs theory {_mib(pp['permute_bytes_theory']).strip()}"
            f" (of which useful, without bubble ticks: {_mib(pp['permute_bytes_useful']).strip()})",
        ]
    if show_sharding:
        lines.append(f"{'parameter':<34}{'shape':<22}{'spec':<40}{'per device':<20}{'bytes':>12}")
        for row in r["sharding"]:
            lines.append(
                f"{row['name']:<34}{str(tuple(row['shape'])):<22}{row['spec']:<40}"
                f"{str(tuple(row['local_shape'])):<20}{row['local_bytes']:>12,}"
            )
    return "\n".join(lines)


def run_flags(row: dict) -> str:
    """The flags that run `row`'s layout as priced: the gradient accumulation and, on a pipeline
    mesh, the pipeline schedule (its micro-batch count, repeats and schedule set the bubble)."""
    out = f"--mesh {row['mesh']} --micro-batches {row['micro_batches']}"
    if row.get("sequence_parallel"):
        out += " --parallelism.sequence_parallel true"
    for flag, value in row.get("offload", {}).items():  # what the search added to make the mesh fit
        out += f" {flag} {value}"
    pp = row["pipeline"]
    if pp:
        out += (
            f" --pipeline.microbatches {pp['microbatches']} --pipeline.repeats {pp['repeats']}"
            f" --pipeline.schedule {pp['schedule']}"
        )
    return out


def render_search(rows: list[dict], top: int, hw: Hardware, n_devices: int) -> str:
    """The mesh search's table (plan.search.search rows, best first): the `top` that fit."""
    fit = [r for r in rows if r["fits"]]
    usable = hw.usable_memory * hw.hbm_bytes / 2**30
    width = max([36] + [len(r["mesh"]) + 6 for r in fit[:top]])
    lines = [
        f"search: {len(rows)} valid meshes of {n_devices} x {hw.name}, {len(fit)} fit in {usable:.0f} GiB"
        f" per device; best {min(top, len(fit))} by predicted step time:",
        f"{'mesh':<{width}}{'pp-mb':>6}{'mem GiB':>9}{'step s':>9}{'MFU':>7}{'bubble':>7}"
        f"  comm per step (GiB sent per device, link, s)",
    ]
    for r in fit[:top]:
        comm = "; ".join(
            f"{k} {v['wire_bytes'] / 2**30:.2f} {v['link']} {v['time_s']:.3f}"
            for k, v in sorted(r["comm"].items())
        )
        pp_mb = r["pipeline"].get(
            "microbatches", "-"
        )  # --pipeline.microbatches this row is priced at
        mesh = (
            r["mesh"]
            + (" +sp" if r.get("sequence_parallel") else "")
            + (" +offload" if r.get("offload") else "")
        )
        lines.append(
            f"{mesh:<{width}}{pp_mb:>6}{r['memory']['total'] / 2**30:>9.1f}"
            f"{r['t_step_s']:>9.3f}{100 * r['mfu']:>6.1f}%{100 * r['bubble']:>6.1f}%  {comm or '-'}"
        )
    if not fit and rows:
        r = rows[0]
        lines.append(
            f"nothing fits: the smallest is {r['mesh']} at {r['memory']['total'] / 2**30:.1f} GiB per device;"
            f" use more devices, full remat or a smaller batch"
        )
    return "\n".join(lines)


def render_estimate(row: dict, hw: Hardware) -> str:
    """One mesh priced from the formulas (plan.search.evaluate, with its goodput): memory and cost."""
    m, gib = row["memory"], 2**30
    return (
        f"plan (formulas, not compiled): {run_flags(row)} on {row['devices']} x {hw.name}\n"
        f"memory per device (estimate): params {m['params'] / gib:.2f} GiB, grads {m['grads'] / gib:.2f},"
        f" optimizer {m['optimizer'] / gib:.2f}, activations {m['activations'] / gib:.2f},"
        f" total {m['total'] / gib:.2f} GiB -> {'fits' if row['fits'] else 'does NOT fit'} in"
        f" {hw.usable_memory * hw.hbm_bytes / gib:.0f} GiB\n"
        + (
            f"host memory per device (estimate): offloaded activations {m['host_activations'] / gib:.2f} GiB,"
            f" optimizer state {m['host_optimizer'] / gib:.2f} GiB\n"
            if m.get("host_activations") or m.get("host_optimizer")
            else ""
        )
        + render_cost(row, row["goodput"])
    )


def render_cost(pred: dict, good: dict | None = None) -> str:
    """The prediction as text lines (plan's output)."""
    place = ", ".join(f"{a}:{w}" for a, w in pred["placement"].items()) or "one device"
    roof = ""
    if pred.get("device_bytes"):
        how = "max" if pred.get("memory_overlap", True) else "sum"
        roof = (
            f"  ({how} of {pred['t_flops_s']:.4f} s matmul FLOPs and {pred['t_memory_s']:.4f} s for"
            f" {pred['device_bytes'] / 2**20:.0f} MiB of memory traffic)"
        )
    lines = [
        f"cost model on {pred['devices']} x {pred['hardware']} ({pred['dtype']}; axes {place}):",
        f"  compute      {pred['t_compute_s']:10.4f} s"
        + roof
        + (
            f"  (+ pipeline bubble {100 * pred['bubble']:.1f}% -> {pred['t_compute_with_bubble_s']:.4f} s)"
            if pred["bubble"]
            else ""
        ),
    ]
    for key, c in sorted(pred["comm"].items()):
        lines.append(
            f"  {key:<30}{c['wire_bytes'] / 2**30:10.3f} GiB sent  {c['link']:<5} {c['time_s']:10.4f} s"
            f"  {'overlappable' if c['overlappable'] else 'exposed'}"
            + (
                f"  (amortised: {c['per_sync_wire_bytes'] / 2**20:.2f} MiB per sync, every {c['sync_every']} steps)"
                if "sync_every" in c
                else ""
            )
        )
    if pred["overlap"]:
        lines.append(
            f"  step time    {pred['t_step_serial_s']:10.4f} s without overlap, {pred['t_step_overlap_s']:.4f} s"
            f" with overlap; MFU {100 * pred['mfu_serial']:.1f}% / {100 * pred['mfu']:.1f}%"
        )
    else:
        lines.append(
            f"  step time    {pred['t_step_s']:10.4f} s (collectives run synchronously here);"
            f" MFU {100 * pred['mfu']:.1f}%"
        )
    if good:
        g, y = good["checkpoint"], good["young_daly"]
        lines.append(
            f"  goodput on {good['devices']} devices ({good['failures_per_day']:.2f} failures/day, MTBF"
            f" {good['mtbf_s'] / 3600:.1f} h): {100 * g['goodput']:.1f}% with a save every"
            f" {g['interval_steps']:.0f} steps (T_save {g['t_save_s']:.2f} s, T_recover {g['t_recover_s']:.0f} s);"
            f" Young/Daly: every {y['interval_steps']:.0f} steps -> {100 * y['goodput']:.1f}%"
        )
        if "run" in good:
            r = good["run"]
            lines.append(
                f"  this run: {r['steps']} steps = {r['t_train_s'] / 3600:.2f} h of training,"
                f" {r['t_total_s'] / 3600:.2f} h wall ({r['n_ckpt']:.0f} saves, {r['n_fail']:.1f} failures expected)"
            )
    return "\n".join(lines)
