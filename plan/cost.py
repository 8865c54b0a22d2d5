"""The cost model: step time, MFU and goodput from FLOPs, collective bytes per mesh axis and a
hardware profile (plan/hardware.py).

    T_flops   = hardware FLOPs per device / (peak x compute efficiency)
    T_memory  = bytes accessed per device (XLA's cost analysis of the compiled step) /
                (memory bandwidth x memory efficiency)
    T_compute = max(T_flops, T_memory) where the device overlaps memory traffic with math (GPU/TPU:
                fused kernels stream operands while the matrix units work), T_flops + T_memory
                where it does not (XLA:CPU: the many small memory-bound ops run one after another,
                between matmuls already timed at their measured rate); stretched by the pipeline
                bubble (P-1)/(R x M + P-1), M = --pipeline.microbatches and R = --pipeline.repeats
                (the schedule the run executes, models/pipeline), not the gradient
                accumulation of --micro-batches, which repeats the whole pipeline. Without bytes
                of the target's own backend (the analytic search; a GPU/TPU profile priced from a
                CPU compile) T_compute = T_flops.
    T_comm    = per collective group: bytes each device sends / (one-way link bandwidth x link
                efficiency) + ring steps x latency; the link is NVLink/ICI when every mesh axis of
                the group lies inside a node, else InfiniBand/DCN (decided by the mesh layout)
    T_step    = T_compute + sum T_comm                      (no overlap)
              = max(T_compute, overlappable comm) + exposed comm   (with overlap)
    MFU       = model FLOPs per step / (devices x peak x T_step)

Overlappable: gradient and weight traffic (data-parallel all-reduce, FSDP all-gather and
reduce-scatter), which XLA's latency-hiding scheduler runs next to other layers' compute.
Exposed: tensor-parallel activation all-reduces (on the critical path of every layer), pipeline
sends and expert all-to-alls (the next computation waits for their result).

Goodput (the checkpoint/restart model): T_total = T_train + N_ckpt x T_save + N_fail x T_recover,
with failures arriving at rate (failures per device-day x devices) over the wall time.

A compiled `plan` report is priced by plan/compiled_cost.py with these same formulas.
"""

from __future__ import annotations

import math

from mesh.spec import AXES
from models import pipeline
from models.flops import flops_per_token, matmul_param_count
from plan.hardware import Hardware
from plan.run_spec import rows_per_shard

DAY_S = 86400.0
# Sequential steps of a ring algorithm on n devices (each pays one link latency).
RING_STEPS = {
    "all-reduce": lambda n: 2 * (n - 1),
    "all-gather": lambda n: n - 1,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: n - 1,
    "collective-permute": lambda n: 1,
}


def placement(
    sizes: dict[str, int], hw: Hardware, dcn: dict[str, int] | None = None
) -> dict[str, str]:
    """Mesh axis -> 'intra' (inside a node) or 'inter' (across nodes), for axes of size > 1.

    The mesh is laid out outermost first (mesh.spec.AXES), so an axis's groups are contiguous
    with everything inside it: the axis stays inside a node when its size times the sizes of all
    axes inside it fits in one node. With --mesh-dcn the layout is explicit: the axes with a DCN
    part span nodes, the others stay inside one."""
    if dcn and any(d > 1 for d in dcn.values()):
        return {a: "inter" if dcn.get(a, 1) > 1 else "intra" for a in AXES if sizes.get(a, 1) > 1}
    out, inner = {}, 1
    for a in reversed(AXES):
        inner *= sizes.get(a, 1)
        if sizes.get(a, 1) > 1:
            out[a] = "intra" if inner <= hw.devices_per_node else "inter"
    return out


# the row of the saved activations an offloading remat policy copies to host memory and back
HOST_OFFLOAD = "host-offload"


def split_key(key: str) -> tuple[str, tuple[str, ...]]:
    """'all-gather@data,fsdp' -> ('all-gather', ('data', 'fsdp'))."""
    kind, _, axes = key.partition("@")
    return kind, tuple(a for a in axes.split(",") if a and a != "-")


def overlappable(kind: str, axes: tuple[str, ...]) -> bool:
    """Whether a collective can hide behind compute: the data/FSDP/context reductions and gathers
    (issued ahead of the layer that needs them), and the ring attention's K/V hops, each of which
    runs beside the attention of the block in hand; not tensor parallelism's (on the critical path
    of every layer) nor the pipeline's permutes (a stage waits for its input)."""
    if kind == "collective-permute":
        return axes == ("context",)
    if kind == HOST_OFFLOAD:  # DMA copies of saved activations, issued beside the layers' compute
        return True
    return kind in ("all-reduce", "all-gather", "reduce-scatter") and "model" not in axes


def comm_time(
    kind: str,
    axes: tuple[str, ...],
    wire_bytes: float,
    count: float,
    sizes: dict[str, int],
    where: dict[str, str],
    hw: Hardware,
) -> tuple[float, str]:
    """-> (seconds, 'intra'|'inter'|'host'). Axes unknown (()) are charged as the slowest link in
    use; host offload copies go over the host link (PCIe, hw.host_bw)."""
    if kind == HOST_OFFLOAD:
        return wire_bytes / hw.host_bw, "host"
    inter = any(where.get(a) == "inter" for a in axes) if axes else "inter" in where.values()
    bw = (hw.inter_bw if inter else hw.intra_bw) * hw.link_efficiency
    lat = hw.inter_latency_s if inter else hw.intra_latency_s
    n = math.prod(sizes.get(a, 1) for a in axes) if axes else 2
    return wire_bytes / bw + count * RING_STEPS[kind](n) * lat, "inter" if inter else "intra"


def model_flops_per_step(cfg, batch_size: int, seq_len: int) -> float:
    """The MFU numerator, as the train loop and `plan` count it (PaLM appendix B)."""
    return flops_per_token(cfg, seq_len) * batch_size * seq_len


def hardware_flops_per_step(cfg, batch_size: int, seq_len: int, schedule: str = "gpipe") -> float:
    """Model FLOPs (6N + attention, PaLM) plus what remat recomputes: the forward pass of every
    layer for `full`, the attention-score einsums for `dots` (they have batch dims, so the policy
    does not save them). The LM head sits outside the remat'd layers and is never recomputed. The
    explicit pipeline schedules (1f1b, interleaved_1f1b; pass `schedule` on a pipeline mesh) also
    recompute each stage's forward in its backward, from the saved stage input: one more forward of
    every layer."""
    tokens = batch_size * seq_len
    attn_fwd = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    blocks_fwd = 2 * (matmul_param_count(cfg) - cfg.vocab_size * cfg.d_model)
    recompute = {
        "none": 0.0,
        "dots": attn_fwd,
        "dots_offload": attn_fwd,
        "full": blocks_fwd + attn_fwd,
    }[cfg.remat]
    if schedule in pipeline.EXPLICIT:
        recompute += blocks_fwd + attn_fwd
    return model_flops_per_step(cfg, batch_size, seq_len) + recompute * tokens


def pipeline_comm(
    cfg,
    sizes: dict[str, int],
    batch_size: int,
    seq_len: int,
    micro_batches: int,
    act_bytes: int,
    *,
    pipeline_microbatches: int,
    repeats: int = 1,
    batch_shards: int,
) -> dict:
    """Activations forward and their gradients backward between neighbouring stages, per device
    per step: models/pipeline/gpipe.py's count (one [b, T, D] send each way per tick, bubble ticks
    included, b = one pipeline micro-batch's rows on one batch shard), for each of the
    `micro_batches` passes of gradient accumulation."""
    p = sizes.get("pipeline", 1)
    if p <= 1:
        return {}
    rows = rows_per_shard(batch_size, micro_batches, batch_shards)
    sent = (
        pipeline.permute_bytes_theory(
            batch=rows,
            seq=seq_len,
            d_model=cfg.d_model,
            itemsize=act_bytes,
            stages=p,
            microbatches=pipeline_microbatches,
            repeats=repeats,
        )["sent"]
        * micro_batches
    )
    n = 2 * pipeline.n_ticks(p, pipeline_microbatches, repeats) * micro_batches
    return {"collective-permute@pipeline": {"operand_bytes": sent, "wire_bytes": sent, "count": n}}


def ragged_all_to_all(comm: dict, platform: str) -> dict:
    """GPU/TPU exchange MoE tokens with a ragged all-to-all, which moves plan's `ideal_bytes` (the
    k rows of each token), not the fixed worst-case buffers XLA:CPU needs."""
    if platform == "cpu":
        return comm
    out = {}
    for key, e in comm.items():
        if e.get("ideal_bytes") and e.get("operand_bytes"):
            e = {
                **e,
                "wire_bytes": e["wire_bytes"] * e["ideal_bytes"] / e["operand_bytes"],
                "operand_bytes": e["ideal_bytes"],
            }
        out[key] = e
    return out


def _compute(
    device_flops: float,
    device_bytes: float,
    peak: float,
    hw: Hardware,
    sizes: dict[str, int],
    schedule: str,
    pipeline_microbatches: int,
    repeats: int,
) -> dict:
    """One device's compute time per step: flops and memory traffic overlap where the hardware
    hides the traffic behind the math and add up otherwise; the pipeline bubble stretches both."""
    t_flops = device_flops / (peak * hw.compute_efficiency)
    t_memory = device_bytes / (hw.hbm_bw * hw.memory_efficiency)
    t_compute = max(t_flops, t_memory) if hw.memory_overlap else t_flops + t_memory
    p = sizes.get("pipeline", 1)
    bubble = (
        pipeline.schedule_bubble(schedule, p, pipeline_microbatches or p, repeats) if p > 1 else 0.0
    )
    return {
        "t_flops_s": t_flops,
        "t_memory_s": t_memory,
        "device_bytes": device_bytes,
        "t_compute_s": t_compute,
        "bubble": bubble,
        "t_compute_with_bubble_s": t_compute / (1 - bubble),
    }


def _comm_rows(
    comm: dict, sizes: dict[str, int], where: dict, hw: Hardware
) -> tuple[dict, float, float]:
    """Each collective's time and link, and the totals of those the step can overlap with
    compute and of those it waits for: (rows, overlappable seconds, exposed seconds)."""
    rows, t_overlappable, t_exposed = {}, 0.0, 0.0
    for key, e in comm.items():
        kind, axes = split_key(key)
        t, link = comm_time(kind, axes, e["wire_bytes"], e.get("count", 0), sizes, where, hw)
        ov = overlappable(kind, axes)
        rows[key] = {
            "wire_bytes": e["wire_bytes"],
            "time_s": t,
            "link": link,
            "overlappable": ov,
            **{k: e[k] for k in ("sync_every", "per_sync_wire_bytes") if k in e},
        }
        if ov:
            t_overlappable += t
        else:
            t_exposed += t
    return rows, t_overlappable, t_exposed


def predict(
    *,
    model_flops: float,
    device_flops: float,
    comm: dict,
    sizes: dict[str, int],
    hw: Hardware,
    dtype: str,
    pipeline_microbatches: int = 0,
    repeats: int = 1,
    dcn: dict[str, int] | None = None,
    tokens_per_step: int = 0,
    device_bytes: float = 0.0,
    schedule: str = "gpipe",
) -> dict:
    """Step time and MFU for one mesh.

    model_flops: per step, all devices (the MFU numerator). device_flops: per device per step,
    including recomputation. device_bytes: memory traffic per device per step (0: unknown, compute
    only). comm: {"kind@axes": {"wire_bytes": B, "count": C (optional)}} per device per step, as in
    `plan`'s theory_detail or measured collectives. pipeline_microbatches, repeats: the pipeline
    schedule's M (0: as many as stages, the run's default), R and `schedule`, which set the
    bubble."""
    n_dev = math.prod(sizes.get(a, 1) for a in AXES)
    peak = hw.peak_flops(dtype)
    compute = _compute(
        device_flops, device_bytes, peak, hw, sizes, schedule, pipeline_microbatches, repeats
    )
    t_busy = compute["t_compute_with_bubble_s"]
    where = placement(sizes, hw, dcn)
    rows, t_overlappable, t_exposed = _comm_rows(comm, sizes, where, hw)
    t_serial = t_busy + t_overlappable + t_exposed
    t_overlap = max(t_busy, t_overlappable) + t_exposed
    t_step = t_overlap if hw.overlap else t_serial

    def mfu(t: float) -> float:
        return model_flops / (n_dev * peak * t) if t > 0 else 0.0

    return {
        "hardware": hw.name,
        "devices": n_dev,
        "dtype": dtype,
        "placement": where,
        "overlap": hw.overlap,
        "memory_overlap": hw.memory_overlap,
        **compute,
        "comm": rows,
        "t_comm_s": t_overlappable + t_exposed,
        "t_comm_exposed_s": t_exposed,
        "t_step_serial_s": t_serial,
        "t_step_overlap_s": t_overlap,
        "t_step_s": t_step,
        "mfu": mfu(t_step),
        "mfu_serial": mfu(t_serial),
        "tokens_per_s_per_device": tokens_per_step / t_step / n_dev
        if tokens_per_step and t_step
        else 0.0,
    }


def _interval(
    tau: float,
    t_step: float,
    state_bytes: float,
    t_write: float,
    mtbf: float,
    hw: Hardware,
    async_save: bool,
    restart_s: float,
) -> dict:
    """The cost of saving every `tau` training seconds: the blocking time of one save, the time one
    failure costs, and the fraction of the wall time left for training (see `goodput`)."""
    t_save = state_bytes / hw.host_bw + max(0.0, t_write - tau) if async_save else t_write
    t_recover = restart_s + t_write + tau / 2
    lost = t_recover / mtbf if math.isfinite(mtbf) else 0.0
    frac = max(0.0, 1 - lost) / (1 + t_save / tau) if tau > 0 else 0.0
    return {
        "interval_s": tau,
        "interval_steps": tau / t_step if t_step else 0.0,
        "t_save_s": t_save,
        "t_recover_s": t_recover,
        "goodput": frac,
    }


def goodput(
    t_step: float,
    state_bytes: float,
    n_devices: int,
    hw: Hardware,
    *,
    ckpt_every: int,
    async_save: bool = True,
    fail_rate: float = 0.001,
    restart_s: float = 300.0,
    write_bw: float | None = None,
    steps: int = 0,
) -> dict:
    """Effective-time fraction T_train / T_total for a cluster of `n_devices`.

    state_bytes: checkpointed bytes per device (params + optimizer state; each device writes its
    own shards, all in parallel). fail_rate: failures per device-day (default 0.1%/day/GPU, so
    10 a day on 10,000 GPUs). A save blocks for the device-to-host copy when async (plus any part of
    the write that the next interval cannot hide), for the whole write otherwise. A failure costs
    the restart, reading the checkpoint back, and on average half an interval of lost steps.

    With tau = training seconds between saves and MTBF = mean time between failures:
        T_total = T_train (1 + T_save/tau) / (1 - T_recover/MTBF)
    Young/Daly's optimal interval: tau* = sqrt(2 T_save MTBF).
    """
    write = write_bw or hw.ckpt_write_bw
    t_write = state_bytes / write
    mtbf = DAY_S / (fail_rate * n_devices) if fail_rate > 0 else math.inf

    def at(tau: float) -> dict:
        return _interval(tau, t_step, state_bytes, t_write, mtbf, hw, async_save, restart_s)

    given = at(ckpt_every * t_step) if ckpt_every > 0 else at(0.0)
    t_save0 = state_bytes / hw.host_bw if async_save else t_write
    best = at(math.sqrt(2 * t_save0 * mtbf)) if math.isfinite(mtbf) else at(math.inf)
    out = {
        "devices": n_devices,
        "failures_per_day": fail_rate * n_devices,
        "mtbf_s": mtbf,
        "state_bytes_per_device": state_bytes,
        "checkpoint": given,
        "young_daly": best,
    }
    if steps and given["goodput"] > 0:
        t_train = steps * t_step
        t_total = t_train / given["goodput"]
        out["run"] = {
            "steps": steps,
            "t_train_s": t_train,
            "t_total_s": t_total,
            "n_ckpt": t_train / given["interval_s"],
            "n_fail": t_total / mtbf,
        }
    return out
