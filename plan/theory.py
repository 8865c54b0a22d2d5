"""The collective traffic a train step should make, from the ring and Megatron formulas.

Per device per step, keyed "kind@axes" ("all-gather@fsdp"): operand bytes and bytes on the wire
(ring conventions: all-reduce 2(n-1)/n x bytes; all-gather and reduce-scatter (n-1)/n x bytes).
`plan` puts these next to the collectives of the compiled step (plan/report.py), and the mesh
search (plan/search.py) prices meshes with them without compiling anything. Every formula reads a
`RunSpec`: the run's model, train, comm and pipeline configs, the mesh's axis sizes, the
logical-axis rules and the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import TYPE_CHECKING

import jax
from jax.sharding import AbstractMesh

from mesh.rules import logical_to_spec
from mesh.shard import axes_size, data_parallel_axes, path_names, spec_axes
from mesh.spec import AXES
from models import model as model_lib
from models import pipeline as pipeline_lib
from models.attention import fused_qkv
from models.config import ModelConfig, PipelineConfig
from models.moe_dispatch import exchange_for
from train.core.config import CommConfig, TrainConfig
from train.core.shapes import batch_shards, seq_shards

if TYPE_CHECKING:
    from train.core.setup import RunSetup


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What the formulas read of a run. `sizes`: mesh axis -> size (every axis of mesh.spec.AXES)."""

    model: ModelConfig
    train: TrainConfig
    comm: CommConfig
    pipeline: PipelineConfig
    sizes: dict[str, int]
    rules: dict
    compute_dtype: str
    context_strategy: str = "all_gather"  # --parallelism.context_strategy
    packed: bool = False  # segment ids in the batch (--data.packing_mask)

    @property
    def mesh(self) -> AbstractMesh:
        """The mesh's shape without devices: what the sharding helpers read."""
        return abstract_mesh(self.sizes)

    @property
    def itemsize(self) -> int:
        """Bytes of one activation element."""
        return jax.numpy.dtype(self.compute_dtype).itemsize


def run_spec(s: RunSetup) -> RunSpec:
    """The spec of a run set up on a real mesh (train.core.setup.setup)."""
    c = s.cfg
    return RunSpec(
        model=c.model,
        train=c.train,
        comm=c.comm,
        pipeline=c.pipeline,
        sizes=dict(s.mesh.shape),
        rules=s.rules,
        compute_dtype=s.compute_dtype,
        context_strategy=c.parallelism.context_strategy,
        packed=c.data.packing_mask,
    )


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh of these axis sizes (missing axes: 1) and no devices."""
    return AbstractMesh(tuple(sizes.get(a, 1) for a in AXES), AXES)


def local_bytes(sds) -> float:
    """Bytes of one device's shard of a ShapeDtypeStruct with a NamedSharding (real or abstract mesh)."""
    sh = sds.sharding
    return (
        math.prod(sds.shape)
        * sds.dtype.itemsize
        / math.prod(axes_size(sh.mesh, e) for e in sh.spec)
    )


def rows_per_shard(batch_size: int, micro_batches: int, shards: int) -> int:
    """Rows of one forward pass (the batch over --micro-batches) on one of the `shards` devices the
    rules split the batch over: the leading dim of a device's activations, before a pipeline cuts it."""
    return batch_size // micro_batches // shards


def _tokens_per_device(run: RunSpec) -> int:
    """Tokens of one micro-batch on one device."""
    t = run.train
    rows = rows_per_shard(t.batch_size, t.micro_batches, batch_shards(run.mesh, run.rules))
    return rows * t.seq_len // seq_shards(run.mesh, run.rules)


def _axes_key(axes) -> str:
    return ",".join(a for a in AXES if a in axes)


def theory(run: RunSpec, params) -> dict:
    """Ideal per-device collective bytes per step. `params`: the abstract parameters with their
    shardings (ShapeDtypeStructs; the model's, or one pipeline stage's).

    For each parameter: the batch mesh axes it is *not* sharded on carry plain data parallelism
    (all-reduce of its gradient shard: 2(n-1)/n x M); the batch axes it *is* sharded on carry
    ZeRO-3/FSDP (all-gather of the weights in forward and again in backward, and a reduce-scatter
    of the gradient, per micro-batch: (n-1)/n x M each). On a pipeline mesh the layer stack's FSDP
    traffic repeats on every tick (pipeline_uses).
    """
    sizes, rules, t, m = run.sizes, run.rules, run.train, run.model
    # the axes that split the tokens: the batch's and the sequence's (context parallelism); over
    # those a weight is either sharded (FSDP traffic) or replicated (a data-parallel all-reduce)
    batch_axes = [a for a in spec_axes(logical_to_spec(("batch", "seq"), rules)) if sizes[a] > 1]
    entries: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"operand_bytes": 0.0, "wire_bytes": 0.0}
    )

    def add(kind, axes, operand, n, wire_factor):
        if n <= 1 or operand == 0:
            return
        e = entries[(kind, _axes_key(axes))]
        e["operand_bytes"] += operand
        e["wire_bytes"] += wire_factor * operand

    names = dict(path_names(model_lib.param_axes(m), is_leaf=lambda x: isinstance(x, tuple)))
    expert_axes = spec_axes(logical_to_spec(("experts",), rules))
    vocab_axes = _vocab_parallel_axes(run)
    explicit_rs: dict[str, float] = defaultdict(float)
    uses, replicas = pipeline_uses(sizes, run.pipeline)
    for path, sds in path_names(params, is_leaf=lambda x: hasattr(x, "shape")):
        used = spec_axes(sds.sharding.spec)
        # an expert's weights live on the devices its tokens travel to: no collective over the
        # expert axes (the tokens move by all-to-all instead, below)
        is_expert = "experts" in names[path]
        own = [a for a in batch_axes if not (is_expert and a in expert_axes)]
        # a vocab-parallel head's weights never move: its input does (vocab_parallel_theory)
        fsdp_axes = [
            a for a in own if a in used and not ("vocab" in names[path] and a in vocab_axes)
        ]
        dp_axes = [a for a in own if a not in used]
        n_f = math.prod(sizes[a] for a in fsdp_axes)
        n_d = math.prod(sizes[a] for a in dp_axes)
        full = (
            local_bytes(sds) * n_f
        )  # gradient bytes before the fsdp split (after tensor parallel)
        in_stack = path.startswith(("blocks/", "moe_blocks/"))
        per_pass = uses if in_stack and not set(fsdp_axes) <= replicas else 1
        lookup = _lookup_bytes(run, path, sds, n_f)
        add("all-to-all", fsdp_axes, lookup, n_f, (n_f - 1) / n_f)
        for _ in range(
            0 if lookup else t.micro_batches
        ):  # ZeRO-3 reduce-scatters every micro-batch's gradient
            add("reduce-scatter", fsdp_axes, full * per_pass, n_f, (n_f - 1) / n_f)
            if (
                is_expert and n_f > 1
            ):  # models/moe_dispatch.py gathers them inside shard_map: an explicit psum_scatter
                explicit_rs[_axes_key(fsdp_axes)] += full * per_pass
        add("all-reduce", dp_axes, full / n_f, n_d, 2 * (n_d - 1) / n_d)  # once per step (no_sync)
        # FSDP gathers weights for the forward pass; rematerialised layers gather them again for
        # the backward recompute (ZeRO-3); weights outside the layer stack stay gathered. Per micro-batch.
        gathers = 0 if lookup else 2 if in_stack and m.remat != "none" else 1
        for _ in range(gathers * t.micro_batches):
            add(
                "all-gather", fsdp_axes, full / n_f * per_pass, n_f, n_f - 1
            )  # operand = own shard, receive n-1
    for axes, b in explicit_rs.items():
        entries[("reduce-scatter", axes)]["explicit_bytes"] = b
    out = {f"{k}@{a}": v for (k, a), v in entries.items()}
    dp = data_parallel_axes(
        run.mesh, rules["batch"], [x.sharding.spec for x in jax.tree.leaves(params)]
    )
    out.update(local_sgd(out, run.comm.sync_every, dp))
    if sizes["model"] > 1:
        out["all-reduce@model"] = tensor_parallel_theory(run)
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
    return out


def _vocab_parallel_axes(run: RunSpec) -> list[str]:
    """The batch axes the vocabulary dim is sharded on (mesh.rules.vocab_parallel), size > 1."""
    batch = spec_axes(logical_to_spec(("batch",), run.rules))
    return [
        a
        for a in spec_axes(logical_to_spec(("vocab",), run.rules))
        if a in batch and run.sizes[a] > 1
    ]


def vocab_parallel_theory(run: RunSpec) -> dict:
    """A vocab-parallel head (mesh.rules.vocab_parallel) over batch axes of n devices, per
    micro-batch: the head's input [b, T, D] is all-gathered over them in the forward and again
    for the backward's weight gradient, the targets [b, T] int32 once. Over every axis the
    vocabulary is split on (those and 'model'): the embedding lookup (each device's rows of the
    table, zero elsewhere: in the parameter dtype) and the head's input gradient reduce-scatter
    back to the batch layout ([n b, T, D] operands), and the loss's max, sum-exp and target
    logit are all-reduced ([n b, T] float32); tensor_parallel_theory counts these over 'model'
    alone when the vocabulary is not split on a batch axis."""
    axes = _vocab_parallel_axes(run)
    n = math.prod(run.sizes[a] for a in axes)
    if n <= 1:
        return {}
    m, mb = run.model, run.train.micro_batches
    split = [a for a in spec_axes(logical_to_spec(("vocab",), run.rules)) if run.sizes[a] > 1]
    n_split = math.prod(run.sizes[a] for a in split)
    tokens, key, split_key = _tokens_per_device(run), _axes_key(axes), _axes_key(split)
    gather = (2 * tokens * m.d_model * run.itemsize + tokens * 4) * mb
    scatter = n * tokens * m.d_model * (jax.numpy.dtype(m.param_dtype).itemsize + run.itemsize) * mb
    reduce = 3 * n * tokens * 4 * mb
    return {
        f"all-gather@{key}": {"operand_bytes": gather, "wire_bytes": (n - 1) * gather},
        f"reduce-scatter@{split_key}": {
            "operand_bytes": scatter,
            "wire_bytes": (n_split - 1) / n_split * scatter,
        },
        f"all-reduce@{split_key}": {
            "operand_bytes": reduce,
            "wire_bytes": 2 * (n_split - 1) / n_split * reduce,
        },
    }


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


def tensor_parallel_theory(run: RunSpec) -> dict:
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
    m, rules, t = run.model, run.rules, run.train
    n_tp, item = run.sizes["model"], run.itemsize
    n = _tokens_per_device(run)
    act = n * m.d_model * item
    full = m.remat == "full"
    n_moe = m.n_moe_layers
    qkv = 1 if fused_qkv(m.n_kv_heads, run.mesh, rules) else 2
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
    if not _vocab_parallel_axes(
        run
    ):  # else vocab_parallel_theory counts these over the batch axes and 'model'
        b += 2 * act + 3 * n * 4
        ops += 5
    return {
        "operand_bytes": float(b * t.micro_batches),
        "wire_bytes": 2 * (n_tp - 1) / n_tp * b * t.micro_batches,
        "count": ops * t.micro_batches,
        "note": "Megatron TP: per layer the attention output (fwd) and the fused q/k/v input gradient (bwd),"
        " the FFN output (fwd) and the fused gate/up input gradient (bwd) or the MoE expert psums,"
        " the attention output again under full remat; + vocab-parallel embedding, LM head and loss",
    }


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
    tokens = _tokens_per_device(run)
    if not path.endswith("embed_VD") or m.tie_embeddings or n_fsdp <= 1 or tokens >= m.vocab_size:
        return 0.0
    return 2.0 * tokens * m.d_model * sds.dtype.itemsize * run.train.micro_batches


def all_to_all_theory(run: RunSpec) -> dict:
    """MoE token exchange per device per step, as models/moe_dispatch.py sizes its fixed buffers: every
    MoE layer sends its dispatch buffer and gets it back (forward), the backward pass does both
    again, and remat recomputes the forward. Dropless buffers hold tokens x min(k, experts per
    device) rows per destination (the worst case: nothing can overflow), plus the int32 expert id
    of each row; capacity buffers hold `capacity` rows per expert. `ideal_bytes` is what a ragged
    all-to-all (GPU/TPU) would move at a perfectly even load: the k rows of each token, which is
    what the ragged exchange (models.moe_dispatch.exchange_for) moves."""
    m, t = run.model, run.train
    expert_spec = logical_to_spec(("experts",), run.rules)
    ep = axes_size(run.mesh, expert_spec[0])
    if not m.n_experts or ep <= 1:
        return {}
    k, x_count = m.experts_per_token, m.n_experts // ep
    n, item = _tokens_per_device(run), run.itemsize
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
    passes = 3 if m.remat != "none" else 2  # forward, backward (+ the remat recompute)
    id_passes = 2 if m.remat != "none" else 1  # ids have no backward
    per_layer = 2 * passes * rows * m.d_model * item + id_passes * id_bytes
    total = per_layer * m.n_moe_layers * t.micro_batches
    ideal = 2 * passes * n * k * m.d_model * item * m.n_moe_layers * t.micro_batches
    kind = "ragged-all-to-all" if exchange == "ragged" else "all-to-all"
    return {
        f"{kind}@{_axes_key(spec_axes(expert_spec))}": {
            "operand_bytes": float(total),
            "wire_bytes": (ep - 1) / ep * total,
            "ideal_bytes": float(ideal),
            "note": f"{m.dispatch} MoE, {exchange} exchange: {rows} rows of d_model per layer"
            f" and direction; a ragged all-to-all moves {n * k}",
        }
    }


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
                    "note": "lax.psum_scatter inside shard_map (MoE expert weights): a real reduce-scatter",
                }
            if v["operand_bytes"] - explicit <= 0:
                continue
            e = out.setdefault(f"all-reduce@{axes}", {"operand_bytes": 0.0, "wire_bytes": 0.0})
            e["operand_bytes"] += v["operand_bytes"] - explicit
            e["wire_bytes"] += 2 * (n - 1) / n * (v["operand_bytes"] - explicit)
    return out


def context_theory(run: RunSpec) -> dict:
    """K/V traffic of context parallelism (models/context.py) per device per step, over the n
    devices that split the sequence. Per layer and micro-batch, with kv = the local K and V
    ([b, T/n, K/model, H] each) and p = the local positions ([b, T/n] int32):
      all_gather: forward all-gather of K, V and p (operand kv + p, (n-1)x on the wire), again for
        the remat recompute; backward reduce-scatter of the gathered K/V gradients (operand n kv).
      ring: n - 1 collective-permutes of K, V and p forward (and again under remat), n - 1 of the
        K/V gradients backward (autodiff transposes each permute into the reverse one).
    Packed sequences move their segment ids alongside p. p's gathers and hops are the same in every
    layer: XLA may merge some (the compiled step moves up to ~1% fewer bytes than this bound at
    the tiny preset)."""
    n = seq_shards(run.mesh, run.rules)
    if n <= 1:
        return {}
    m, t = run.model, run.train
    heads = axes_size(run.mesh, logical_to_spec(("act_kv_heads",), run.rules)[0])
    tokens = _tokens_per_device(run)
    kv = 2 * tokens * m.n_kv_heads // heads * m.head_dim * run.itemsize
    ids = tokens * 4 * (2 if run.packed else 1)
    forwards = 2 if m.remat == "full" else 1
    layers, key = (
        m.n_layers * t.micro_batches,
        _axes_key(spec_axes(logical_to_spec(("seq",), run.rules))),
    )
    if run.context_strategy == "ring":
        permuted = layers * (n - 1) * (forwards * (kv + ids) + kv)
        return {
            f"collective-permute@{key}": {
                "operand_bytes": float(permuted),
                "wire_bytes": float(permuted),
                "note": f"ring attention: {n - 1} K/V hops per layer each way",
            }
        }
    gathered = layers * forwards * (kv + ids)
    scattered = layers * n * kv
    return {
        f"all-gather@{key}": {
            "operand_bytes": float(gathered),
            "wire_bytes": (n - 1) * gathered,
            "note": "context all_gather: K, V and positions gathered every layer",
        },
        f"reduce-scatter@{key}": {
            "operand_bytes": float(scattered),
            "wire_bytes": (n - 1) / n * scattered,
            "note": "the gathered K/V gradients back to their shards",
        },
    }
