"""What a device can compute, for MFU and the cost model: the dense peak FLOP/s of the accelerators
(a datasheet table matched against `device_kind`), and on a CPU host its cores' FMA peak.

The CPU's figure is the fused multiply-adds its cores can issue per cycle (from the instruction
sets /proc/cpuinfo lists), times their clock, times the cores this process may run on. A datasheet
figure, as the GPU table's are, not a measurement: a matmul timed at start-up measured whatever
else the machine was doing at that moment, and on a loaded machine printed MFUs of 139-238%. This
figure does not move with the load, and is an upper bound: it assumes two FMA pipes of the widest
vectors the cores declare and their highest clock the host reports, so MFU stays under 100% unless
the host hides a faster clock (train/run/metrics.py StepStats then raises the peak to what the
step achieved and says so). Where the flags or the clock cannot be read, the fastest matmul
measured stands in.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import re
import time

import jax
import jax.numpy as jnp

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


# Dense peak TFLOP/s per device (no sparsity), by compute dtype; matched against device_kind.
PEAK_TFLOPS = {
    "h200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
    "h100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},  # SXM; PCIe is 756
    "a100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "l4": {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3},
    "mi300x": {"bfloat16": 1307.0, "float16": 1307.0, "float32": 163.4},
    "tpu v4": {"bfloat16": 275.0, "float32": 275.0},
    "tpu v5 lite": {"bfloat16": 197.0, "float32": 197.0},  # v5e
    "tpu v5p": {"bfloat16": 459.0, "float32": 459.0},
    "tpu v5": {"bfloat16": 459.0, "float32": 459.0},
    "tpu v6": {"bfloat16": 918.0, "float32": 918.0},  # Trillium
}


@functools.lru_cache(maxsize=4)
def measured_host_flops(dtype: str, n: int = 1024, seconds: float = 0.3) -> float:
    """Achievable matmul FLOP/s of this host's CPU cores (all of them, through XLA:CPU): the
    fastest of the matmuls timed in `seconds`, the one least slowed by other work."""
    dev = jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), dev)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best, t_end = math.inf, time.perf_counter() + seconds
    while time.perf_counter() < t_end or best == math.inf:
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(
    dtype: str, override_tflops: float = 0.0, devices: list | None = None
) -> tuple[float, str]:
    """-> (peak FLOP/s of `devices`, the mesh's (default: all), and where the figure came from).

    CPU fake devices share the host's cores, so their peak is the host's (per process that holds
    some of them), not a multiple of the device count: its cores' FMA peak (fma_peak), or
    where the CPU's flags or clock cannot be read, its fastest measured matmul."""
    devices = list(devices) if devices is not None else jax.devices()
    if override_tflops > 0:
        return override_tflops * 1e12 * len(
            devices
        ), f"--peak-tflops {override_tflops} x {len(devices)}"
    kind = devices[0].device_kind.lower()
    if devices[0].platform == "cpu":
        hosts = len({d.process_index for d in devices})
        datasheet = fma_peak(dtype)
        if datasheet is not None:
            return datasheet[0] * hosts, f"{datasheet[1]} per host"
        per_host = measured_host_flops(dtype)
        return (
            per_host * hosts,
            f"fastest measured CPU matmul {per_host / 1e9:.0f} GFLOP/s per host",
        )
    for name, table in PEAK_TFLOPS.items():
        if name in kind:
            tf = table.get(dtype, table["bfloat16"])
            return tf * 1e12 * len(
                devices
            ), f"{devices[0].device_kind}: {tf:g} TFLOP/s x {len(devices)}"
    return 0.0, f"unknown device '{devices[0].device_kind}': pass --peak-tflops for MFU"
