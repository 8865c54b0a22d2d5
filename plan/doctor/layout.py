"""The doctor's checks of the run on its mesh: the mesh and every divisibility (the run's own
checks: mesh.build.make_mesh and train.setup.setup), memory per device against what a device
has (plan's formulas), whether the layout is communication-bound, and the mesh `plan --search`
would pick instead."""

from __future__ import annotations

import numpy as np

from errors import UserError
from mesh.build import make_mesh
from mesh.rules import make_rules
from mesh.spec import AXES, mesh_text, resolve
from plan import estimate, hardware, search
from plan.cli import MAX_SEARCH_DEVICES, check_search_size
from plan.doctor.report import Check, fail, ok, warn
from plan.render import run_flags
from train.core.memory import available_bytes
from train.core.setup import setup
from train.core.shapes import batch_shards

GIB = 2**30
BETTER = 0.9  # the planner's pick is named when it predicts a step this much shorter or less
_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v5p", "tpu-v5p"))


def _bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _rate(x: float, unit: str) -> str:
    """3.2e14 -> '320 TFLOP/s'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:,.3g} {prefix}{unit}"
    return f"{x:,.3g} {unit}"


def profile_name(device_kind: str, platform: str) -> str:
    """The plan/hardware.py profile of a device kind ('' when there is none)."""
    kind = device_kind.lower()
    for key, name in _KINDS:
        if key in kind:
            return name
    return "cpu" if platform == "cpu" else ""


def mesh_and_setup(cfg, devices: list) -> tuple[list[Check], object, object]:
    """The run's mesh over `devices` and its setup (shardings, rules, every divisibility)
    -> (their checks, the mesh or None, the setup or None)."""
    p = cfg.parallelism
    try:
        mesh = make_mesh(p.mesh, p.mesh_dcn, devices)
    except UserError as e:
        fix = (
            f"choose a --mesh of {len(devices)} devices (`python -m train plan --search"
            f" {len(devices)} --hardware NAME` ranks them)"
        )
        return [fail("mesh", str(e), fix)], None, None
    checks = [ok("mesh", f"{mesh_text(mesh.shape)} over {mesh.size} devices")]
    try:
        s = setup(cfg, mesh)
    except UserError as e:
        return (
            [*checks, fail("divisibility", str(e), "the line names the flag to change")],
            mesh,
            None,
        )
    m, t = cfg.model, cfg.train
    shards = batch_shards(mesh, s.rules)
    checks.append(
        ok(
            "divisibility",
            f"every parameter dimension, the batch ({t.batch_size} sequences over {shards}"
            f" batch shards x {t.micro_batches} micro-batches) and the sequence ({t.seq_len})"
            f" split evenly on {mesh_text(mesh.shape)} ({m.n_layers} layers, d_model {m.d_model})",
        )
    )
    return checks, mesh, s


def predicted_row(cfg, sizes: dict, dcn: dict, hw) -> dict:
    """plan's formulas for this run on `sizes` (memory, compute and communication times)."""
    p, t = cfg.parallelism, cfg.train
    return estimate.evaluate(
        cfg.model,
        sizes,
        hw,
        t.batch_size,
        t.seq_len,
        t.micro_batches,
        rules=make_rules(p.rules),
        train_cfg=t,
        dcn=dcn,
        comm_cfg=cfg.comm,
        pipeline_cfg=cfg.pipeline,
        vocab_parallel=p.vocab_parallel,
        sequence_parallel=p.sequence_parallel,
        experts_over_fsdp=p.experts_over_fsdp,
    )


def memory(row: dict, devices: list) -> Check:
    """The predicted peak per device against what one device may use."""
    need, (have, what) = row["memory"]["total"], available_bytes(devices)
    figures = f"{_bytes(need)} per device predicted (plan's formulas), {what}"
    fix = (
        "shard the state over more devices (a larger fsdp axis), --micro-batches N, --model.remat"
        " full, or a smaller --batch-size/--seq-len (`python -m train plan` compiles the step)"
    )
    if not have:
        return warn("memory", f"{figures}: the device's capacity is unknown", fix)
    if need > have:
        return fail("memory", f"{figures}: does not fit", fix)
    if need > 0.9 * have:
        return warn("memory", f"{figures}: {100 * need / have:.0f}% of it, little headroom", fix)
    return ok("memory", f"{figures} ({100 * need / have:.0f}%)")


def _fsdp(cfg, s, hw, dtype: str, per_host: int) -> Check | None:
    """FSDP gathers every parameter each micro-step: it hides under the math only when each
    device computes on enough tokens (compute 6·tokens·P/C against gathers and a reduce-scatter
    of 3·P·bytes·(f-1)/f over the link: tokens >= C·bytes·(f-1) / (2·f·W))."""
    mesh, t = s.mesh, cfg.train
    f = mesh.shape["fsdp"]
    if f == 1:
        return None
    dcn = dict(zip(AXES, resolve(cfg.parallelism.mesh, mesh.size, cfg.parallelism.mesh_dcn).dcn))
    across = dcn["fsdp"] > 1 or f > per_host
    link, bw = ("between hosts", hw.inter_bw) if across else ("inside a host", hw.intra_bw)
    flops, nbytes = hw.peak_flops(dtype), np.dtype(cfg.model.param_dtype).itemsize
    need = flops * nbytes * (f - 1) / (2 * f * bw)
    tokens = t.batch_size * t.seq_len / (t.micro_batches * batch_shards(mesh, s.rules))
    words = (
        f"fsdp={f}: {tokens:,.0f} tokens per device per micro-batch against the {need:,.0f} at"
        f" which {hw.name}'s {_rate(flops, 'FLOP/s')} over the {_rate(bw, 'B/s')} link {link}"
        f" hides the parameter gathers ({nbytes}-byte parameters)"
    )
    if tokens >= need:
        return ok("fsdp communication", f"{words}: compute-bound")
    return warn(
        "fsdp communication",
        f"{words}: communication-bound",
        "more tokens per device (a larger --batch-size, fewer --micro-batches), a smaller fsdp"
        " axis (data parallelism instead), or fsdp inside a host (--mesh-dcn data=N)",
    )


def _tensor(cfg, mesh, hw, per_host: int) -> Check | None:
    """Tensor parallelism all-reduces activations twice per layer: it belongs on the fast links."""
    m = mesh.shape["model"]
    if m == 1:
        return None
    dcn = resolve(cfg.parallelism.mesh, mesh.size, cfg.parallelism.mesh_dcn).dcn
    if dict(zip(AXES, dcn))["model"] > 1 or m > per_host:
        return warn(
            "tensor parallelism",
            f"model={m} spans hosts of {per_host} devices: its two all-reduces per layer cross"
            f" the {_rate(hw.inter_bw, 'B/s')} link between hosts instead of"
            f" {_rate(hw.intra_bw, 'B/s')} inside one",
            f"keep model within a host (model <= {per_host}) and put fsdp or data across hosts",
        )
    return ok("tensor parallelism", f"model={m} stays inside a host ({per_host} devices each)")


def communication(cfg, s, hw, row: dict, per_host: int) -> list[Check]:
    dtype = cfg.model.compute_dtype(hw.platform)
    out = [c for c in (_fsdp(cfg, s, hw, dtype, per_host), _tensor(cfg, s.mesh, hw, per_host)) if c]
    exposed, compute = row["t_comm_exposed_s"], row["t_compute_s"]
    words = (
        f"{row['t_step_s']:.3g}s per step predicted on {hw.name}: compute {compute:.3g}s,"
        f" communication {row['t_comm_s']:.3g}s of which {exposed:.3g}s not hidden"
    )
    if exposed > compute:
        out.append(
            warn(
                "step time",
                f"{words}: communication-bound",
                "see the mesh plan --search picks (below)",
            )
        )
    else:
        out.append(ok("step time", words))
    return out


def planner(cfg, mesh, hw, row: dict) -> Check:
    """The mesh `plan --search` ranks first for this run, when it predicts a shorter step."""
    n, t = mesh.size, cfg.train
    if n > MAX_SEARCH_DEVICES:
        return ok("planner", f"not searched ({n} devices)")
    try:
        check_search_size(n)
    except UserError as e:
        return ok("planner", f"not searched: {e}")
    rows = search.search(
        cfg.model,
        n,
        hw,
        t.batch_size,
        t.seq_len,
        t.micro_batches,
        rules=make_rules(cfg.parallelism.rules),
        train_cfg=t,
        comm_cfg=cfg.comm,
        pipeline_cfg=cfg.pipeline,
        vocab_parallel=cfg.parallelism.vocab_parallel,
        experts_over_fsdp=cfg.parallelism.experts_over_fsdp,
    )
    best = next((r for r in rows if r["fits"]), None)
    if best is None:
        return warn(
            "planner",
            f"plan --search {n} --hardware {hw.name}: no mesh of {n} devices fits",
            "more devices, or the memory fixes above",
        )
    here = mesh_text(mesh.shape)
    if best["mesh"] == here or best["t_step_s"] >= BETTER * row["t_step_s"]:
        return ok(
            "planner",
            f"{here} is plan --search's pick or within {100 - 100 * BETTER:.0f}% of it"
            f" ({best['mesh']}: {best['t_step_s']:.3g}s per step predicted)",
        )
    return warn(
        "planner",
        f"plan --search {n} --hardware {hw.name} picks {best['mesh']}:"
        f" {best['t_step_s']:.3g}s per step predicted against {row['t_step_s']:.3g}s for {here}",
        f"run with {run_flags(best)}",
    )


def run_checks(cfg, devices: list, hardware_name: str, per_host: int):
    """Every check of the run on its mesh -> (checks, the setup or None)."""
    checks, mesh, s = mesh_and_setup(cfg, devices)
    if s is None:
        return checks, None
    if not hardware_name:
        kind = devices[0].device_kind
        return [
            *checks,
            warn(
                "memory",
                f"no hardware profile for {kind}: memory and communication not predicted",
                "pass --hardware NAME (h100, h200, a100, tpu-v5p, cpu)",
            ),
        ], s
    hw = hardware.get(hardware_name, mesh.size, cfg.model.compute_dtype(devices[0].platform))
    dcn = dict(zip(AXES, resolve(cfg.parallelism.mesh, mesh.size, cfg.parallelism.mesh_dcn).dcn))
    row = predicted_row(cfg, dict(mesh.shape), dcn, hw)
    checks.append(memory(row, devices))
    checks += communication(cfg, s, hw, row, per_host)
    checks.append(planner(cfg, mesh, hw, row))
    return checks, s
