"""Per-device activation memory of a train step, from the model's shapes and the run's layout:
what the remat policy saves per token and layer, the attention's scores, the LM head's logits,
and what a pipeline schedule keeps in flight. The mesh search (plan/search.py) prices every
candidate mesh with it; nothing is compiled.
"""

from __future__ import annotations

from models.blockwise import BLOCK_K
from models.config import LOSS_CHUNK, LOSS_CHUNK_FROM
from models.pipeline import EXPLICIT, timetable
from plan.hardware import Hardware
from plan.run_spec import rows_per_shard


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
    the residual stream's [D] terms (input, norms, residual, the projections' reduced outputs) by
    `model`. `full` remat keeps only each layer's input, `dots` the matmul outputs; the backward
    pass of one layer needs its full set once more; the LM head's float32 logits, softmax and
    gradient ([T,V/model] each) come on top, or one chunk's where the loss is chunked
    (train.step.loss_chunk's rule). One forward pass holds batch / micro_batches rows split over
    `shards` (the rules' batch axes); gradient accumulation keeps one pass. A pipeline cuts the
    pass into `pipeline_microbatches` and, with `schedule` gpipe or circular, keeps every one's
    saved activations until its backward pass, so the saved set is still the whole pass's while a
    layer's backward works on one micro-batch; the LM head runs after the pipeline, on the whole
    pass. zb_h1 also keeps, for up to P micro-batches, what its deferred weight gradients read
    (each projection's input and output gradient, the norms' input and gradient). 1f1b and
    interleaved_1f1b keep only the stage inputs of the micro-batches in flight (the ring of the
    timetable's ring_slots, one [D] per token each), recompute one chunk's layers per backward
    (one micro-batch's saved set of L/(P x repeats) layers) and run the head per micro-batch."""
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
    if cfg.remat.endswith("_offload"):
        # the saved set lives in host memory; a pipeline's ring does not
        return device + act_bytes * kept, act_bytes * (held - kept)
    return device + act_bytes * held, 0.0


def attention_on(cfg, hw: Hardware, seq_len: int) -> str:
    """The attention a run of `cfg` does on this hardware: its own choice (attention_kind), where
    the hardware has no fused flash attention the JAX choice is XLA's dense one."""
    kind = cfg.attention if cfg.attention != "auto" else cfg.attention_kind(hw.platform, seq_len)
    return "dense" if kind == "jax" and not hw.fused_attention else kind
