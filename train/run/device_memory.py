"""Memory while the run runs: the devices' own counters, the host's resident set, and the one
line an out-of-memory failure ends with.

Device figures come from `device.memory_stats()` (GPU and TPU allocators keep them); the CPU
backend keeps none, so there they are None ("unavailable"; a metrics record leaves them out)
rather than a guess. The host's resident set is read from /proc/self/statm where it exists
(Linux), else left out too.
"""

from __future__ import annotations

import contextlib
import os

from errors import UserError

GiB = 1024**3

MEMORY_FIELDS = ("mem_bytes_in_use", "mem_peak_bytes", "host_rss_bytes")


def _largest(stats: list[dict], key: str) -> int | None:
    values = [s[key] for s in stats if isinstance(s.get(key), int)]
    return max(values) if values else None


def figures(devices: list) -> dict:
    """This process's memory: bytes in use and the peak since start on its fullest device (None
    where the backend keeps no counters), and the host process's resident set (None off Linux)."""
    stats = [s for s in (d.memory_stats() for d in devices) if s]
    return {
        "mem_bytes_in_use": _largest(stats, "bytes_in_use"),
        "mem_peak_bytes": _largest(stats, "peak_bytes_in_use"),
        "mem_limit_bytes": _largest(stats, "bytes_limit"),
        "host_rss_bytes": host_rss_bytes(),
    }


def host_rss_bytes() -> int | None:
    """The resident set of this process now (not its peak), from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def size_text(n: int | None) -> str:
    if n is None:
        return "unavailable"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def is_out_of_memory(e: BaseException) -> bool:
    """XLA's allocation failure, at compile time or in a step: a JaxRuntimeError
    RESOURCE_EXHAUSTED."""
    # here, not at the top: `python -m train report` formats sizes with this module, without JAX
    import jax

    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


@contextlib.contextmanager
def out_of_memory_line(predicted_peak, devices: list, where):
    """Turn an out-of-memory failure inside into one line (UserError, exit 2: the same command
    would fail again) with the compiled step's predicted peak per device (`predicted_peak()`:
    bytes or None), what the devices measured, and the flags that lower it; `where()` says what
    the run was doing."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  (anything else passes through unchanged)
        if not is_out_of_memory(e):
            raise
        now = figures(devices)
        first = str(e).strip().splitlines()[0][:160]
        raise UserError(
            f"out of device memory (last activity: {where()}): {first}; the compiled step needs"
            f" ~{size_text(predicted_peak())} per device (predicted), measured peak"
            f" {size_text(now['mem_peak_bytes'])} of {size_text(now['mem_limit_bytes'])} per"
            " device; recompute activations (--model.remat full), shard the state over more"
            " devices (--mesh fsdp=N), split the batch (--micro-batches N) or use a smaller"
            " --batch-size"
        ) from None
