"""The collectives that move activations rather than weights, per device per step: tensor
parallelism's all-reduces (Megatron), a vocab-parallel head's gathers, the MoE token exchange and
context parallelism's K/V traffic. plan/theory.py adds them to the weights' traffic.
"""

from __future__ import annotations

import math

import jax

from mesh.rules import logical_to_spec
from mesh.shard import axes_size, spec_axes
from models.attention import fused_qkv
from models.moe_dispatch import exchange_for
from plan.run_spec import RunSpec, axes_key, tokens_per_device, vocab_parallel_axes
from train.core.shapes import seq_shards


def vocab_parallel_theory(run: RunSpec) -> dict:
    """A vocab-parallel head (mesh.rules.vocab_parallel) over batch axes of n devices, per
    micro-batch: the head's input [b, T, D] is all-gathered over them in the forward and again
    for the backward's weight gradient, the targets [b, T] int32 once. Over every axis the
    vocabulary is split on (those and 'model'): the embedding lookup (each device's rows of the
    table, zero elsewhere: in the parameter dtype) and the head's input gradient reduce-scatter
    back to the batch layout ([n b, T, D] operands), and the loss's max, sum-exp and target
    logit are all-reduced ([n b, T] float32); tensor_parallel_theory counts these over 'model'
    alone when the vocabulary is not split on a batch axis."""
    axes = vocab_parallel_axes(run)
    n = math.prod(run.sizes[a] for a in axes)
    if n <= 1:
        return {}
    m, mb = run.model, run.train.micro_batches
    split = [a for a in spec_axes(logical_to_spec(("vocab",), run.rules)) if run.sizes[a] > 1]
    n_split = math.prod(run.sizes[a] for a in split)
    tokens, key, split_key = tokens_per_device(run), axes_key(axes), axes_key(split)
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


def tensor_parallel_theory(run: RunSpec) -> dict:
    """Activation all-reduces over 'model' per device per step, as the compiled step makes them.
    A = [b, T, D] of one micro-batch on one device.

      every layer: the attention output (forward) and the input gradient of the q/k/v projection
        (backward: one einsum when the shards keep each KV group's query heads together, else
        q alone and k/v together, two; models/attention.py); `full` remat recomputes the attention
        output (the layer's last all-reduce feeds only the next layer, so its recompute is dead
        code)
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
    n = tokens_per_device(run)
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
    if not vocab_parallel_axes(run):
        # else vocab_parallel_theory counts these over the batch axes and 'model'
        b += 2 * act + 3 * n * 4
        ops += 5
    return {
        "operand_bytes": float(b * t.micro_batches),
        "wire_bytes": 2 * (n_tp - 1) / n_tp * b * t.micro_batches,
        "count": ops * t.micro_batches,
        "note": "Megatron TP: per layer the attention output (fwd) and the fused q/k/v input"
        " gradient (bwd), the FFN output (fwd) and the fused gate/up input gradient (bwd) or the"
        " MoE expert psums, the attention output again under full remat; + vocab-parallel"
        " embedding, LM head and loss",
    }


def all_to_all_theory(run: RunSpec) -> dict:
    """MoE token exchange per device per step, as models/moe_dispatch.py sizes its fixed buffers:
    every MoE layer sends its dispatch buffer and gets it back (forward), the backward pass does
    both again, and remat recomputes the forward. Dropless buffers hold tokens x min(k, experts per
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
    n, item = tokens_per_device(run), run.itemsize
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
        f"{kind}@{axes_key(spec_axes(expert_spec))}": {
            "operand_bytes": float(total),
            "wire_bytes": (ep - 1) / ep * total,
            "ideal_bytes": float(ideal),
            "note": f"{m.dispatch} MoE, {exchange} exchange: {rows} rows of d_model per layer"
            f" and direction; a ragged all-to-all moves {n * k}",
        }
    }


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
    tokens = tokens_per_device(run)
    kv = 2 * tokens * m.n_kv_heads // heads * m.head_dim * run.itemsize
    ids = tokens * 4 * (2 if run.packed else 1)
    forwards = 2 if m.remat == "full" else 1
    layers, key = (
        m.n_layers * t.micro_batches,
        axes_key(spec_axes(logical_to_spec(("seq",), run.rules))),
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
