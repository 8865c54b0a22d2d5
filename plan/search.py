"""`plan --search N`: every mesh of N devices that the model allows, its predicted per-device
memory and communication, ranked by predicted step time. Analytic: nothing is compiled, so
N = 4096 takes seconds on a laptop.

Each mesh is priced by plan.estimate.evaluate: the collective bytes come from `plan.theory.theory`
(the same ring formulas `plan` checks against the compiled HLO), evaluated on an AbstractMesh of
the candidate's shape; what a mesh accepts comes from `validate_run`, the checks a real run makes
before compiling (the rules table's divisibility, the batch split, the pipeline schedule).
"""

from __future__ import annotations

import dataclasses
import functools

from errors import UserError
from mesh.rules import make_rules
from mesh.rules import sequence_parallel as sequence_parallel_rules
from mesh.spec import AXES
from models.config import PipelineConfig
from models.pieces import n_groups_and_tail
from models.pipeline import EXPLICIT
from plan.estimate import check, evaluate, with_batch
from plan.hardware import Hardware
from plan.run_spec import abstract_mesh
from plan.schedules import pipeline_choices, schedule_choices
from train.core.config import TrainConfig
from train.core.shapes import batch_shards


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
        or n_groups_and_tail(cfg)[0] % sizes["pipeline"]  # stages split the groups
        or batch_size % batch_shards(abstract_mesh(sizes), rules)
    )


def _price(
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
    layouts,
    lora_cfg=None,
    post_cfg=None,
) -> dict | None:
    """evaluate() of one choice (None where the mesh cannot take the run's head layout); sequence
    parallelism moves the same bytes and saves activation memory: worth it where the mesh does not
    fit without it. `layouts`: the run's --parallelism.vocab_parallel and experts_over_fsdp."""
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
            **layouts,
            lora_cfg=lora_cfg,
            post_cfg=post_cfg,
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
                **layouts,
                sequence_parallel=True,
                lora_cfg=lora_cfg,
                post_cfg=post_cfg,
            )
    except UserError:
        # --parallelism.vocab_parallel on and the mesh does not divide the vocabulary, or
        # experts_over_fsdp on and it does not divide the experts
        return None
    return row


# What the search may add to a mesh that does not fit, cheapest first: the optimizer state in host
# memory (copies once per step), then the saved activations too (copies every layer)
OFFLOADS = (
    {"--train.offload_optimizer": "true"},
    {"--train.offload_optimizer": "true", "--model.remat": "dots_offload"},
)


def _offloaded(
    cfg,
    sizes,
    hw,
    batch_size,
    seq_len,
    micro_batches,
    rules,
    t,
    comm_cfg,
    row,
    pc,
    layouts,
    lora_cfg=None,
    post_cfg=None,
) -> dict | None:
    """`row`'s layout priced with each of OFFLOADS until one fits (None if none does); the row's
    `offload` says which flags it took."""
    m, limit = row["memory"], hw.hbm_bytes * hw.usable_memory
    if m["total"] - m["optimizer"] - m["activations"] > limit:  # params and gradients alone
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
            layouts,
            lora_cfg,
            post_cfg,
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


def _other_schedules(cfg, sizes, t, pc, rules, best: dict, price) -> dict:
    """`best` (a pipeline mesh's row) against the other schedules at the micro-batch count that
    won: more micro-batches shrink every schedule's bubble and grow no schedule's memory, so the
    same count wins under each. Only those that can win are priced: where the run's schedule fits,
    the smaller bubbles of more chunks (circular, else interleaved where circular's memory does not
    fit); where it does not, the schedules whose memory is bounded (1f1b, zb_h1, interleaved);
    zb_h1's smaller bubble for its W inputs' memory wherever the run's schedule is bounded or does
    not fit. `price`: a PipelineConfig -> its row (or None)."""
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
    return best


def _best_on_mesh(
    cfg,
    sizes: dict[str, int],
    hw: Hardware,
    batch_size: int,
    seq_len: int,
    micro_batches: int,
    rules,
    t: TrainConfig,
    comm_cfg,
    pc: PipelineConfig,
    layouts: dict,
    lora_cfg=None,
    post_cfg=None,
) -> dict | None:
    """The best row of one mesh (None where the run refuses every setting): the fastest pipeline
    setting the run accepts, every other schedule tried on a pipeline mesh, and, where the best
    does not fit, the same with state offloaded to the host."""
    best = None
    # this mesh's row under one pipeline setting (the arguments bound now, per mesh)
    price = functools.partial(
        _price,
        cfg,
        sizes,
        hw,
        batch_size,
        seq_len,
        micro_batches,
        rules,
        t,
        comm_cfg,
        layouts=layouts,
        lora_cfg=lora_cfg,
        post_cfg=post_cfg,
    )
    for choice in pipeline_choices(cfg, sizes, t, pc, rules):
        if not check(cfg, sizes, t, choice, rules):
            best = _better(best, price(choice))
    if best is not None and sizes["pipeline"] > 1:
        best = _other_schedules(cfg, sizes, t, pc, rules, best, price)
    if best is not None and not best["fits"]:
        offloaded = _offloaded(
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
            layouts,
            lora_cfg,
            post_cfg,
        )
        best = _better(best, offloaded)
    return best


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
    lora_cfg=None,
    post_cfg=None,
    experts_over_fsdp: str = "auto",
) -> list[dict]:
    """Every valid mesh of n_devices, best first: those that fit in memory by predicted step time,
    then those that do not, by memory. Validity is the run's own (validate_run). Pipeline meshes
    price every schedule (gpipe, 1f1b, zb_h1, circular and interleaved_1f1b at 2 and 4 chunks) at
    the run's --pipeline.microbatches, or with it unset at every micro-batch count the run would
    accept, keeping the fastest that fits (the row says which, and its flags). `lora_cfg`: a LoRA
    or QLoRA run's (plan/lora_memory.py); `post_cfg`: --post (grpo: the rollout's memory counts);
    `vocab_parallel`, `experts_over_fsdp`: the run's layouts."""
    layouts = {"vocab_parallel": vocab_parallel, "experts_over_fsdp": experts_over_fsdp}
    rules = rules or make_rules()
    pc = pipeline_cfg or PipelineConfig()
    t = with_batch(train_cfg, batch_size, seq_len, micro_batches)
    default_rules = rules == make_rules()
    rows = []
    for shape in factorizations(n_devices):
        sizes = dict(zip(AXES, shape))
        if default_rules and _quick_reject(cfg, sizes, batch_size, rules):
            continue
        best = _best_on_mesh(
            cfg,
            sizes,
            hw,
            batch_size,
            seq_len,
            micro_batches,
            rules,
            t,
            comm_cfg,
            pc,
            layouts,
            lora_cfg,
            post_cfg,
        )
        if best is not None:
            rows.append(best)
    return sorted(rows, key=_rank)


def _rank(row: dict) -> tuple:
    """The search's order: the meshes that fit by step time, then the rest by memory; ties
    (compute-bound meshes whose traffic all hides) go to less traffic, then less memory."""
    total = row["memory"]["total"]
    return (not row["fits"], row["t_step_s"] if row["fits"] else total, row["t_comm_s"], total)
