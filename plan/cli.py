"""`python -m plan [flags]` (also `python -m train plan [flags]`): the run's own flags, plus

(none)                 compile the step on --mesh and report memory, FLOPs and collectives
                       per device
--hardware NAME        ... and predict step time, MFU and goodput on that hardware (plan/cost.py)
--devices N            predict --mesh on N devices from the formulas alone, without compiling
                       (plan/estimate.py)
--search N             rank every valid mesh of N devices by predicted step time (plan/search.py)
"""

from __future__ import annotations

import argparse
import json
import math

from errors import UserError, number
from mesh.build import start_mesh
from mesh.rules import make_rules
from mesh.spec import AXES, resolve
from models import pipeline as pipeline_lib
from plan import cost, hardware, search
from plan.compiled_cost import from_plan
from plan.estimate import evaluate
from plan.hardware import Hardware
from plan.render import (
    render,
    render_cost,
    render_estimate,
    render_schedules,
    render_search,
    run_flags,
)
from plan.report import analyze, memory_traffic
from plan.schedules import compare_schedules
from train.core.config import build, make_parser
from train.core.setup import setup

# `--search N` enumerates every ordered factorisation of N over the mesh axes, then prices those the
# model allows: ~70 us a candidate to reject, 20-40 ms one to price (70b, --batch-size N, one busy
# laptop core). 65,536 (20,349 candidates, 1,801 priced) ranks in 36 s, 2^20 (53,130) in ~40 s,
# 61,440 (222,768, 2,058 priced) in 81 s; N with many small divisors is what costs: 430,080 has
# 1,336,608 candidates (5.4 min), and the enumeration loops over every integer up to N for each
# axis (a prime 1,000,000,007: billions of steps). 2^20 devices is more than any machine built.
# Refused above either bound, in one line.
MAX_SEARCH_DEVICES = 1 << 20
MAX_SEARCH_MESHES = 250_000


def add_args(parser) -> None:
    """The flags `plan` adds to the run's own."""
    g = parser.add_argument_group("cost model (--hardware) and mesh search (--search)")
    g.add_argument(
        "--hardware",
        metavar="NAME",
        default="",
        help="predict step time, MFU and goodput on: h100, h200, a100, tpu-v5p, cpu",
    )
    g.add_argument(
        "--devices",
        type=number(int, f"[0, {MAX_SEARCH_DEVICES}]"),
        default=0,
        metavar="N",
        help="with --hardware: predict --mesh on N devices from formulas, without compiling",
    )
    g.add_argument(
        "--search",
        type=number(int, f"[0, {MAX_SEARCH_DEVICES}]"),
        default=0,
        metavar="N",
        help="rank every valid mesh of N devices by predicted step time (with --hardware)",
    )
    g.add_argument(
        "--top", type=number(int, ">=1"), default=10, metavar="K", help="--search: meshes shown"
    )
    g.add_argument(
        "--smallest",
        action="store_true",
        help="with --search N: the fewest devices (1, 2, 4, ... up to N) on which a mesh fits,"
        " ranked there (e.g. a LoRA/QLoRA fine-tune of a preset at a sequence length)",
    )
    g.add_argument(
        "--cluster-size",
        type=number(int, ">=0"),
        default=0,
        metavar="N",
        help="devices whose failure stops the job, for goodput (0 = the mesh's devices)",
    )
    g.add_argument(
        "--fail-rate",
        type=number(float, ">=0"),
        default=0.001,
        metavar="X",
        help="failures per device per day (default 0.1%%: 10 a day on 10,000 GPUs)",
    )
    g.add_argument(
        "--restart-s",
        type=number(float, ">=0"),
        default=300.0,
        metavar="S",
        help="seconds to reschedule, restart and recompile after a failure (restore time is added)",
    )
    g.add_argument(
        "--ckpt-write-gbps",
        type=number(float, ">=0"),
        default=0.0,
        metavar="X",
        help="GB/s per device to checkpoint storage (0 = the profile's)",
    )


def make_plan_parser():
    """The run's flags (train/core/config.py) and plan's own."""
    parser = make_parser(
        "python -m train plan",
        "Compile the train step ahead of time and report memory,"
        " FLOPs and collectives per device, without training.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--show-sharding", action="store_true", help="per-parameter sharding table")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default="",
        help="with --mesh pipeline=P > 1: draw the pipeline schedule to PATH"
        " (PNG, needs matplotlib)",
    )
    add_args(parser)
    return parser


def main(argv: list[str]) -> int:
    ns = make_plan_parser().parse_args(argv)
    cfg = build({k: v for k, v in vars(ns).items() if "." in k}, getattr(ns, "config", None))
    if ns.search or ns.devices:  # formulas only: the target device count need not exist here
        report, text = analytic(ns, cfg)
        print(json.dumps(report) if ns.json else text)
        return 0
    mesh = start_mesh(cfg.parallelism)
    s = setup(cfg, mesh)
    if ns.plot:
        P = mesh.shape["pipeline"]
        if P == 1:
            raise UserError(
                "--plot draws the pipeline schedule: it needs --mesh pipeline=P with P > 1"
            )
        pc = cfg.pipeline
        pipeline_lib.plot_schedule(P, pc.microbatches_for(P), pc.repeats, pc.schedule, path=ns.plot)
    report = analyze(s)
    if ns.hardware and hardware.platform_of(ns.hardware) == report["backend"]:
        # the compile's bytes price only its own backend (plan.compiled_cost.from_plan):
        # no second compile else
        report["memory_traffic"] = memory_traffic(s, report)
    cost_text = with_cost(report, ns, cfg, mesh) if ns.hardware else ""
    if ns.json:
        if not ns.show_sharding:
            report.pop("sharding")
        print(json.dumps(report))
    else:
        print("\n".join(x for x in (render(report, ns.show_sharding), cost_text) if x))
    return 0


def _hardware(ns, n_devices: int, cfg) -> Hardware:
    if not ns.hardware:
        raise UserError(
            f"--search/--devices need --hardware NAME; valid: {', '.join(hardware.PROFILES)}"
        )
    # dtype: for the CPU profile
    return hardware.get(ns.hardware, n_devices, cfg.model.compute_dtype("cpu"))


def _goodput(ns, cfg, pred: dict, state_bytes: float, hw: Hardware) -> dict:
    c = cfg.checkpoint
    return cost.goodput(
        pred["t_step_s"],
        state_bytes,
        ns.cluster_size or pred["devices"],
        hw,
        ckpt_every=c.every,
        async_save=c.async_save,
        fail_rate=ns.fail_rate,
        restart_s=ns.restart_s,
        write_bw=ns.ckpt_write_gbps * 1e9 or None,
        steps=cfg.train.steps,
    )


def _search(ns, cfg, hw: Hardware, rules) -> tuple[dict, str]:
    """`plan --search N`: every mesh of N devices ranked, the best one's goodput."""
    t, p, n = cfg.train, cfg.parallelism, ns.search
    check_search_size(n)
    rows = search.search(
        cfg.model,
        n,
        hw,
        t.batch_size,
        t.seq_len,
        t.micro_batches,
        rules=rules,
        train_cfg=t,
        comm_cfg=cfg.comm,
        pipeline_cfg=cfg.pipeline,
        vocab_parallel=p.vocab_parallel,
        lora_cfg=cfg.lora,
        post_cfg=cfg.post,
        experts_over_fsdp=p.experts_over_fsdp,
    )
    fit = [r for r in rows if r["fits"]]
    text = render_search(rows, ns.top, hw, n)
    report = {
        "devices": n,
        "hardware": hw.name,
        "valid": len(rows),
        "fit": len(fit),
        "top": fit[: ns.top],
    }
    if fit:
        best = fit[0]
        report["goodput"] = _goodput(
            ns, cfg, best, best["memory"]["params"] + best["memory"]["optimizer"], hw
        )
        text += f"\nbest mesh: {run_flags(best)}\n" + render_cost(best, report["goodput"])
    return report, text


def _estimate(ns, cfg, hw: Hardware, rules) -> tuple[dict, str]:
    """`plan --devices N`: the run's own mesh priced, and on a pipeline mesh every schedule's
    price beside it."""
    t, p = cfg.train, cfg.parallelism
    shape = resolve(p.mesh, ns.devices, p.mesh_dcn)
    args = (cfg.model, shape.as_dict(), hw, t.batch_size, t.seq_len, t.micro_batches)
    kwargs = dict(
        rules=rules,
        train_cfg=t,
        dcn=dict(zip(AXES, shape.dcn)),
        comm_cfg=cfg.comm,
        pipeline_cfg=cfg.pipeline,
        vocab_parallel=p.vocab_parallel,
        sequence_parallel=p.sequence_parallel,
        lora_cfg=cfg.lora,
        experts_over_fsdp=p.experts_over_fsdp,
    )
    row = evaluate(*args, **kwargs, post_cfg=cfg.post)
    row["goodput"] = _goodput(
        ns, cfg, row, row["memory"]["params"] + row["memory"]["optimizer"], hw
    )
    text = render_estimate(row, hw)
    if shape.as_dict().get("pipeline", 1) > 1:
        row["schedules"] = compare_schedules(*args, **kwargs)
        text += "\n" + render_schedules(row["schedules"])
    return row, text


def analytic(ns, cfg) -> tuple[dict, str]:
    """`plan --search N` / `plan --devices N`: no compile. -> (JSON-able report, text)."""
    hw = _hardware(ns, ns.search or ns.devices, cfg)
    rules = make_rules(cfg.parallelism.rules)
    if ns.search and ns.smallest:
        return _smallest(ns, cfg, rules)
    if ns.search:
        return _search(ns, cfg, hw, rules)
    return _estimate(ns, cfg, hw, rules)


def _smallest(ns, cfg, rules) -> tuple[dict, str]:
    """`plan --search N --smallest`: `--search n` for n = 1, 2, 4, ... <= N until a mesh fits."""
    n, report, text = 1, {}, ""
    while n <= ns.search:
        sub = argparse.Namespace(**{**vars(ns), "search": n})
        report, text = _search(sub, cfg, _hardware(sub, n, cfg), rules)
        if report["fit"]:
            best = report["top"][0]
            report["smallest"] = n
            return report, f"smallest: {n} device(s), {best['mesh']}\n" + text
        n *= 2
    report["smallest"] = None
    return report, f"smallest: no mesh of up to {ns.search} devices fits\n" + text


def with_cost(report: dict, ns, cfg, mesh) -> str:
    """Add report['cost'] (and report['goodput']) for a compiled plan; -> the text lines."""
    t = cfg.train
    sizes = {a: mesh.shape[a] for a in AXES}
    hw = _hardware(ns, mesh.size, cfg)
    dcn = dict(zip(AXES, resolve(cfg.parallelism.mesh, mesh.size, cfg.parallelism.mesh_dcn).dcn))
    pred = from_plan(report, hw, cfg.model, t.batch_size, t.seq_len, t.micro_batches, sizes, dcn)
    mem = report["memory"]
    good = _goodput(ns, cfg, pred, mem["params_bytes"] + mem["optimizer_bytes"], hw)
    report["cost"], report["goodput"] = pred, good
    return f"collectives from the {pred['comm_source']}\n" + render_cost(pred, good)


def mesh_count(n: int, axes: int = len(AXES)) -> int:
    """How many meshes `--search n` enumerates: the ordered factorisations of n into `axes`
    factors, C(e + axes - 1, axes - 1) for each prime power p^e of n, multiplied."""
    count, p = 1, 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n, e = n // p, e + 1
        count *= math.comb(e + axes - 1, axes - 1)
        p += 1
    return count * (axes if n > 1 else 1)


def check_search_size(n: int) -> None:
    """UserError for a `--search N` that cannot be ranked in about a minute (MAX_SEARCH_*)."""
    if n > MAX_SEARCH_DEVICES:
        raise UserError(f"--search {n}: at most {MAX_SEARCH_DEVICES} devices (2^20) are ranked")
    meshes = mesh_count(n)
    if meshes > MAX_SEARCH_MESHES:
        raise UserError(
            f"--search {n}: its many divisors make {meshes} candidate meshes, more than the"
            f" {MAX_SEARCH_MESHES} ranked in about a minute; a size with fewer small factors"
            f" ranks (up to {MAX_SEARCH_DEVICES} = 2^20: {mesh_count(MAX_SEARCH_DEVICES)} meshes)"
        )
