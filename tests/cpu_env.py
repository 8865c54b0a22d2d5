"""The environment of a process a test starts: `devices` fake CPU devices, LLVM optimisation
level 0 (XLA:CPU compiles the tiny model's step in 5.5 s instead of 9.5 s; the processes a drill
compares are all compiled alike), and the suite's compilation cache (tests/conftest.py)."""
import os
import re


def cpu_env(devices: int = 8, **extra: str) -> dict[str, str]:
    flags = re.sub(r"--xla_(force_host_platform_device_count|backend_optimization_level)=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    flags += f" --xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu", **extra}
