"""The cost model's prediction for a compiled `plan` report (plan.report.analyze): the
collectives the compiler chose where the report was compiled for the target's own backend, the
theory as GPU/TPU lower it where not, priced by plan.cost.predict.
"""

from __future__ import annotations

import math

import numpy as np

from mesh.spec import AXES
from plan.cost import hardware_flops_per_step, pipeline_comm, predict, ragged_all_to_all
from plan.hardware import Hardware


def _measured_comm(report: dict) -> dict:
    """The collectives measured in the report's HLO, per kind and mesh axes. DiLoCo's HLO holds
    one sync, run every H steps: its traffic is spread over the H steps."""
    comm = {
        f"{kind}@{axes}": {"wire_bytes": v["wire_bytes"], "count": v["count"]}
        for kind, c in report["collectives_detail"].items()
        for axes, v in c["by_axes"].items()
    }
    for key, th in report["theory_detail"].items():
        if "sync_every" in th and key in comm:
            h = th["sync_every"]
            comm[key] = {
                "wire_bytes": comm[key]["wire_bytes"] / h,
                "count": comm[key]["count"] / h,
                "per_sync_wire_bytes": comm[key]["wire_bytes"],
                "sync_every": h,
            }
    return comm


def _theory_comm(
    report: dict, hw: Hardware, cfg, batch_size, seq_len, micro_batches, sizes, act_bytes, pp
) -> dict:
    """The report's theory as GPU/TPU lower it, with the pipeline's stage-to-stage sends where the
    theory has none."""
    comm = ragged_all_to_all(report["theory_detail"], hw.platform)
    if not any(k.startswith("collective-permute@") for k in comm):
        comm.update(
            pipeline_comm(
                cfg,
                sizes,
                batch_size,
                seq_len,
                micro_batches,
                act_bytes,
                pipeline_microbatches=pp["microbatches"],
                repeats=pp["repeats"],
                batch_shards=pp["batch_shards"],
            )
        )
    return comm


def from_plan(
    report: dict,
    hw: Hardware,
    cfg,
    batch_size: int,
    seq_len: int,
    micro_batches: int,
    sizes: dict[str, int],
    dcn: dict[str, int] | None = None,
) -> dict:
    """The prediction for a compiled `plan` report (plan.report.analyze). On the backend it was
    compiled for (the CPU profile on a CPU compile) the collectives are the ones measured in the
    HLO; for another target they are the theory as GPU/TPU lower it (reduce-scatter, not XLA:CPU's
    all-reduce + slice), since the CPU's choices say nothing about NCCL's. A pipeline is priced
    with the schedule the report compiled and prints (report['pipeline'])."""
    no_pipeline = {"microbatches": 0, "repeats": 1, "batch_shards": 1}
    pp = report.get("pipeline") or no_pipeline
    same = hw.platform == report["backend"]
    dtype = cfg.compute_dtype(hw.platform)
    if same:
        comm = _measured_comm(report)
    else:
        comm = _theory_comm(
            report, hw, cfg, batch_size, seq_len, micro_batches, sizes, np.dtype(dtype).itemsize, pp
        )
    n = math.prod(sizes.get(a, 1) for a in AXES)
    # Memory traffic only from a compile for the target's own backend: XLA:CPU fuses less and has
    # no flash attention, so its bytes (224 GiB per device per step for the 1b preset on fsdp=8)
    # would make a GPU look memory-bound; another target is priced on FLOPs alone (checked on CPU
    # only, BENCHMARKS.md)
    traffic = report.get("memory_traffic", {}) if same else {}
    out = predict(
        model_flops=report["flops_per_step"],
        device_flops=hardware_flops_per_step(cfg, batch_size, seq_len, pp.get("schedule", "gpipe"))
        / n,
        comm=comm,
        sizes=sizes,
        hw=hw,
        dtype=dtype,
        pipeline_microbatches=pp["microbatches"],
        repeats=pp["repeats"],
        dcn=dcn,
        tokens_per_step=batch_size * seq_len,
        schedule=pp.get("schedule", "gpipe"),
        device_bytes=traffic.get("bytes_accessed", 0.0),
    )
    out["comm_source"] = "compiled HLO" if same else "ring-formula theory (GPU/TPU lowering)"
    out["bytes_source"] = traffic.get("source", "")
    return out
