"""The GPU sweep's environment (benchmarks/gpu.py): the XLA flags the installed jaxlib accepts,
and the versions and device recorded beside the results.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from gpu_run import say

from mesh.xla import known_xla_flags, unknown_xla_flags


def drop_unknown_xla_flags() -> None:
    """An unknown flag in XLA_FLAGS aborts every jax process, and flags come and go between
    jaxlib releases: drop the ones the installed jaxlib rejects (probed on CPU, mesh/xla.py)."""
    flags = os.environ["XLA_FLAGS"].split()
    for name in unknown_xla_flags(flags, os.environ):
        say(f"dropping XLA flag unknown to this jaxlib: {name}")
    os.environ["XLA_FLAGS"] = " ".join(known_xla_flags(flags, os.environ))


def environment() -> dict:
    info = {
        "xla_flags": os.environ["XLA_FLAGS"],
        "mem_fraction": os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
        "python": sys.version.split()[0],
    }
    info["packages"] = {
        d.metadata["Name"]: d.version
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith(("jax", "flax", "optax"))
    }
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["gpu"] = f"unknown ({e})"
    return info
