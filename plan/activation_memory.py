"""Per-device activation memory of a train step, from the model's shapes and the run's layout:
what the remat policy saves per token and layer, the attention's scores, the LM head's logits,
and what a pipeline schedule keeps in flight. The mesh search (plan/search.py) prices every
candidate mesh with it; nothing is compiled.
"""

from __future__ import annotations

from models.blockwise import BLOCK_K
from models.config import LOSS_CHUNK, LOSS_CHUNK_FROM
from models.pieces import stage_layers
from models.pipeline import EXPLICIT, timetable
from plan.hardware import Hardware
from plan.run_spec import rows_per_shard


def _per_token_layer(
    cfg, tp: int, res: float, seq_len: int, seq_shards: int, act_bytes: int, attention: str
) -> tuple[float, float]:
    """Elements per token and layer: (what the forward pass makes, what the remat policy saves).

    The forward pass makes 4 [D] (input, two norm outputs, residual), q/k/v before and after
    rotary, the attention output, two [D] projections, 4 [F] (gate, up, silu, product) with the
    head and F dims split by `model` (`tp`); plus, by `attention` (the kind the run picks,
    models.config.attention_kind): dense, [N,T] scores and probabilities; blockwise, one key
    block's scores, probabilities and their gradients ([N,512] x 4, float32); cuDNN or JAX's
    choice on GPU, none (fused flash attention). With the sequence split over `seq_shards` a
    device holds, while a layer runs, the K/V of the other shards (all-gathered, or a ring's
    blocks kept for the backward). `res` is one [D] of the residual stream (split by `model`
    under sequence parallelism). `full` remat keeps only each layer's input, `dots` the matmul
    outputs."""
    f, n, k, h = cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    every = 4 * res + (2 * n * h + 4 * k * h + n * h) / tp + 2 * res + 4 * f / tp
    every += (seq_shards - 1) * 2 * k * h / tp  # the other shards' K/V, in the layer under way
    scores = {
        "dense": 2 * n / tp * seq_len,
        "blockwise": 4 * 4 / act_bytes * n / tp * min(BLOCK_K, seq_len),
    }
    every += scores.get(attention, 0.0)
    dots = res + (n * h + 2 * k * h) / tp + 2 * res + 2 * f / tp
    saved = {"none": every, "dots": dots, "dots_offload": dots, "full": res}[cfg.remat]
    return every, saved


def _held_by_schedule(
    cfg,
    tp: int,
    p: int,
    res: float,
    saved: float,
    tokens: int,
    pass_tokens: int,
    pipeline_microbatches: int,
    schedule: str,
    repeats: int,
) -> tuple[float, float, int]:
    """(elements held between the passes, of them the pipeline ring's, tokens the LM head runs on).

    gpipe and circular (and no pipeline) keep every micro-batch's saved set until its backward
    pass, so the whole pass's, and run the head after the pipeline on the whole pass. 1f1b and
    interleaved_1f1b keep only the stage inputs of the micro-batches in flight (the timetable's
    ring_slots, one [D] per token each), recompute one chunk's layers per backward (one
    micro-batch's saved set of L/(P x repeats) layers) and run the head per micro-batch. zb_h1
    also keeps, for up to P micro-batches, what its deferred weight gradients read (each
    projection's input and output gradient, the norms' input and gradient).

    A stage holds its share of the layer groups and, whole, the dense first layers and the tail
    (models.pieces.stage_layers); the forward-scan engine runs those on the whole pass. The
    explicit schedules' ring and recompute count the groups' share only: the first layers they
    run per micro-batch on the first stage are not priced."""
    (held, layers), tt = stage_layers(cfg, p), timetable(schedule)
    if not (p > 1 and schedule in EXPLICIT):
        return saved * held * pass_tokens, 0, pass_tokens
    f, n, k, h = cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    kept = tt.ring_slots(p, pipeline_microbatches, repeats) * res * tokens
    if tt.splits_backward:
        # the W inputs of w_slots micro-batches: each projection's input and output gradient,
        # the norms' (the split's, counted)
        w_in = 8 * res + (2 * n * h + 2 * k * h + 4 * f) / tp
        kept += tt.w_slots(p, pipeline_microbatches) * w_in * layers * tokens
    return kept + saved * (layers // repeats) * tokens, kept, tokens


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

    One forward pass holds batch / micro_batches rows split over `shards` (the rules' batch axes);
    gradient accumulation keeps one pass. With the sequence split over `seq_shards` (context
    parallelism) a device holds T/seq_shards tokens; `sequence_parallel` splits the residual
    stream's [D] terms (input, norms, residual, the projections' reduced outputs) by `model`.
    What a layer makes and saves per token is _per_token_layer's, what a pipeline schedule keeps
    _held_by_schedule's. The backward pass of one layer needs its full set once more; the LM
    head's float32 logits, softmax and gradient ([T,V/model] each) come on top, or one chunk's
    where the loss is chunked (train.step.loss_chunk's rule)."""
    tp, p, v = sizes["model"], sizes["pipeline"], cfg.vocab_size
    rows = rows_per_shard(batch_size, micro_batches, shards)
    pass_tokens = rows * seq_len // seq_shards
    tokens = pass_tokens // (pipeline_microbatches if p > 1 else 1)
    res = cfg.d_model / tp if sequence_parallel else cfg.d_model  # one [D] of the residual stream
    every, saved = _per_token_layer(cfg, tp, res, seq_len, seq_shards, act_bytes, attention)
    held, kept, head_tokens = _held_by_schedule(
        cfg, tp, p, res, saved, tokens, pass_tokens, pipeline_microbatches, schedule, repeats
    )
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
