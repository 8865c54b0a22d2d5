"""Every text `plan` prints: the compiled report (plan.report.analyze), the mesh search's table,
one mesh priced from the formulas, the cost model's prediction with its goodput, and the pipeline
schedules side by side.
"""

from __future__ import annotations

from plan.hardware import Hardware
from plan.hlo import KINDS


def _mib(b: float) -> str:
    return f"{b / 2**20:10.2f} MiB"


def _memory_lines(r: dict) -> list[str]:
    """The report's per-device memory by part, a LoRA run's frozen base apart."""
    m = r["memory"]
    lines = ["memory per device:"]
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
                f"  {'base':<12}{_mib(m['base_bytes'])} (the LoRA run's frozen base;"
                " params above: its adapters)"
            )
            lines.append(
                f"  {'formed':<12}{_mib(m.get('merge_bytes', 0))} (formula: the weights the"
                " layers form from the base, in temp: two layers' at the compute dtype, gathered;"
                " the adapters are applied factored)"
            )
        if k == "gradient_bytes" and m.get("reference_bytes"):
            lines.append(
                f"  {'reference':<12}{_mib(m['reference_bytes'])} (the frozen reference model of"
                " --objective dpo|ipo, or grpo with --post.kl_beta)"
            )
    if "rollout_bytes" in m:
        lines += _rollout_lines(m)
    return lines


def _rollout_lines(m: dict) -> list[str]:
    """--objective grpo: the sampler's memory by part, and the peak with it (plan/report.py)."""
    p = m["rollout_parts"]
    split = f"split over {p['split']} devices" if p["split"] > 1 else "every device all of them"
    return [
        f"  {'rollout':<12}{_mib(m['rollout_bytes'])} (formula: grpo's sampler, {p['rows']} rows,"
        f" {split}: KV cache {_mib(p['kv_cache']).strip()}, weights gathered"
        f" {_mib(p['weights']).strip()}, logits and scores {_mib(p['activations']).strip()},"
        f" tokens {_mib(p['prompts']).strip()})",
        f"  {'peak+rollout':<12}{_mib(m['peak_with_rollout_bytes'])} (the larger of the update's"
        f" {_mib(m['update_live_bytes']).strip()} and the rollout's"
        f" {_mib(m['rollout_live_bytes']).strip()}: the state's shards and the sampler; never"
        " live together)",
    ]


def _collective_lines(r: dict) -> list[str]:
    """Each collective the HLO emits, per kind and mesh axes, beside its theory; then the ones
    the theory expects and the HLO does not emit."""
    lines = []
    for kind in KINDS:
        c = r["collectives_detail"][kind]
        if not c["count"]:
            continue
        for axes, v in sorted(c["by_axes"].items()):
            th = r["theory_on_backend_detail"].get(f"{kind}@{axes}")
            ref = f"| theory {_mib(th['operand_bytes'])}" if th else ""
            if th and "sync_every" in th:
                # the HLO holds the lax.cond branch once: one sync's bytes
                ref = (
                    f"| theory {_mib(th['per_sync_operand_bytes'])} per sync;"
                    f" every {th['sync_every']} steps: {_mib(th['operand_bytes']).strip()} per step"
                )
            lines.append(
                f"  {kind:<19}{axes or '-':<18} x{v['count']:<5}"
                f"{_mib(v['operand_bytes'])} operand,"
                f" {_mib(v['wire_bytes'])} on the wire {ref}"
            )
    for key, th in sorted(r["theory_on_backend_detail"].items()):
        kind, _, axes = key.partition("@")
        if axes not in r["collectives_detail"][kind]["by_axes"]:
            lines.append(
                f"  {kind:<19}{axes:<18} (not emitted)      | theory {_mib(th['operand_bytes'])}"
            )
    return lines


def _pipeline_lines(pp: dict) -> list[str]:
    """The compiled pipeline's chart and its stage-to-stage traffic, HLO against theory."""
    return [
        pp["chart"],
        f"pipeline: stage-to-stage collective-permute per device per step: HLO"
        f" {_mib(pp['permute_bytes_hlo']).strip()}"
        f" vs theory {_mib(pp['permute_bytes_theory']).strip()}"
        " (of which useful, without bubble ticks:"
        f" {_mib(pp['permute_bytes_useful']).strip()})",
    ]


def _sharding_lines(r: dict) -> list[str]:
    """One row per parameter: its shape, spec and per-device shard."""
    lines = [f"{'parameter':<34}{'shape':<22}{'spec':<40}{'per device':<20}{'bytes':>12}"]
    for row in r["sharding"]:
        lines.append(
            f"{row['name']:<34}{str(tuple(row['shape'])):<22}{row['spec']:<40}"
            f"{str(tuple(row['local_shape'])):<20}{row['local_bytes']:>12,}"
        )
    return lines


def render(r: dict, show_sharding: bool) -> str:
    """The compiled report (analyze) as text."""
    active = (
        f" ({r['active_params'] / 1e6:.2f}M active per token)"
        if r["active_params"] != r["params"]
        else ""
    )
    lines = [
        f"plan: {r['params'] / 1e6:.2f}M params{active} on {r['devices']} {r['backend']} devices,"
        f" mesh {r['mesh']}",
        *_memory_lines(r),
        f"model FLOPs per step: {r['flops_per_step']:.3e} (compiler, per device:"
        f" {r['flops_per_step_per_device_compiled']:.3e})",
        "collectives per step, per device"
        " (measured from the compiled HLO | theory as this backend lowers it):",
        *_collective_lines(r),
    ]
    lines += [f"note: {n}" for n in r["notes"]]
    if "pipeline" in r:
        lines += _pipeline_lines(r["pipeline"])
    if show_sharding:
        lines += _sharding_lines(r)
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
        f"search: {len(rows)} valid meshes of {n_devices} x {hw.name},"
        f" {len(fit)} fit in {usable:.0f} GiB per device;"
        f" best {min(top, len(fit))} by predicted step time:",
        f"{'mesh':<{width}}{'pp-mb':>6}{'mem GiB':>9}{'step s':>9}{'MFU':>7}{'bubble':>7}"
        f"  comm per step (GiB sent per device, link, s)",
    ]
    for r in fit[:top]:
        comm = "; ".join(
            f"{k} {v['wire_bytes'] / 2**30:.2f} {v['link']} {v['time_s']:.3f}"
            for k, v in sorted(r["comm"].items())
        )
        pp_mb = r["pipeline"].get("microbatches", "-")  # its --pipeline.microbatches
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
            f"nothing fits: the smallest is {r['mesh']}"
            f" at {r['memory']['total'] / 2**30:.1f} GiB per device;"
            " use more devices, full remat or a smaller batch"
        )
    return "\n".join(lines)


def render_estimate(row: dict, hw: Hardware) -> str:
    """One mesh priced from the formulas (plan.estimate.evaluate, with its goodput): memory and
    cost."""
    m, gib = row["memory"], 2**30
    return (
        f"plan (formulas, not compiled): {run_flags(row)} on {row['devices']} x {hw.name}\n"
        f"memory per device (estimate): params {m['params'] / gib:.2f} GiB,"
        f" grads {m['grads'] / gib:.2f},"
        f" optimizer {m['optimizer'] / gib:.2f}, activations {m['activations'] / gib:.2f},"
        + (
            f" LoRA base {m['base'] / gib:.2f} (params: the adapters), formed weights"
            f" {m['merge'] / gib:.2f},"
            if "base" in m
            else ""
        )
        + (
            f" rollout {m['rollout'] / gib:.2f} (grpo's sampler, not live with the update's"
            " grads and activations),"
            if "rollout" in m
            else ""
        )
        + f" total {m['total'] / gib:.2f} GiB -> {'fits' if row['fits'] else 'does NOT fit'} in"
        f" {hw.usable_memory * hw.hbm_bytes / gib:.0f} GiB\n"
        + (
            "host memory per device (estimate):"
            f" offloaded activations {m['host_activations'] / gib:.2f} GiB,"
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
            f"  (+ pipeline bubble {100 * pred['bubble']:.1f}%"
            f" -> {pred['t_compute_with_bubble_s']:.4f} s)"
            if pred["bubble"]
            else ""
        ),
    ]
    for key, c in sorted(pred["comm"].items()):
        lines.append(
            f"  {key:<30}{c['wire_bytes'] / 2**30:10.3f} GiB sent  {c['link']:<5}"
            f" {c['time_s']:10.4f} s  {'overlappable' if c['overlappable'] else 'exposed'}"
            + (
                f"  (amortised: {c['per_sync_wire_bytes'] / 2**20:.2f} MiB per sync,"
                f" every {c['sync_every']} steps)"
                if "sync_every" in c
                else ""
            )
        )
    if pred["overlap"]:
        lines.append(
            f"  step time    {pred['t_step_serial_s']:10.4f} s without overlap,"
            f" {pred['t_step_overlap_s']:.4f} s with overlap;"
            f" MFU {100 * pred['mfu_serial']:.1f}% / {100 * pred['mfu']:.1f}%"
        )
    else:
        lines.append(
            f"  step time    {pred['t_step_s']:10.4f} s (collectives run synchronously here);"
            f" MFU {100 * pred['mfu']:.1f}%"
        )
    if good:
        g, y = good["checkpoint"], good["young_daly"]
        lines.append(
            f"  goodput on {good['devices']} devices ({good['failures_per_day']:.2f} failures/day,"
            f" MTBF {good['mtbf_s'] / 3600:.1f} h): {100 * g['goodput']:.1f}% with a save every"
            f" {g['interval_steps']:.0f} steps (T_save {g['t_save_s']:.2f} s,"
            f" T_recover {g['t_recover_s']:.0f} s);"
            f" Young/Daly: every {y['interval_steps']:.0f} steps -> {100 * y['goodput']:.1f}%"
        )
        if "run" in good:
            r = good["run"]
            lines.append(
                f"  this run: {r['steps']} steps = {r['t_train_s'] / 3600:.2f} h of training,"
                f" {r['t_total_s'] / 3600:.2f} h wall ({r['n_ckpt']:.0f} saves,"
                f" {r['n_fail']:.1f} failures expected)"
            )
    return "\n".join(lines)


def render_schedules(rows: list[dict]) -> str:
    """The pipeline schedules side by side (plan.schedules.compare_schedules rows)."""
    gib = 2**30
    lines = [
        "pipeline schedules at this micro-batch count (per device; in flight: the most micro-batch"
        " passes a device holds between their forward and backward):",
        f"  {'schedule':<22} {'bubble':>7} {'counted':>8} {'in flight':>9} {'activations':>12}"
        f" {'total':>10}  fits  step",
    ]
    for r in rows:
        name = r["schedule"] + (f" x{r['repeats']}" if r["repeats"] > 1 else "")
        lines.append(
            f"  {name:<22} {r['bubble_formula']:>7.1%} {r['bubble_counted']:>8.1%}"
            f" {r['in_flight']:>9} {r['activations'] / gib:>8.2f} GiB {r['total'] / gib:>6.2f} GiB"
            f"  {'yes' if r['fits'] else 'no ':<4}  {r['t_step_s']:.3f} s"
        )
    return "\n".join(lines)
