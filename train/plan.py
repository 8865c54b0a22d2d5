"""`python -m train plan`: compile the train step ahead of time, without data or training, and
report per-device memory, FLOPs and the collectives the compiler chose, next to theory.

Everything is computed from abstract arrays (ShapeDtypeStructs with shardings), so a 70B plan
on 8 fake CPU devices allocates nothing.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict

import jax

from mesh.spec import mesh_text
from errors import UserError
from mesh.hlo import KINDS, parse_collectives, summarize
from mesh.rules import logical_to_spec
from mesh.shard import axes_size, data_parallel_axes, path_names, spec_axes
from models import model as model_lib, pipeline as pipeline_lib
from models.flops import active_param_count, flops_per_token, param_count
from models.attention import fused_qkv
from models.moe import exchange_for
from train import hardware, search
from train.config import make_parser, build
from train.loop import Trainer


def _shards(mesh, spec) -> int:
    return math.prod(axes_size(mesh, e) for e in spec)


def _local_bytes(sds) -> float:
    sh = sds.sharding
    return math.prod(sds.shape) * sds.dtype.itemsize / _shards(sh.mesh, sh.spec)


def sharding_table(abstract_params) -> list[dict]:
    rows = []
    for name, sds in path_names(abstract_params, is_leaf=lambda x: hasattr(x, "shape")):
        spec = sds.sharding.spec
        local = sds.sharding.shard_shape(sds.shape)
        rows.append({"name": name, "shape": list(sds.shape), "spec": str(spec), "local_shape": list(local),
                     "local_bytes": int(_local_bytes(sds))})
    return rows


def theory(tr: Trainer, abstract_state) -> dict:
    """Ideal per-device collective bytes per step from the ring formulas (all-reduce 2(n-1)/n x
    bytes; all-gather and reduce-scatter (n-1)/n x bytes).

    For each parameter: the batch mesh axes it is *not* sharded on carry plain data parallelism
    (all-reduce of its gradient shard: 2(n-1)/n x M); the batch axes it *is* sharded on carry
    ZeRO-3/FSDP (all-gather of the weights in forward and again in backward, and a reduce-scatter
    of the gradient, per micro-batch: (n-1)/n x M each). On a pipeline mesh the layer stack's FSDP
    traffic repeats on every tick (pipeline_uses).
    """
    mesh, rules, t = tr.mesh, tr.rules, tr.cfg.train
    batch_axes = [a for a in spec_axes(logical_to_spec(("batch",), rules)) if mesh.shape[a] > 1]
    entries: dict[tuple[str, str], dict] = defaultdict(lambda: {"operand_bytes": 0.0, "wire_bytes": 0.0})

    def add(kind, axes, operand, n, wire_factor):
        if n <= 1 or operand == 0:
            return
        e = entries[(kind, ",".join(a for a in mesh.axis_names if a in axes))]
        e["operand_bytes"] += operand
        e["wire_bytes"] += wire_factor * operand

    m = tr.model_cfg
    names = dict(path_names(model_lib.param_axes(m), is_leaf=lambda x: isinstance(x, tuple)))
    expert_axes = spec_axes(logical_to_spec(("experts",), rules))
    explicit_rs: dict[str, float] = defaultdict(float)
    uses, replicas = pipeline_uses(tr)
    for path, sds in path_names(abstract_state.params, is_leaf=lambda x: hasattr(x, "shape")):
        used = spec_axes(sds.sharding.spec)
        # an expert's weights live on the devices its tokens travel to: no collective over the
        # expert axes (the tokens move by all-to-all instead, below)
        is_expert = "experts" in names[path]
        own = [a for a in batch_axes if not (is_expert and a in expert_axes)]
        fsdp_axes = [a for a in own if a in used]
        dp_axes = [a for a in own if a not in used]
        n_f = math.prod(mesh.shape[a] for a in fsdp_axes)
        n_d = math.prod(mesh.shape[a] for a in dp_axes)
        full = _local_bytes(sds) * n_f  # gradient bytes before the fsdp split (after tensor parallel)
        in_stack = path.startswith(("blocks/", "moe_blocks/"))
        per_pass = uses if in_stack and not set(fsdp_axes) <= replicas else 1
        for _ in range(t.micro_batches):  # ZeRO-3 reduce-scatters every micro-batch's gradient
            add("reduce-scatter", fsdp_axes, full * per_pass, n_f, (n_f - 1) / n_f)
            if is_expert and n_f > 1:  # models/moe.py gathers them inside shard_map: an explicit
                explicit_rs[",".join(a for a in mesh.axis_names if a in fsdp_axes)] += full * per_pass  # psum_scatter
        add("all-reduce", dp_axes, full / n_f, n_d, 2 * (n_d - 1) / n_d)  # once per step (no_sync)
        # FSDP gathers weights for the forward pass; rematerialised layers gather them again for
        # the backward recompute (ZeRO-3); weights outside the layer stack stay gathered. Per micro-batch.
        gathers = 2 if in_stack and m.remat != "none" else 1
        for _ in range(gathers * t.micro_batches):
            add("all-gather", fsdp_axes, full / n_f * per_pass, n_f, n_f - 1)  # operand = own shard, receive n-1
    for axes, b in explicit_rs.items():
        entries[("reduce-scatter", axes)]["explicit_bytes"] = b
    out = {f"{k}@{a}": v for (k, a), v in entries.items()}
    out.update(local_sgd(tr, abstract_state, out))
    if mesh.shape["model"] > 1:
        out["all-reduce@model"] = tensor_parallel_theory(tr)
    out.update(all_to_all_theory(tr))
    return out


def pipeline_uses(tr) -> tuple[float, set[str]]:
    """-> (times per pass a pipeline device runs each of its layer-stack weights, the batch axes
    its weights are replicated over inside the pipeline). Every tick runs one of the stage's R layer
    chunks, bubble ticks included, so each chunk runs (R*M + P-1) / R times and its weights are
    gathered over FSDP (and their gradients reduced) as often, unless the pipeline gathers them
    once (--pipeline.gather_once puts fsdp among the replica axes). (1, all axes) off a pipeline."""
    P = tr.mesh.shape["pipeline"]
    if P == 1:
        return 1.0, set(tr.mesh.axis_names)
    pc = tr.cfg.pipeline
    return pipeline_lib.n_ticks(P, pc.microbatches_for(P), pc.repeats) / pc.repeats, set(pc.replica_axes)


def local_sgd(tr, abstract_state, th: dict) -> dict:
    """--comm.sync_every H > 1 (DiLoCo): the data-parallel all-reduce is the outer sync of the
    parameter drift, in a lax.cond branch taken every H-th step (the compiled HLO holds it once,
    so the HLO shows the bytes of one sync). -> those entries with per-sync bytes kept and
    operand/wire bytes amortised per step (/ H)."""
    h = getattr(getattr(tr.cfg, "comm", None), "sync_every", 1)
    dp = set(data_parallel_axes(tr.mesh, tr.rules["batch"],
                                [x.sharding.spec for x in jax.tree.leaves(abstract_state.params)]))
    if h <= 1 or not dp:
        return {}
    out = {}
    for key, e in th.items():
        kind, _, axes = key.partition("@")
        if kind == "all-reduce" and set(axes.split(",")) <= dp:
            out[key] = {**e, "operand_bytes": e["operand_bytes"] / h, "wire_bytes": e["wire_bytes"] / h,
                        "per_sync_operand_bytes": e["operand_bytes"], "per_sync_wire_bytes": e["wire_bytes"],
                        "sync_every": h, "note": f"DiLoCo outer sync of the parameter drift, every {h} steps"}
    return out


def _tokens_per_device(tr) -> int:
    """Tokens of one micro-batch on one device (the batch split over the batch mesh axes)."""
    t = tr.cfg.train
    return t.batch_size // t.micro_batches // axes_size(tr.mesh, logical_to_spec(("batch",), tr.rules)[0]) * t.seq_len


def tensor_parallel_theory(tr) -> dict:
    """Activation all-reduces over 'model' per device per step, as the compiled step makes them.
    A = [b, T, D] of one micro-batch on one device.

      every layer: the attention output (forward) and the input gradient of the q/k/v projection
        (backward: one einsum when the shards keep each KV group's query heads together, else
        q alone and k/v together, two; models/attention.py); `full` remat recomputes the attention
        output (the layer's last all-reduce feeds only the next layer, so its recompute is dead code)
      dense FFN: its output (forward), the input gradient of the stacked gate/up einsum (backward)
      MoE layer (models/moe.py, experts split over 'model' inside each expert): the psum of the
        partial expert outputs [U, D] (forward); backward: the tokens' gradient [U, D] (marked
        varying over 'model' before dispatch, so summed once, not per matmul over the buffer) and
        the routing weights' [J, U]; shared experts as a dense FFN
      once: the vocab-parallel embedding lookup (forward), the LM head's input gradient and the
        loss's max, sum-exp and target-logit reductions over the vocab ([b, T] float32 each)
    """
    m, mesh, rules, t = tr.model_cfg, tr.mesh, tr.rules, tr.cfg.train
    n_tp = mesh.shape["model"]
    item = jax.numpy.dtype(tr.compute_dtype).itemsize
    n = _tokens_per_device(tr)
    act = n * m.d_model * item
    full = m.remat == "full"
    n_moe = m.n_moe_layers
    qkv = 1 if fused_qkv(m.n_kv_heads, mesh, rules) else 2
    attn, attn_ops = (1 + qkv + full) * act, 2 + full
    ffn, ffn_ops = 2 * act, 2
    b = (m.n_layers - n_moe) * (attn + ffn)
    ops = (m.n_layers - n_moe) * (attn_ops + ffn_ops)
    if n_moe:
        moe, moe_ops = attn, attn_ops
        if m.n_shared_experts:
            moe, moe_ops = moe + ffn, moe_ops + ffn_ops
        if "model" in spec_axes(logical_to_spec(("expert_mlp",), rules)):
            moe += 2 * act + m.experts_per_token * n * item
            moe_ops += 3
        b, ops = b + n_moe * moe, ops + n_moe * moe_ops
    b += 2 * act + 3 * n * 4
    ops += 5
    return {"operand_bytes": float(b * t.micro_batches), "wire_bytes": 2 * (n_tp - 1) / n_tp * b * t.micro_batches,
            "count": ops * t.micro_batches,
            "note": "Megatron TP: per layer the attention output (fwd) and the fused q/k/v input gradient (bwd),"
                    " the FFN output (fwd) and the fused gate/up input gradient (bwd) or the MoE expert psums,"
                    " the attention output again under full remat; + vocab-parallel embedding, LM head and loss"}


def all_to_all_theory(tr: Trainer) -> dict:
    """MoE token exchange per device per step, as models/moe.py sizes its fixed buffers: every
    MoE layer sends its dispatch buffer and gets it back (forward), the backward pass does both
    again, and remat recomputes the forward. Dropless buffers hold tokens x min(k, experts per
    device) rows per destination (the worst case: nothing can overflow), plus the int32 expert id
    of each row; capacity buffers hold `capacity` rows per expert. `ideal_bytes` is what a ragged
    all-to-all (GPU/TPU) would move at a perfectly even load: the k rows of each token, which is
    what the ragged exchange (models.moe.exchange_for) moves."""
    m, mesh, rules, t = tr.model_cfg, tr.mesh, tr.rules, tr.cfg.train
    ep = axes_size(mesh, logical_to_spec(("experts",), rules)[0])
    if not m.n_experts or ep <= 1:
        return {}
    k, x_count = m.experts_per_token, m.n_experts // ep
    n = _tokens_per_device(tr)
    item = jax.numpy.dtype(tr.compute_dtype).itemsize
    exchange = exchange_for(m) if m.dispatch == "dropless" else "fixed"
    if m.dispatch == "capacity":
        rows, id_bytes = m.n_experts * max(1, math.ceil(m.capacity_factor * n * k / m.n_experts)), 0
    elif exchange == "ragged":
        # ragged_all_to_all moves only the real rows (n k per direction at any load) and no ids;
        # the HLO operands only bound that (the receive buffer keeps its worst-case size)
        rows, id_bytes = n * k, 0
    elif exchange == "emulated":
        # the CPU test path: every (destination, expert) slice travels at full length, E n k rows
        # out and E ep n min(k, X) back (averaged over the two directions), plus E int32 offsets
        rows, id_bytes = m.n_experts * (n * k + ep * n * min(k, x_count)) // 2, m.n_experts * 4
    else:
        rows = ep * n * min(k, x_count)
        id_bytes = rows * 4
    passes = 3 if m.remat != "none" else 2   # forward, backward (+ the remat recompute)
    id_passes = 2 if m.remat != "none" else 1  # ids have no backward
    per_layer = 2 * passes * rows * m.d_model * item + id_passes * id_bytes
    total = per_layer * m.n_moe_layers * t.micro_batches
    ideal = 2 * passes * n * k * m.d_model * item * m.n_moe_layers * t.micro_batches
    axes = ",".join(a for a in mesh.axis_names if a in spec_axes(logical_to_spec(("experts",), rules)))
    kind = "ragged-all-to-all" if exchange == "ragged" else "all-to-all"
    return {f"{kind}@{axes}": {"operand_bytes": float(total), "wire_bytes": (ep - 1) / ep * total,
                               "ideal_bytes": float(ideal),
                               "note": f"{m.dispatch} MoE, {exchange} exchange: {rows} rows of d_model per layer"
                                       f" and direction; a ragged all-to-all moves {n * k}"}}


def on_backend(th: dict, platform: str, mesh) -> dict:
    """Theory as this backend lowers it: XLA:CPU turns each reduce-scatter the partitioner makes
    into an all-reduce of the full operand plus a dynamic-slice (seen in its HLO); explicit
    `lax.psum_scatter`s (the MoE expert weights' FSDP gradients) stay reduce-scatters."""
    if platform != "cpu":
        return th
    out = {k: dict(v) for k, v in th.items() if not k.startswith("reduce-scatter@")}
    for k, v in th.items():
        if k.startswith("reduce-scatter@"):
            axes = k.partition("@")[2]
            n = math.prod(mesh.shape[a] for a in axes.split(","))
            explicit = v.get("explicit_bytes", 0.0)
            if explicit:
                out[k] = {"operand_bytes": explicit, "wire_bytes": (n - 1) / n * explicit,
                          "note": "lax.psum_scatter inside shard_map (MoE expert weights): a real reduce-scatter"}
            if v["operand_bytes"] - explicit <= 0:
                continue
            e = out.setdefault(f"all-reduce@{axes}", {"operand_bytes": 0.0, "wire_bytes": 0.0})
            e["operand_bytes"] += v["operand_bytes"] - explicit
            e["wire_bytes"] += 2 * (n - 1) / n * (v["operand_bytes"] - explicit)
    return out


def backend_notes(platform: str, th: dict, measured: dict) -> list[str]:
    notes = []
    rs = sum(v["operand_bytes"] - v.get("explicit_bytes", 0.0) for k, v in th.items() if k.startswith("reduce-scatter"))
    if rs and platform == "cpu":
        notes.append(f"the {platform} backend chose all-reduce + dynamic-slice instead of reduce-scatter"
                     f" ({rs / 2**20:.1f} MiB ideal); GPU/TPU emit reduce-scatter, halving that traffic")
    return notes


def memory_traffic(tr: Trainer, report: dict) -> dict:
    """Bytes each device reads and writes per step, from XLA's cost analysis ("bytes accessed":
    operands and results of every top-level op after fusion), for the roofline's memory term.

    The cost analysis counts a while loop's body once, so a lax.scan over layers shows one layer;
    with scan_layers the step is compiled once more, unrolled, for its count (other loops, such
    as the MoE block scan, stay counted once)."""
    cost = {"bytes accessed": report["bytes_accessed_per_device_compiled"],
            "flops": report["flops_per_step_per_device_compiled"]}
    source = "the compiled step"
    if tr.model_cfg.scan_layers and tr.model_cfg.n_layers > 1:
        cfg = dataclasses.replace(tr.cfg, model=dataclasses.replace(tr.cfg.model, scan_layers=False))
        unrolled = Trainer(cfg)
        cost = unrolled.compile_step(unrolled.abstract_state(), unrolled.abstract_batch()).cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        source = "the step compiled once more with the layer scan unrolled"
    return {"bytes_accessed": float((cost or {}).get("bytes accessed", 0.0)),
            "flops": float((cost or {}).get("flops", 0.0)), "source": source}


def analyze(tr: Trainer) -> dict:
    """Compile the step for `tr`'s config and return the full report as a dict."""
    cfg, t = tr.cfg, tr.cfg.train
    abstract_state = tr.abstract_state()
    batch = tr.abstract_batch()
    compiled = tr.compile_step(abstract_state, batch)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    measured = summarize(parse_collectives(hlo, tr.mesh))
    th = theory(tr, abstract_state)
    th_backend = on_backend(th, jax.default_backend(), tr.mesh)
    params_b = sum(_local_bytes(x) for x in jax.tree.leaves(abstract_state.params))
    opt_b = sum(_local_bytes(x) for x in jax.tree.leaves(abstract_state.opt_state))
    model_flops = flops_per_token(tr.model_cfg, t.seq_len) * t.batch_size * t.seq_len
    return {
        "mesh": mesh_text(tr.mesh.shape), "devices": tr.mesh.size, "backend": jax.default_backend(),
        "params": param_count(tr.model_cfg),
        "active_params": active_param_count(tr.model_cfg),
        "memory": {
            "params_bytes": params_b, "optimizer_bytes": opt_b, "gradient_bytes": params_b,
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "peak_bytes": getattr(mem, "peak_memory_in_bytes", 0),
        },
        "flops_per_step": model_flops,
        "flops_per_step_per_device_compiled": float(cost.get("flops", 0.0)) if cost else 0.0,
        "bytes_accessed_per_device_compiled": float(cost.get("bytes accessed", 0.0)) if cost else 0.0,
        "sync_every": getattr(cfg.comm, "sync_every", 1),
        # kind -> operand bytes per device per step (all mesh axes together), then the details
        "collectives": {k: measured[k]["operand_bytes"] for k in KINDS},
        "collectives_detail": {k: {kk: measured[k][kk] for kk in ("count", "operand_bytes", "wire_bytes", "async")}
                               | {"by_axes": measured[k]["by_axes"]} for k in KINDS},
        "theory": _by_kind(th),
        "theory_on_backend": _by_kind(th_backend),
        "theory_detail": th,
        "theory_on_backend_detail": th_backend,
        "notes": backend_notes(jax.default_backend(), th, measured),
        "sharding": sharding_table(abstract_state.params),
    } | ({"pipeline": pipeline_report(tr, measured)} if tr.mesh.shape["pipeline"] > 1 else {})


def pipeline_report(tr: Trainer, measured: dict) -> dict:
    """The schedule, its bubble and the stage-to-stage traffic: collective-permutes over 'pipeline'
    in the compiled HLO next to models.pipeline's count (one micro-batch per tick and direction)."""
    m, t, pc, P = tr.model_cfg, tr.cfg.train, tr.cfg.pipeline, tr.mesh.shape["pipeline"]
    M_, R = pc.microbatches_for(P), pc.repeats
    n_groups = m.n_layers // (m.moe_every if m.n_experts else 1)
    shards = axes_size(tr.mesh, logical_to_spec(("batch",), tr.rules)[0])
    th = pipeline_lib.permute_bytes_theory(batch=t.batch_size // t.micro_batches, seq=t.seq_len, d_model=m.d_model,
                                 itemsize=jax.numpy.dtype(tr.compute_dtype).itemsize, stages=P, microbatches=M_,
                                 repeats=R, batch_shards=shards)
    hlo = measured["collective-permute"]["by_axes"].get("pipeline", {"operand_bytes": 0})["operand_bytes"]
    return {"stages": P, "microbatches": M_, "repeats": R, "schedule": pc.schedule, "batch_shards": shards,
            "bubble": pipeline_lib.bubble_fraction(P, M_, R), "permute_bytes_hlo": hlo,
            "permute_bytes_theory": th["sent"] * t.micro_batches,
            "permute_bytes_useful": th["useful"] * t.micro_batches,
            "chart": pipeline_lib.schedule_chart(P, M_, R, pc.schedule, n_layers=n_groups)}


def _by_kind(detail: dict) -> dict:
    out = {k: 0.0 for k in KINDS}
    for key, v in detail.items():
        out[key.partition("@")[0]] += v["operand_bytes"]
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:10.2f} MiB"


def render(r: dict, show_sharding: bool) -> str:
    m = r["memory"]
    active = f" ({r['active_params'] / 1e6:.2f}M active per token)" if r["active_params"] != r["params"] else ""
    lines = [f"plan: {r['params'] / 1e6:.2f}M params{active} on {r['devices']} {r['backend']} devices,"
             f" mesh {r['mesh']}",
             "memory per device:"]
    for k in ("params_bytes", "optimizer_bytes", "gradient_bytes", "argument_bytes", "output_bytes", "temp_bytes",
              "peak_bytes"):
        lines.append(f"  {k[:-6]:<12}{_mib(m[k])}")
    lines.append(f"model FLOPs per step: {r['flops_per_step']:.3e} (compiler, per device:"
                 f" {r['flops_per_step_per_device_compiled']:.3e})")
    lines.append("collectives per step, per device (measured from the compiled HLO | theory as this backend lowers it):")
    for kind in KINDS:
        c = r["collectives_detail"][kind]
        if not c["count"]:
            continue
        for axes, v in sorted(c["by_axes"].items()):
            th = r["theory_on_backend_detail"].get(f"{kind}@{axes}")
            ref = f"| theory {_mib(th['operand_bytes'])}" if th else ""
            if th and "sync_every" in th:  # the HLO holds the lax.cond branch once: one sync's bytes
                ref = (f"| theory {_mib(th['per_sync_operand_bytes'])} per sync; every {th['sync_every']} steps:"
                       f" {_mib(th['operand_bytes']).strip()} per step")
            lines.append(f"  {kind:<19}{axes or '-':<18} x{v['count']:<5}{_mib(v['operand_bytes'])} operand,"
                         f" {_mib(v['wire_bytes'])} on the wire {ref}")
    for key, th in sorted(r["theory_on_backend_detail"].items()):
        kind, _, axes = key.partition("@")
        if axes not in r["collectives_detail"][kind]["by_axes"]:
            lines.append(f"  {kind:<19}{axes:<18} (not emitted)      | theory {_mib(th['operand_bytes'])}")
    lines += [f"note: {n}" for n in r["notes"]]
    if "pipeline" in r:
        pp = r["pipeline"]
        lines += [pp["chart"],
                  f"pipeline: stage-to-stage collective-permute per device per step: HLO"
                  f" {_mib(pp['permute_bytes_hlo']).strip()} vs theory {_mib(pp['permute_bytes_theory']).strip()}"
                  f" (of which useful, without bubble ticks: {_mib(pp['permute_bytes_useful']).strip()})"]
    if show_sharding:
        lines.append(f"{'parameter':<34}{'shape':<22}{'spec':<40}{'per device':<20}{'bytes':>12}")
        for row in r["sharding"]:
            lines.append(f"{row['name']:<34}{str(tuple(row['shape'])):<22}{row['spec']:<40}"
                         f"{str(tuple(row['local_shape'])):<20}{row['local_bytes']:>12,}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = make_parser("python -m train plan", "Compile the train step ahead of time and report memory,"
                         " FLOPs and collectives per device, without training.")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--show-sharding", action="store_true", help="per-parameter sharding table")
    parser.add_argument("--plot", metavar="PATH", default="",
                        help="with --mesh pipeline=P > 1: draw the pipeline schedule to PATH (PNG, needs matplotlib)")
    search.add_args(parser)
    ns = parser.parse_args(argv)
    cfg = build({k: v for k, v in vars(ns).items() if "." in k}, getattr(ns, "config", None))
    if ns.search or ns.devices:  # formulas only: the target device count need not exist here
        report, text = search.analytic(ns, cfg)
        print(json.dumps(report) if ns.json else text)
        return 0
    trainer = Trainer(cfg)
    if ns.plot:
        P = trainer.mesh.shape["pipeline"]
        if P == 1:
            raise UserError("--plot draws the pipeline schedule: it needs --mesh pipeline=P with P > 1")
        pc = cfg.pipeline
        pipeline_lib.plot_schedule(P, pc.microbatches_for(P), pc.repeats, pc.schedule, path=ns.plot)
    report = analyze(trainer)
    if ns.hardware and hardware.platform_of(ns.hardware) == report["backend"]:
        # the compile's bytes price only its own backend (train/cost.py from_plan): no second compile else
        report["memory_traffic"] = memory_traffic(trainer, report)
    cost_text = search.with_cost(report, ns, cfg, trainer.mesh) if ns.hardware else ""
    if ns.json:
        if not ns.show_sharding:
            report.pop("sharding")
        print(json.dumps(report))
    else:
        print("\n".join(x for x in (render(report, ns.show_sharding), cost_text) if x))
    return 0
