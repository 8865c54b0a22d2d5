"""The collective traffic a train step should make, from the ring and Megatron formulas.

Per device per step, keyed "kind@axes" ("all-gather@fsdp"): operand bytes and bytes on the wire
(ring conventions: all-reduce 2(n-1)/n x bytes; all-gather and reduce-scatter (n-1)/n x bytes).
`plan` puts these next to the collectives of the compiled step (plan/report.py), and the mesh
search (plan/search.py) prices meshes with them without compiling anything. Every formula reads a
`RunSpec` (plan/run_spec.py): the run's model, train, comm and pipeline configs, the mesh's axis
sizes, the logical-axis rules and the compute dtype. This module counts the weights' traffic
(data parallelism, FSDP, DiLoCo's sync) and sums in the activations' (plan/activation_theory.py).
"""

from __future__ import annotations

import math
from collections import defaultdict

import jax

from mesh.rules import logical_to_spec
from mesh.shard import data_parallel_axes, path_names, spec_axes
from models import model as model_lib
from models import pipeline as pipeline_lib
from models.config import PipelineConfig
from plan.activation_theory import (
    all_to_all_theory,
    context_theory,
    tensor_parallel_theory,
    vocab_parallel_theory,
)
from plan.run_spec import RunSpec, axes_key, local_bytes, tokens_per_device, vocab_parallel_axes
from train.core import lora


def _param_collectives(
    run: RunSpec,
    path: str,
    sds,
    name: tuple,
    batch_axes: list[str],
    expert_axes,
    vocab_axes,
    uses: float,
    replicas: set[str],
    trains: bool = True,
):
    """The collectives one parameter's weights and gradient make per step (see `theory`), in the
    order they add up: (kind, mesh axes, operand bytes, group size, wire factor, whether it is
    an explicit psum_scatter). `name`: the parameter's logical axis names; `trains` False: a
    frozen weight (a LoRA base), gathered for the forward (and the remat) but never reduced, its
    embedding lookup exchanged in the forward only."""
    sizes, t, m = run.sizes, run.train, run.model
    used = spec_axes(sds.sharding.spec)
    # an expert's weights live on the devices its tokens travel to: no collective over the
    # expert axes (the tokens move by all-to-all instead, below)
    is_expert = "experts" in name
    own = [a for a in batch_axes if not (is_expert and a in expert_axes)]
    # a vocab-parallel head's weights never move: its input does (vocab_parallel_theory)
    fsdp_axes = [a for a in own if a in used and not ("vocab" in name and a in vocab_axes)]
    dp_axes = [a for a in own if a not in used]
    n_f = math.prod(sizes[a] for a in fsdp_axes)
    n_d = math.prod(sizes[a] for a in dp_axes)
    # the gradient's bytes before the fsdp split (after tensor parallel)
    full = local_bytes(sds) * n_f
    in_stack = path.startswith(("blocks/", "moe_blocks/"))
    per_pass = uses if in_stack and not set(fsdp_axes) <= replicas else 1
    lookup = _lookup_bytes(run, path, sds, n_f) * (1 if trains else 0.5)
    yield "all-to-all", fsdp_axes, lookup, n_f, (n_f - 1) / n_f, False
    # ZeRO-3 reduce-scatters every micro-batch's gradient
    for _ in range(0 if lookup or not trains else t.micro_batches):
        explicit = is_expert and n_f > 1
        yield "reduce-scatter", fsdp_axes, full * per_pass, n_f, (n_f - 1) / n_f, explicit
    # once per step (no_sync)
    yield "all-reduce", dp_axes, full / n_f if trains else 0, n_d, 2 * (n_d - 1) / n_d, False
    # FSDP gathers weights for the forward pass; rematerialised layers gather them again for
    # the backward recompute (ZeRO-3); weights outside the layer stack stay gathered. Per
    # micro-batch; the operand is the device's own shard, and it receives n-1 of them.
    gathers = 0 if lookup else 2 if in_stack and m.remat != "none" else 1
    for _ in range(gathers * t.micro_batches):
        yield "all-gather", fsdp_axes, full / n_f * per_pass, n_f, n_f - 1, False


def _add_activation_theory(out: dict, run: RunSpec) -> None:
    """Add to `out` what moves activations rather than weights: the vocab-parallel head's input,
    context parallelism's K/V and the MoE's token exchange."""
    for key, e in (
        *vocab_parallel_theory(run).items(),
        *context_theory(run).items(),
        *all_to_all_theory(run).items(),
    ):
        mine = out.setdefault(key, {"operand_bytes": 0.0, "wire_bytes": 0.0})
        if "ideal_bytes" in e:  # what moves besides the MoE exchange moves in the ideal too
            mine["ideal_bytes"] = mine["operand_bytes"] + e["ideal_bytes"]
        mine["operand_bytes"] += e["operand_bytes"]
        mine["wire_bytes"] += e["wire_bytes"]
        if "note" in e:
            mine["note"] = "; ".join(filter(None, (mine.get("note"), e["note"])))


def theory(run: RunSpec, params, frozen=None) -> dict:
    """Ideal per-device collective bytes per step. `params`: the abstract parameters with their
    shardings (ShapeDtypeStructs; the model's, or one pipeline stage's). `frozen`: a LoRA run's
    base, as it moves (a quantised one: the weights it stands for at the compute dtype, which is
    what XLA gathers), with `params` the adapters: the base is gathered as a full fine-tune's
    weights and never reduced, and only the adapters' gradients are (each layer multiplies by
    them factored, x W + s (x A) B, models/adapters.py).

    For each parameter: the batch mesh axes it is *not* sharded on carry plain data parallelism
    (all-reduce of its gradient shard: 2(n-1)/n x M); the batch axes it *is* sharded on carry
    ZeRO-3/FSDP (all-gather of the weights in forward and again in backward, and a reduce-scatter
    of the gradient, per micro-batch: (n-1)/n x M each). On a pipeline mesh the layer stack's FSDP
    traffic repeats on every tick (pipeline_uses).
    """
    sizes, rules = run.sizes, run.rules
    # the axes that split the tokens: the batch's and the sequence's (context parallelism); over
    # those a weight is either sharded (FSDP traffic) or replicated (a data-parallel all-reduce)
    batch_axes = [a for a in spec_axes(logical_to_spec(("batch", "seq"), rules)) if sizes[a] > 1]
    entries: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"operand_bytes": 0.0, "wire_bytes": 0.0}
    )

    def add(kind, axes, operand, n, wire_factor):
        if n <= 1 or operand == 0:
            return
        e = entries[(kind, axes_key(axes))]
        e["operand_bytes"] += operand
        e["wire_bytes"] += wire_factor * operand

    names = _names(run, frozen is not None)
    expert_axes = spec_axes(logical_to_spec(("experts",), rules))
    vocab_axes = vocab_parallel_axes(run)
    explicit_rs: dict[str, float] = defaultdict(float)
    uses, replicas = pipeline_uses(sizes, run.pipeline)
    arrays = [(p, a, True) for p, a in path_names(params, is_leaf=lambda x: hasattr(x, "shape"))]
    if frozen is not None:
        arrays += [
            (p, a, False) for p, a in path_names(frozen, is_leaf=lambda x: hasattr(x, "shape"))
        ]
    for path, sds, trains in arrays:
        for kind, axes, operand, n, wire_factor, explicit in _param_collectives(
            run, path, sds, names[path], batch_axes, expert_axes, vocab_axes, uses, replicas, trains
        ):
            add(kind, axes, operand, n, wire_factor)
            if explicit:
                # models/moe_dispatch.py gathers them inside shard_map: an explicit psum_scatter
                explicit_rs[axes_key(axes)] += operand
    for axes, b in explicit_rs.items():
        entries[("reduce-scatter", axes)]["explicit_bytes"] = b
    out = {f"{k}@{a}": v for (k, a), v in entries.items()}
    dp = data_parallel_axes(
        run.mesh, rules["batch"], [x.sharding.spec for x in jax.tree.leaves(params)]
    )
    out.update(local_sgd(out, run.comm.sync_every, dp))
    if sizes["model"] > 1:
        out["all-reduce@model"] = tensor_parallel_theory(run)
    _add_activation_theory(out, run)
    return out


def _names(run: RunSpec, adapters: bool) -> dict:
    """Path -> logical axis names of the model's parameters (and, `adapters`, a LoRA run's)."""
    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    names = dict(path_names(model_lib.param_axes(run.model), is_leaf=is_names))
    if adapters:
        names |= dict(path_names(lora.adapter_axes(run.model, run.lora), is_leaf=is_names))
    return names


def pipeline_uses(sizes: dict[str, int], pipeline_cfg: PipelineConfig) -> tuple[float, set[str]]:
    """-> (times per pass a pipeline device runs each of its layer-stack weights, the batch axes
    its weights are replicated over inside the pipeline). Every tick runs one of the stage's R layer
    chunks, bubble ticks included, so each chunk runs (R*M + P-1) / R times and its weights are
    gathered over FSDP (and their gradients reduced) as often, unless the pipeline gathers them
    once (--pipeline.gather_once puts fsdp among the replica axes). (1, all axes) off a pipeline."""
    P, pc = sizes["pipeline"], pipeline_cfg
    if P == 1:
        return 1.0, set(sizes)
    return pipeline_lib.n_ticks(P, pc.microbatches_for(P), pc.repeats) / pc.repeats, set(
        pc.replica_axes
    )


def local_sgd(th: dict, sync_every: int, dp_axes) -> dict:
    """--comm.sync_every H > 1 (DiLoCo): the all-reduce over the data-parallel axes `dp_axes` is
    the outer sync of the parameter drift, in a lax.cond branch taken every H-th step (the compiled
    HLO holds it once, so the HLO shows the bytes of one sync). -> those entries of `th` with
    per-sync bytes kept and operand/wire bytes amortised per step (/ H)."""
    h, dp = sync_every, set(dp_axes)
    if h <= 1 or not dp:
        return {}
    out = {}
    for key, e in th.items():
        kind, _, axes = key.partition("@")
        if kind == "all-reduce" and set(axes.split(",")) <= dp:
            out[key] = {
                **e,
                "operand_bytes": e["operand_bytes"] / h,
                "wire_bytes": e["wire_bytes"] / h,
                "per_sync_operand_bytes": e["operand_bytes"],
                "per_sync_wire_bytes": e["wire_bytes"],
                "sync_every": h,
                "note": f"DiLoCo outer sync of the parameter drift, every {h} steps",
            }
    return out


def _lookup_bytes(run: RunSpec, path: str, sds, n_fsdp: int) -> float:
    """All-to-all bytes of the embedding lookup when XLA's partitioner does not gather the table:
    the table FSDP-sharded on D, not tied to the head, and a device's tokens fewer than the
    vocabulary rows (its looked-up rows then weigh less than the gathered table). Each device looks
    up its D-columns for all the group's tokens and an all-to-all hands every token its row
    (forward; its transpose in the backward sends the rows' gradients back, and each device
    scatter-adds them into its own columns: no reduce-scatter either). 0 for every other weight.
    Seen in the HLO (CPU): tiny on fsdp=8, 128 tokens per device and 264 rows: all-to-all; 512
    tokens: the table is gathered."""
    m = run.model
    tokens = tokens_per_device(run)
    if not path.endswith("embed_VD") or m.tie_embeddings or n_fsdp <= 1 or tokens >= m.vocab_size:
        return 0.0
    return 2.0 * tokens * m.d_model * sds.dtype.itemsize * run.train.micro_batches


def on_backend(th: dict, platform: str, sizes: dict[str, int]) -> dict:
    """Theory as this backend lowers it: XLA:CPU turns each reduce-scatter the partitioner makes
    into an all-reduce of the full operand plus a dynamic-slice (seen in its HLO); explicit
    `lax.psum_scatter`s (the MoE expert weights' FSDP gradients) stay reduce-scatters."""
    if platform != "cpu":
        return th
    out = {k: dict(v) for k, v in th.items() if not k.startswith("reduce-scatter@")}
    for k, v in th.items():
        if k.startswith("reduce-scatter@"):
            axes = k.partition("@")[2]
            n = math.prod(sizes[a] for a in axes.split(","))
            explicit = v.get("explicit_bytes", 0.0)
            if explicit:
                out[k] = {
                    "operand_bytes": explicit,
                    "wire_bytes": (n - 1) / n * explicit,
                    "note": "lax.psum_scatter inside shard_map (MoE expert weights): a real"
                    " reduce-scatter",
                }
            if v["operand_bytes"] - explicit <= 0:
                continue
            e = out.setdefault(f"all-reduce@{axes}", {"operand_bytes": 0.0, "wire_bytes": 0.0})
            e["operand_bytes"] += v["operand_bytes"] - explicit
            e["wire_bytes"] += 2 * (n - 1) / n * (v["operand_bytes"] - explicit)
    return out
