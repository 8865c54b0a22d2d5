"""`plan --search N`: every mesh of N devices that the model allows, its predicted per-device
memory and communication, ranked by predicted step time. Analytic: nothing is compiled, so
N = 4096 takes seconds on a laptop.

The collective bytes come from `plan.theory.theory` (the same ring formulas `plan` checks against
the compiled HLO), evaluated on an AbstractMesh of the candidate's shape; what a mesh accepts comes
from `validate_run`, the checks a real run makes before compiling (the rules table's divisibility,
the batch split, the pipeline schedule).
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
from models.blockwise import BLOCK_K
from models.config import LOSS_CHUNK, LOSS_CHUNK_FROM, PipelineConfig
from models.pipeline import EXPLICIT, TIMETABLES, bubble_counted, schedule_bubble, timetable
from plan import cost
from plan.hardware import Hardware
from plan.theory import RunSpec, abstract_mesh, rows_per_shard, theory
from train.core import optim
from train.core.config import CommConfig, TrainConfig
from train.core.shapes import batch_shards, seq_shards, validate_batch, validate_run


def factorizations(n: int, n_axes: int = len(AXES)) -> list[tuple[int, ...]]:
    """All ordered tuples of n_axes positive ints whose product is n."""
    if n_axes == 1:
        return [(n,)]
    return [
        (d, *rest)
        for d in range(1, n + 1)
        if n % d == 0
        for rest in factorizations(n // d, n_axes - 1)
    ]


@functools.lru_cache(maxsize=16)
def _model_arrays(cfg) -> tuple[dict, dict]:
    return model_lib.abstract_params(cfg), model_lib.param_axes(cfg)


@functools.lru_cache(maxsize=4)
def _optimizer_ratio(cfg, train_cfg: TrainConfig) -> float:
    """Optimizer-state bytes per parameter byte (AdamW: 2, plus scalars), from the real optimizer."""
    params = _model_arrays(cfg)[0]
    opt = jax.eval_shape(optim.make(train_cfg).init, params)
    nbytes = lambda t: sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(t))
    return nbytes(opt) / nbytes(params)


def _stage_cfg(cfg, p: int):
    """The layers one pipeline stage holds (embedding and head counted on every stage: conservative)."""
    return cfg if p == 1 else dataclasses.replace(cfg, n_layers=cfg.n_layers // p)


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


def pipeline_choices(
    cfg, sizes: dict[str, int], train_cfg: TrainConfig, pipeline_cfg: PipelineConfig, rules
) -> list[PipelineConfig]:
    """The pipeline settings to price on this mesh: the run's own; with pipeline > 1 and
    --pipeline.microbatches unset (0), every micro-batch count the run would accept (validate_batch
    decides; only divisors of the rows per batch shard can split them evenly), so that the search
    can report the count that makes its best time."""
    p = sizes["pipeline"]
    if p == 1 or pipeline_cfg.microbatches:
        return [pipeline_cfg]
    mesh, t = abstract_mesh(sizes), train_cfg
    rows = rows_per_shard(t.batch_size, t.micro_batches, batch_shards(mesh, rules))
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


def schedule_choices(
    cfg, sizes: dict[str, int], train_cfg: TrainConfig, pipeline_cfg: PipelineConfig, rules
) -> list[PipelineConfig]:
    """`pipeline_cfg` under every other schedule the run accepts at its micro-batch count: those
    that run each stage's layers once (gpipe, 1f1b, zb_h1), then those with chunks (circular and
    interleaved_1f1b) at 2 and 4 chunks per device where the layers divide, in the order of
    models/pipeline/timetables.py. Their bubbles and activation memory differ, the rest of the step
    does not."""
    out = []
    once = [(t.name, 1) for t in TIMETABLES.values() if not t.chunked]
    chunked = [(t.name, r) for t in TIMETABLES.values() if t.chunked for r in (2, 4)]
    for schedule, repeats in once + chunked:
        pc = dataclasses.replace(pipeline_cfg, schedule=schedule, repeats=repeats)
        if pc != pipeline_cfg and not check(cfg, sizes, train_cfg, pc, rules):
            out.append(pc)
    return out


def _quick_reject(cfg, sizes: dict[str, int], batch_size: int, rules) -> bool:
    """Cheap integer tests that prune most of the factorisations before check(): necessary
    conditions under the default rules (heads, d_ff and vocab by model, d_model by fsdp)."""
    mdl = sizes["model"]
    return bool(
        cfg.n_heads % mdl
        or cfg.n_kv_heads % mdl
        or cfg.d_ff % mdl
        or cfg.vocab_size % mdl
        or cfg.d_model % sizes["fsdp"]
        or cfg.n_layers % sizes["pipeline"]
        or batch_size % batch_shards(abstract_mesh(sizes), rules)
    )


def activation_bytes(
    cfg,
    sizes: dict[str, int],
    batch_size: int,
    seq_len: int,
    micro_batches: int,
    act_bytes: int,
    attention: str,
    *,
    shards: int,
    seq_shards: int = 1,
    sequence_parallel: bool = False,
    pipeline_microbatches: int = 1,
    schedule: str = "gpipe",
    repeats: int = 1,
) -> tuple[float, float]:
    """Per-device activation memory estimate for the remat policy: (device bytes, host bytes; the
    saved set of an offloading policy, dots_offload, is in host memory between the passes).

    Per token and layer the forward pass makes: 4 [D] (input, two norm outputs, residual), q/k/v
    before and after rotary, the attention output, two [D] projections, 4 [F] (gate, up, silu,
    product) with the head and F dims split by `model`; plus, by `attention` (the kind the run
    picks, models.config.attention_kind): dense, [N,T] scores and probabilities; blockwise, one key
    block's scores, probabilities and their gradients ([N,512] x 4, float32); cuDNN or JAX's
    choice on GPU, none (fused flash attention). With the sequence split over `seq_shards`
    (context parallelism) a device holds T/seq_shards tokens and, while a layer runs, the K/V of
    the others (all-gathered, or a ring's blocks kept for the backward); `sequence_parallel` splits
    the residual stream's [D] terms (input, norms, residual, the projections' reduced outputs) by `model`. `full` remat keeps only
    each layer's input, `dots` the matmul outputs; the backward pass of one layer needs its full
    set once more; the LM head's float32 logits, softmax and gradient ([T,V/model] each) come on
    top, or one chunk's where the loss is chunked (train.core.batch_loss.loss_chunk's rule). One forward
    pass holds batch / micro_batches rows split over `shards` (the rules' batch axes); gradient
    accumulation keeps one pass. A pipeline cuts the pass into `pipeline_microbatches` and, with
    `schedule` gpipe or circular, keeps every one's saved activations until its backward pass, so
    the saved set is still the whole pass's while a layer's backward works on one micro-batch; the
    LM head runs after the pipeline, on the whole pass. zb_h1 also keeps, for up to P micro-batches,
    what its deferred weight gradients read (each projection's input and output gradient, the norms'
    input and gradient). 1f1b and interleaved_1f1b keep only the
    stage inputs of the micro-batches in flight (the ring of the timetable's ring_slots, one [D]
    per token each), recompute one chunk's layers per backward (one micro-batch's saved set of
    L/(P x repeats) layers) and run the head per micro-batch."""
    tp, p = sizes["model"], sizes["pipeline"]
    d, f, n, k, h, v = (
        cfg.d_model,
        cfg.d_ff,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
    )
    rows = rows_per_shard(batch_size, micro_batches, shards)
    pass_tokens = rows * seq_len // seq_shards
    tokens = pass_tokens // (pipeline_microbatches if p > 1 else 1)
    res = d / tp if sequence_parallel else d  # one [D] of the residual stream
    every = 4 * res + (2 * n * h + 4 * k * h + n * h) / tp + 2 * res + 4 * f / tp
    every += (seq_shards - 1) * 2 * k * h / tp  # the other shards' K/V, in the layer under way
    scores = {
        "dense": 2 * n / tp * seq_len,
        "blockwise": 4 * 4 / act_bytes * n / tp * min(BLOCK_K, seq_len),
    }
    every += scores.get(attention, 0.0)
    dots = res + (n * h + 2 * k * h) / tp + 2 * res + 2 * f / tp
    saved = {"none": every, "dots": dots, "dots_offload": dots, "full": res}[cfg.remat]
    layers = cfg.n_layers // p
    head_tokens = pass_tokens
    kept = 0
    tt = timetable(schedule)
    if p > 1 and schedule in EXPLICIT:
        kept = tt.ring_slots(p, pipeline_microbatches, repeats) * res * tokens
        if tt.splits_backward:
            # the W inputs of w_slots micro-batches: each projection's input and output gradient,
            # the norms' (the split's, counted)
            w_in = 8 * res + (2 * n * h + 2 * k * h + 4 * f) / tp
            kept += tt.w_slots(p, pipeline_microbatches) * w_in * layers * tokens
        held = kept + saved * (layers // repeats) * tokens
        head_tokens = tokens
    else:
        held = saved * layers * pass_tokens
    chunk = cfg.loss_chunk or (LOSS_CHUNK if 4 * head_tokens * v / tp > LOSS_CHUNK_FROM else 0)
    if chunk:
        head_tokens = min(head_tokens, rows * chunk)
    device = act_bytes * every * tokens + 3 * 4 * head_tokens * v / tp
    if cfg.remat.endswith(
        "_offload"
    ):  # the saved set lives in host memory; a pipeline's ring does not
        return device + act_bytes * kept, act_bytes * (held - kept)
    return device + act_bytes * held, 0.0


def attention_on(cfg, hw: Hardware, seq_len: int) -> str:
    """The attention a run of `cfg` does on this hardware: its own choice (attention_kind), where
    the hardware has no fused flash attention the JAX choice is XLA's dense one."""
    kind = cfg.attention if cfg.attention != "auto" else cfg.attention_kind(hw.platform, seq_len)
    return "dense" if kind == "jax" and not hw.fused_attention else kind


def _train(
    train_cfg: TrainConfig | None, batch_size: int, seq_len: int, micro_batches: int
) -> TrainConfig:
    return dataclasses.replace(
        train_cfg or TrainConfig(),
        batch_size=batch_size,
        seq_len=seq_len,
        micro_batches=micro_batches,
    )


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
) -> dict:
    """Predicted memory, communication and step time of one mesh (sizes over all of AXES).
    micro_batches: gradient accumulation (--micro-batches); pipeline_cfg: the schedule a pipeline
    mesh runs (--pipeline.*: its micro-batch count, repeats and schedule set the bubble).
    comm_cfg: the run's --comm settings (DiLoCo's sync_every amortises the data-parallel sync).
    vocab_parallel: --parallelism.vocab_parallel, the LM head's layout on this mesh (head_layout)."""
    sizes = {a: sizes.get(a, 1) for a in AXES}
    pc = pipeline_cfg or PipelineConfig()
    platform = platform or hw.platform
    dtype = cfg.compute_dtype(platform)
    act_bytes = np.dtype(dtype).itemsize
    rules = rules or make_rules()
    rules = head_layout(
        sequence_parallel_rules(rules) if sequence_parallel else rules,
        vocab_parallel,
        sizes,
        vocab=cfg.vocab_size,
        batch_tokens=batch_size // micro_batches * seq_len,
        act_bytes=act_bytes,
        param_bytes=np.dtype(cfg.param_dtype).itemsize,
    )
    t = _train(train_cfg, batch_size, seq_len, micro_batches)
    why = check(cfg, sizes, t, pc, rules)
    if why:
        raise UserError(f"mesh {mesh_text(sizes)}: {why}")
    p = sizes["pipeline"]
    stage = _stage_cfg(cfg, p)
    mesh = abstract_mesh(sizes)
    shards, pipe_m = batch_shards(mesh, rules), pc.microbatches_for(p)
    params_abs, axes = _model_arrays(stage)
    params = jax.tree.map(
        lambda s, names: jax.ShapeDtypeStruct(
            s.shape,
            s.dtype,
            sharding=NamedSharding(mesh, logical_to_spec(names, {**rules, "layers": ()})),
        ),
        params_abs,
        axes,
        is_leaf=is_axis_names,
    )
    param_bytes = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(params)
    )
    run = RunSpec(
        model=stage,
        train=t,
        comm=comm_cfg or CommConfig(),
        pipeline=pc,
        sizes=sizes,
        rules=rules,
        compute_dtype=dtype,
    )
    comm = theory(run, params)  # the ring formulas plan checks against the compiled HLO
    comm.update(
        cost.pipeline_comm(
            cfg,
            sizes,
            batch_size,
            seq_len,
            micro_batches,
            act_bytes,
            pipeline_microbatches=pipe_m,
            repeats=pc.repeats,
            batch_shards=shards,
        )
    )

    on_device, on_host = activation_bytes(
        cfg,
        sizes,
        batch_size,
        seq_len,
        micro_batches,
        act_bytes,
        attention_on(cfg, hw, seq_len),
        shards=shards,
        seq_shards=seq_shards(mesh, rules),
        sequence_parallel=sequence_parallel,
        pipeline_microbatches=pipe_m,
        schedule=pc.schedule,
        repeats=pc.repeats,
    )
    ratio = _optimizer_ratio(cfg, t)
    optimizer = param_bytes * ratio
    host_optimizer = 0.0
    if (
        t.offload_optimizer
    ):  # in host memory; the update holds about one parameter's state at a time
        largest = max(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(params)
        )
        optimizer, host_optimizer = largest * ratio, optimizer
    memory = {
        "params": param_bytes,
        "grads": param_bytes,
        "optimizer": optimizer,
        "activations": on_device,
    }
    memory["total"] = sum(memory.values())  # device memory; what is offloaded to the host is apart
    memory["host_activations"], memory["host_optimizer"] = on_host, host_optimizer
    if (
        on_host or host_optimizer
    ):  # activations out and back; the optimizer state in for the update and out
        moved = 2 * (on_host + host_optimizer)
        comm[cost.HOST_OFFLOAD] = {"operand_bytes": moved, "wire_bytes": moved, "count": 0}
    n = math.prod(sizes.values())
    pred = cost.predict(
        model_flops=cost.model_flops_per_step(cfg, batch_size, seq_len),
        device_flops=cost.hardware_flops_per_step(
            cfg, batch_size, seq_len, pc.schedule if p > 1 else "gpipe"
        )
        / n,
        comm=cost.ragged_all_to_all(comm, platform),
        sizes=sizes,
        hw=hw,
        dtype=dtype,
        pipeline_microbatches=pipe_m,
        repeats=pc.repeats,
        dcn=dcn,
        tokens_per_step=batch_size * seq_len,
        schedule=pc.schedule,
    )
    pipeline = (
        {"microbatches": pipe_m, "repeats": pc.repeats, "schedule": pc.schedule} if p > 1 else {}
    )
    return {
        "mesh": mesh_text(sizes),
        "sizes": sizes,
        "micro_batches": micro_batches,
        "pipeline": pipeline,
        "sequence_parallel": sequence_parallel,
        "memory": memory,
        "fits": memory["total"] <= hw.hbm_bytes * hw.usable_memory,
        "theory": comm,
        **pred,
    }


def _price(
    cfg, sizes, hw, batch_size, seq_len, micro_batches, rules, t, comm_cfg, choice, vocab_parallel
) -> dict | None:
    """evaluate() of one choice (None where the mesh cannot take the run's head layout); sequence
    parallelism moves the same bytes and saves activation memory: worth it where the mesh does not
    fit without it."""
    try:
        row = evaluate(
            cfg,
            sizes,
            hw,
            batch_size,
            seq_len,
            micro_batches,
            rules=rules,
            train_cfg=t,
            comm_cfg=comm_cfg,
            pipeline_cfg=choice,
            vocab_parallel=vocab_parallel,
        )
        if (
            not row["fits"]
            and sizes["model"] > 1
            and not check(cfg, sizes, t, choice, sequence_parallel_rules(rules))
        ):
            row = evaluate(
                cfg,
                sizes,
                hw,
                batch_size,
                seq_len,
                micro_batches,
                rules=rules,
                train_cfg=t,
                comm_cfg=comm_cfg,
                pipeline_cfg=choice,
                vocab_parallel=vocab_parallel,
                sequence_parallel=True,
            )
    except (
        UserError
    ):  # --parallelism.vocab_parallel on, and this mesh does not divide the vocabulary
        return None
    return row


# What the search may add to a mesh that does not fit, cheapest first: the optimizer state in host
# memory (copies once per step), then the saved activations too (copies every layer)
OFFLOADS = (
    {"--train.offload_optimizer": "true"},
    {"--train.offload_optimizer": "true", "--model.remat": "dots_offload"},
)


def _offloaded(
    cfg, sizes, hw, batch_size, seq_len, micro_batches, rules, t, comm_cfg, row, pc, vocab_parallel
) -> dict | None:
    """`row`'s layout priced with each of OFFLOADS until one fits (None if none does); the row's
    `offload` says which flags it took."""
    m, limit = row["memory"], hw.hbm_bytes * hw.usable_memory
    if (
        m["total"] - m["optimizer"] - m["activations"] > limit
    ):  # params and gradients alone do not fit
        return None
    choice = dataclasses.replace(pc, **row["pipeline"]) if row["pipeline"] else pc
    for flags in OFFLOADS:
        c = dataclasses.replace(cfg, remat=flags.get("--model.remat", cfg.remat))
        out = _price(
            c,
            sizes,
            hw,
            batch_size,
            seq_len,
            micro_batches,
            rules,
            dataclasses.replace(t, offload_optimizer=True),
            comm_cfg,
            choice,
            vocab_parallel,
        )
        if out is not None and out["fits"]:
            return {**out, "offload": flags}
    return None


def _better(best: dict | None, row: dict | None) -> dict | None:
    """The faster row of those that fit, else the one that fits."""
    if row is None or (
        best is not None and (best["fits"], -best["t_step_s"]) >= (row["fits"], -row["t_step_s"])
    ):
        return best
    return row


def search(
    cfg,
    n_devices: int,
    hw: Hardware,
    batch_size: int,
    seq_len: int,
    micro_batches: int = 1,
    *,
    rules=None,
    train_cfg: TrainConfig | None = None,
    comm_cfg=None,
    pipeline_cfg: PipelineConfig | None = None,
    vocab_parallel: str = "auto",
) -> list[dict]:
    """Every valid mesh of n_devices, best first: those that fit in memory by predicted step time,
    then those that do not, by memory. Validity is the run's own (validate_run). Pipeline meshes
    price every schedule (gpipe, 1f1b, zb_h1, circular and interleaved_1f1b at 2 and 4 chunks) at the
    run's --pipeline.microbatches, or with it unset at every micro-batch count the run would
    accept, keeping the fastest that fits (the row says which, and its flags)."""
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
        price = lambda choice: _price(
            cfg,
            sizes,
            hw,
            batch_size,
            seq_len,
            micro_batches,
            rules,
            t,
            comm_cfg,
            choice,
            vocab_parallel,
        )
        for choice in pipeline_choices(cfg, sizes, t, pc, rules):
            if not check(cfg, sizes, t, choice, rules):
                best = _better(best, price(choice))
        if best is not None and sizes["pipeline"] > 1:
            # then the other schedules at the count that won: more micro-batches shrink every
            # schedule's bubble and grow no schedule's memory, so the same count wins under each.
            # Only those that can win: where the run's schedule fits, the smaller bubbles of more
            # chunks (circular, else interleaved where circular's memory does not fit); where it does
            # not, the schedules whose memory is bounded (1f1b, zb_h1, interleaved); zb_h1's smaller
            # bubble for its W inputs' memory is priced wherever the run's schedule is bounded or does not fit
            won = dataclasses.replace(
                pc, **{k: best["pipeline"][k] for k in ("microbatches", "repeats", "schedule")}
            )
            others = schedule_choices(cfg, sizes, t, won, rules)
            fits = best["fits"]
            wanted = ("circular",) if fits else ("1f1b",)
            wanted += ("zb_h1",) if not fits or won.schedule in EXPLICIT else ()
            for other in [o for o in others if o.schedule in wanted]:
                best = _better(best, price(other))
            for other in [
                o
                for o in others
                if o.schedule == "interleaved_1f1b"
                and (not fits or not best["fits"] or o.repeats > best["pipeline"]["repeats"])
            ]:
                best = _better(best, price(other))
        if best is not None and not best["fits"]:
            best = _better(
                best,
                _offloaded(
                    cfg,
                    sizes,
                    hw,
                    batch_size,
                    seq_len,
                    micro_batches,
                    rules,
                    t,
                    comm_cfg,
                    best,
                    pc,
                    vocab_parallel,
                ),
            )
        if best is not None:
            rows.append(best)
    # ties (compute-bound meshes whose traffic all hides) go to less traffic, then less memory
    return sorted(
        rows,
        key=lambda r: (
            not r["fits"],
            r["t_step_s"] if r["fits"] else r["memory"]["total"],
            r["t_comm_s"],
            r["memory"]["total"],
        ),
    )


def compare_schedules(
    cfg,
    sizes: dict[str, int],
    hw: Hardware,
    batch_size: int,
    seq_len: int,
    micro_batches: int = 1,
    **kw,
) -> list[dict]:
    """The run's pipeline settings under each schedule the run accepts at its micro-batch count
    (schedule_choices): per device, activations, total memory, fit, predicted step time, and the
    bubble by its formula and counted in the schedule's timetable. `kw`: evaluate's."""
    pc, P = kw.get("pipeline_cfg") or PipelineConfig(), sizes.get("pipeline", 1)
    pc = dataclasses.replace(pc, microbatches=pc.microbatches_for(P))
    rules, t = (
        kw.get("rules") or make_rules(),
        _train(kw.get("train_cfg"), batch_size, seq_len, micro_batches),
    )
    out = []
    for choice in [pc] + schedule_choices(cfg, {a: sizes.get(a, 1) for a in AXES}, t, pc, rules):
        row = evaluate(
            cfg, sizes, hw, batch_size, seq_len, micro_batches, **{**kw, "pipeline_cfg": choice}
        )
        M, R = choice.microbatches, choice.repeats
        out.append(
            {
                "schedule": choice.schedule,
                "repeats": R,
                "microbatches": M,
                "bubble_formula": schedule_bubble(choice.schedule, P, M, R),
                "bubble_counted": bubble_counted(choice.schedule, P, M, R),
                "in_flight": timetable(choice.schedule).in_flight(P, M, R),
                "activations": row["memory"]["activations"],
                "total": row["memory"]["total"],
                "fits": row["fits"],
                "t_step_s": row["t_step_s"],
            }
        )
    return out


def render_schedules(rows: list[dict]) -> str:
    gib = 2**30
    lines = [
        "pipeline schedules at this micro-batch count (per device; in flight: the most micro-batch passes a"
        " device holds between their forward and backward):",
        f"  {'schedule':<22} {'bubble':>7} {'counted':>8} {'in flight':>9} {'activations':>12}"
        f" {'total':>10}  fits  step",
    ]
    for r in rows:
        name = r["schedule"] + (f" x{r['repeats']}" if r["repeats"] > 1 else "")
        lines.append(
            f"  {name:<22} {r['bubble_formula']:>7.1%} {r['bubble_counted']:>8.1%} {r['in_flight']:>9}"
            f" {r['activations'] / gib:>8.2f} GiB {r['total'] / gib:>6.2f} GiB  {'yes' if r['fits'] else 'no ':<4}"
            f"  {r['t_step_s']:.3f} s"
        )
    return "\n".join(lines)
