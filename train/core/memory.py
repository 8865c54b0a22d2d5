"""Will the step fit? The compiled step's per-device memory against what this machine has.

Checked before the train state is allocated: a model too large for the host would otherwise be
killed by the OS (or die in the allocator) with nothing said. The figure is the compiled step's
own (XLA's memory analysis, the same that `plan` reports), so the check costs nothing beyond
the compile the run needs anyway.
"""

from __future__ import annotations

import jax

from errors import UserError

GiB = 1024**3


def step_bytes_per_device(compiled) -> dict[str, int]:
    """Per-device bytes of one compiled step: its arguments (state + batch), outputs, temporaries,
    and the peak (XLA's when it reports one that holds the arguments and temporaries, else
    arguments + outputs - aliased + temporaries). XLA:CPU reports a peak without the temporaries
    (the default model at 32k tokens on context=8: 5.3 MiB against 829 MiB of temporaries)."""
    m = compiled.memory_analysis()
    if m is None:  # a backend without memory analysis
        return {}
    out = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
    }
    peak = getattr(m, "peak_memory_in_bytes", 0)
    whole = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["peak"] = peak if peak >= out["argument"] + out["temp"] else whole
    return out


def available_bytes(devices: list) -> tuple[int, str]:
    """(bytes one device may use, what the figure is). CPU devices share the host's RAM, so each
    gets an equal part of what is available now; accelerators report their own limit."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    if local[0].platform == "cpu":
        free = _host_available()
        return free // len(local), f"{_size(free)} of host RAM available / {len(local)} CPU devices"
    limits = [(d.memory_stats() or {}).get("bytes_limit", 0) for d in local]
    if not all(limits):
        return 0, "device memory limit unknown"
    return min(limits), f"{_size(min(limits))} per {local[0].device_kind}"


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def _host_available() -> int:
    """MemAvailable (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(compiled, devices: list, mesh_text: str) -> None:
    """UserError with the estimate and the flags that would help when the step's peak per device
    exceeds what a device (or its share of host RAM) has; silent when either figure is unknown."""
    need = step_bytes_per_device(compiled)
    have, what = available_bytes(devices)
    if not need or not have or need["peak"] <= have:
        return
    raise UserError(
        f"the step needs ~{_size(need['peak'])} per device (state and batch"
        f" {_size(need['argument'])}, temporaries {_size(need['temp'])}) on mesh {mesh_text}, more"
        f" than the {_size(have)} each device has ({what}); shard the state over more devices"
        " (--mesh fsdp=N), recompute activations (--model.remat full), use a smaller --batch-size"
        " or more --micro-batches, or pass --train.skip_memory_check true to try anyway"
    )


HOST_KIND = "pinned_host"  # the memory kind offloaded activations and optimizer state live in


def check_host_offload(cfg, devices: list) -> None:
    """One line for what would keep arrays in host memory (an offloading remat policy,
    --train.offload_optimizer) on devices without one to keep them in."""
    wants = [f"--model.remat {cfg.model.remat}"] if cfg.model.remat.endswith("_offload") else []
    if cfg.train.offload_optimizer:
        wants.append("--train.offload_optimizer true")
    kinds = {m.kind for m in devices[0].addressable_memories()}
    if wants and HOST_KIND not in kinds:
        raise UserError(
            f"{' and '.join(wants)} keeps arrays in '{HOST_KIND}' memory, which these"
            f" {devices[0].platform} devices do not have (theirs: {', '.join(sorted(kinds))});"
            " valid here: --model.remat none|full|dots, --train.offload_optimizer false"
        )
