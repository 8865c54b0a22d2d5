"""The peak FLOP/s of this host's CPU cores, for MFU: the fused multiply-adds its cores can issue
per cycle (from the instruction sets /proc/cpuinfo lists), times their clock, times the cores this
process may run on. A datasheet figure, as the GPU table's are, not a measurement: a matmul timed
at start-up measured whatever else the machine was doing at that moment, and on a loaded machine
printed MFUs of 139-238%. This figure does not move with the load, and is an upper bound: it
assumes two FMA pipes of the widest vectors the cores declare and their highest clock the host
reports, so MFU stays under 100% unless the host hides a faster clock (StepStats then raises the
peak to what the step achieved and says so).
"""

from __future__ import annotations

import glob
import math
import os
import re

# FLOP per cycle per core, by the best instruction set the flags declare: two FMA pipes of that
# vector width (2 FLOP per lane per FMA), or for AMX one tile multiply every 16 cycles
# (16 x 16 x 32 multiply-adds). Wider than any shipping core's sustained rate: an upper bound.
FLOAT32 = (
    ("avx512f", 64, "AVX-512 FMA"),
    ("avx2", 32, "AVX2 FMA"),
    ("avx", 16, "AVX"),
    ("sse2", 8, "SSE2"),
    ("sve", 64, "SVE FMA"),  # Arm: two pipes of vectors up to 512 bits
    ("asimd", 32, "NEON"),  # Arm: up to four 128-bit FMA pipes
)
HALF = {  # XLA:CPU multiplies these through float32 unless the cores multiply them natively
    "bfloat16": (
        ("amx_bf16", 1024, "AMX bf16"),
        ("avx512_bf16", 128, "AVX-512 bf16"),
        ("bf16", 256, "Arm bf16"),  # BFMMLA: 4x the float32 rate of the same vectors
    ),
    "float16": (
        ("amx_fp16", 1024, "AMX fp16"),
        ("avx512_fp16", 128, "AVX-512 fp16"),
        ("fphp", 128, "Arm fp16"),
    ),
}


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def flops_per_cycle(flags: set[str], dtype: str) -> tuple[int, str] | None:
    """(FLOP per cycle per core, the instruction set) for `dtype`; None if no flag is known."""
    for table in (HALF.get(dtype, ()), FLOAT32):
        for flag, flops, name in table:
            if flag in flags:
                return flops, name
    return None


def clock_ghz(cpuinfo: str) -> tuple[float, str] | None:
    """The highest clock the host reports -> (GHz, where from): the cores' maximum (turbo) clock
    where cpufreq exposes it, else the highest of each core's `cpu MHz` and the rated clock."""
    found = []
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        try:
            with open(path) as f:
                found.append((int(f.read()) / 1e6, "cpufreq maximum"))
        except (OSError, ValueError):
            pass
    if not found:
        mhz = re.findall(r"cpu MHz\s*:\s*([\d.]+)", cpuinfo)
        found += [(float(m) / 1e3, "/proc/cpuinfo cpu MHz") for m in mhz]
        found += [(float(g), "rated") for g in re.findall(r"@\s*([\d.]+)\s*GHz", cpuinfo)]
    return max(found) if found else None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_quota()
    return max(1, min(cores or 1, math.ceil(quota))) if quota else max(1, cores or 1)


def _cgroup_quota() -> float | None:
    """CPUs' worth of time the cgroup allows (v2 cpu.max, or v1's cfs quota); None: no cap."""
    for path, period_path in (
        ("/sys/fs/cgroup/cpu.max", None),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            with open(path) as f:
                fields = f.read().split()
            if period_path:
                with open(period_path) as f:
                    fields.append(f.read().strip())
            quota, period = fields[0], fields[1]
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return int(quota) / int(period)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def fma_peak(dtype: str) -> tuple[float, str] | None:
    """(FLOP/s of this host's usable cores for `dtype`, how it was worked out), or None where the
    flags or the clock cannot be read (then the caller measures)."""
    cpuinfo = _cpuinfo()
    flags_line = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.M)
    clock = clock_ghz(cpuinfo)
    per_cycle = flops_per_cycle(set(flags_line[1].split()), dtype) if flags_line else None
    if clock is None or per_cycle is None:
        return None
    cores, (ghz, clock_from), (flops, isa) = usable_cores(), clock, per_cycle
    return (
        cores * ghz * 1e9 * flops,
        f"CPU FMA peak {cores} core{'s' * (cores > 1)} x {ghz:.2f} GHz ({clock_from}) x {flops}"
        f" FLOP/cycle ({isa}) = {cores * ghz * flops:.0f} GFLOP/s",
    )
