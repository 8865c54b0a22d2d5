"""Hardware profiles for the cost model (`plan --hardware NAME`, `plan --search N`).

Conventions (every figure below follows them):
  * FLOP/s are dense (no 2:4 sparsity), per device, by compute dtype.
  * Link bandwidths are bytes/s per device in ONE direction. Vendors quote NVLink bidirectional
    (H100: "900 GB/s" = 450 GB/s each way) and InfiniBand in bits per port per direction
    (NDR "400 Gb/s" = 50 GB/s each way). A ring collective sends and receives at the same time, so
    the time of a ring step is its bytes sent / the one-way bandwidth: the nccl-tests
    "bus bandwidth" convention (an 8x H100 NVLink all-reduce peaks near 450 GB/s busbw).
  * A "node" is the fast-link domain: the 8 GPUs of an NVLink/NVSwitch server, or a TPU slice
    (ICI). Mesh axes that fit inside it use `intra_bw`; axes that cross it use `inter_bw`.
  * Achievable fractions: large GEMMs reach about 70% of dense peak, large collectives about 80%
    of link peak (NCCL tests on DGX H100 report ~360-390 GB/s all-reduce busbw over NVLink, ~45 GB/s
    per 400 Gb/s NDR port). They are model parameters, stated here, not measurements of this code.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from errors import UserError

GB = 1e9
MIB = 2**20
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict  # dense TFLOP/s per device, by compute dtype
    hbm_bytes: float  # device memory
    hbm_bw: float  # bytes/s, device memory bandwidth (the roofline's memory term)
    intra_bw: float  # bytes/s one direction per device, inside a node (NVLink / ICI)
    inter_bw: float  # bytes/s one direction per device, across nodes (InfiniBand / DCN)
    devices_per_node: int
    intra_latency_s: float = 5e-6  # per ring step (NCCL over NVLink: a few microseconds)
    inter_latency_s: float = 1e-5  # per ring step across IB (switch hops + NIC)
    compute_efficiency: float = 0.7  # achievable share of dense peak for large matmuls
    link_efficiency: float = 0.8  # achievable share of link peak for large collectives
    # achievable share of HBM peak for streaming kernels (STREAM-like copies)
    memory_efficiency: float = 0.8
    # memory traffic hides under math (roofline max) rather than adds to it
    memory_overlap: bool = True
    # XLA_PYTHON_CLIENT_MEM_FRACTION-style headroom (CUDA context, NCCL buffers)
    usable_memory: float = 0.9
    # device->host copy (PCIe), bytes/s: what an async checkpoint save blocks on
    host_bw: float = 25 * GB
    # bytes/s per device to shared storage (assumption: ~8 GB/s per 8-GPU node)
    ckpt_write_bw: float = 1 * GB
    # collectives run asynchronously next to compute (latency-hiding scheduler)
    overlap: bool = True
    fused_attention: bool = True  # flash attention: no [B,N,T,T] scores kept in memory
    platform: str = "gpu"  # the JAX platform: picks the compute dtype (models.config 'auto')
    note: str = ""

    def peak_flops(self, dtype: str) -> float:
        return self.peak_tflops.get(dtype, self.peak_tflops["bfloat16"]) * 1e12


def _table() -> dict[str, Hardware]:
    # One table on purpose (~60 lines): a profile per entry, each under its datasheet's figures;
    # split, the figures would sit apart from their sources.
    from mesh.devices import PEAK_TFLOPS  # the loop's MFU table: one source for peak FLOP/s

    return {
        # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 67 FP32,
        # 80 GB HBM3 (nvidia-smi: 81,559 MiB) at 3.35 TB/s, NVLink 4 900 GB/s bidirectional, PCIe
        # Gen5 x16 (64 GB/s each way). DGX H100: 8 GPUs/node, one ConnectX-7 400 Gb/s NDR InfiniBand
        # port per GPU.
        "h100": Hardware(
            "H100-SXM",
            PEAK_TFLOPS["h100"],
            81559 * MIB,
            3.35e12,
            450 * GB,
            50 * GB,
            8,
            note="8 GPUs/node, NVLink 900 GB/s bidir, 400 Gb/s NDR IB per GPU",
        ),
        # NVIDIA H200 SXM datasheet: same compute as H100, 141 GB HBM3e (nvidia-smi: 143,771 MiB) at
        # 4.8 TB/s, NVLink 900 GB/s.
        "h200": Hardware(
            "H200-SXM",
            PEAK_TFLOPS["h200"],
            143771 * MIB,
            4.8e12,
            450 * GB,
            50 * GB,
            8,
            note="8 GPUs/node, NVLink 900 GB/s bidir, 400 Gb/s NDR IB per GPU",
        ),
        # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s BF16 dense, 19.5 FP32, 2,039 GB/s HBM2e,
        # NVLink 3 600 GB/s bidirectional; nvidia-smi: 81,920 MiB. DGX A100: 8 GPUs, 200 Gb/s HDR IB
        # per GPU. PCIe Gen4.
        "a100": Hardware(
            "A100-SXM-80GB",
            PEAK_TFLOPS["a100"],
            81920 * MIB,
            2.039e12,
            300 * GB,
            25 * GB,
            8,
            host_bw=16 * GB,
            note="8 GPUs/node, NVLink 600 GB/s bidir, 200 Gb/s HDR IB per GPU",
        ),
        # Google Cloud TPU v5p: 459 TFLOP/s BF16, 95 GB HBM2e at 2,765 GB/s, ICI 4,800 Gb/s per chip
        # (600 GB/s, counted here as 300 GB/s each way), 3D torus, one pod = 8,960 chips on ICI.
        # Across slices (DCN, --mesh-dcn) we assume 100 Gb/s per chip (4-chip hosts): an assumption,
        # not a datasheet figure. A ring over one torus axis uses fewer links than the chip has, so
        # intra_bw is optimistic for 1-D collectives on a 3-D torus.
        "tpu-v5p": Hardware(
            "TPU-v5p",
            PEAK_TFLOPS["tpu v5p"],
            95 * GB,
            2.765e12,
            300 * GB,
            12.5 * GB,
            8960,
            platform="tpu",
            note="ICI 4,800 Gb/s per chip inside a slice (pod up to 8,960 chips),"
            " DCN between slices",
        ),
    }


PROFILES = ("h100", "h200", "a100", "tpu-v5p", "cpu")


@functools.lru_cache(maxsize=2)
def measured_memory_bw(n_bytes: int = 64 * 2**20, seconds: float = 0.3) -> float:
    """Bytes accessed per second (reads + writes, XLA cost analysis's unit) of this host's memory,
    the roofline's memory ceiling, measured the way mesh.devices measures the matmul ceiling: an
    XLA elementwise op streaming a large array split over every local device at once (fake CPU
    devices run side by side and share the bus, as they do in the train step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.local_devices()
    n = n_bytes // 4 // len(devices) * len(devices)
    a = jax.device_put(
        jnp.ones((n,), jnp.float32),
        NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d")),
    )
    f = jax.jit(lambda x: x * 1.5 + 1.0)
    f(a).block_until_ready()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f(a).block_until_ready()
        reps += 1
    return 2 * 4 * n * reps / (time.perf_counter() - t0)


@functools.lru_cache(maxsize=2)
def measured_copy_bw(n_bytes: int = 64 * 2**20) -> float:
    """Bytes/s of a large host memory copy: what XLA:CPU's in-process collectives are made of."""
    import numpy as np

    a = np.ones(n_bytes // 4, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best


def cpu_profile(n_devices: int, dtype: str = "float32") -> Hardware:
    """This host, split into `n_devices` fake devices
    (XLA_FLAGS=--xla_force_host_platform_device_count): they share the cores and the memory bus, so
    each gets 1/n of the measured matmul rate, memory bandwidth and copy bandwidth. XLA:CPU runs
    collectives synchronously and its ops one after another: no overlap of communication or of
    memory traffic with compute."""
    import os

    from mesh.devices import measured_host_flops

    flops = measured_host_flops(dtype)
    bw = measured_copy_bw()
    mem_bw = measured_memory_bw()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16 * GIB
    per = 1e-12 / n_devices
    return Hardware(
        "CPU (this host)",
        {"float32": flops * per, "bfloat16": measured_host_flops("bfloat16") * per},
        mem / n_devices,
        mem_bw / n_devices,
        bw / n_devices,
        bw / n_devices,
        n_devices,
        intra_latency_s=2e-5,
        inter_latency_s=2e-5,
        # the peak is already a measured matmul rate, not a datasheet figure
        compute_efficiency=1.0,
        link_efficiency=1.0,
        memory_efficiency=1.0,
        memory_overlap=False,
        usable_memory=0.8,
        host_bw=bw,
        ckpt_write_bw=bw / n_devices,
        overlap=False,
        fused_attention=False,
        platform="cpu",
        note=f"measured: {flops / 1e9:.0f} GFLOP/s {dtype} matmul, {mem_bw / 1e9:.1f} GB/s streamed"
        f" (read + write), {bw / 1e9:.1f} GB/s copy,"
        f" shared by {n_devices} fake devices",
    )


def _key(name: str) -> str:
    key = (name or "").lower().removesuffix("-sxm")
    return {"v5p": "tpu-v5p", "tpuv5p": "tpu-v5p"}.get(key, key)


def platform_of(name: str) -> str:
    """The backend a profile stands for ('cpu', 'gpu', 'tpu'), without measuring anything."""
    return "cpu" if _key(name) == "cpu" else get(name).platform


def get(name: str, n_devices: int = 1, dtype: str = "float32") -> Hardware:
    """A profile by name (case-insensitive; 'H100-SXM' and 'h100' both work)."""
    key = _key(name)
    if key == "cpu":
        return cpu_profile(n_devices, dtype)
    table = _table()
    if key not in table:
        raise UserError(f"--hardware: unknown hardware '{name}'; valid: {', '.join(PROFILES)}")
    return table[key]
