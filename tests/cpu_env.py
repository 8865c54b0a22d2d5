"""The environment of a process a test starts: `devices` fake CPU devices, the suite's XLA:CPU
compile options (tests/conftest.py: LLVM level 0, the elemental fusion emitter; 3x faster compiles,
and the processes a drill compares are all compiled alike) and its compilation cache."""
import os
import re


def cpu_env(devices: int = 8, **extra: str) -> dict[str, str]:
    flags = re.sub(r"--xla_(force_host_platform_device_count|backend_optimization_level|cpu_use_fusion_emitters)=\S+",
                   "", os.environ.get("XLA_FLAGS", ""))
    flags += (f" --xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
              " --xla_cpu_use_fusion_emitters=false")
    return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu", **extra}
