"""The environment of a process a test starts: `devices` fake CPU devices, and the suite's other
XLA flags and compilation cache (tests/conftest.py set them in os.environ)."""
import os
import re


def cpu_env(devices: int = 8, **extra: str) -> dict[str, str]:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
            "JAX_PLATFORMS": "cpu", **extra}
