"""The environment of a process a test starts: `devices` fake CPU devices, the suite's XLA:CPU
compile options (the processes a drill compares are all compiled alike) and its compilation cache
(tests/conftest.py)."""

import os
import re

from mesh.xla import unknown_xla_flags

# XLA:CPU compile options of the test processes and the training processes they start, measured on
# the tiny model's sharded step (data=2,fsdp=2,model=2; fsdp=8):
#   default (LLVM level 2)                         11-15 s compile,  85-110 ms/step
#   --xla_backend_optimization_level=0              9-10 s compile, 215-230 ms/step
#   level 0 + --xla_cpu_use_fusion_emitters=false   3-5 s compile,  175-180 ms/step
# Nearly all of a test is compilation, so the last: the fusions are then emitted by the older
# elemental IR emitter instead of the MLIR fusion pipeline. Same programs, same losses to 1e-6. A
# comparison test compiles both of its sides in one process, alike.
_WANTED = (
    ("xla_backend_optimization_level", "0"),
    ("xla_cpu_use_fusion_emitters", "false"),
)
# Only the options the installed jaxlib knows: XLA aborts on an unknown flag name (probed once per
# environment, mesh/xla.py).
_UNKNOWN = unknown_xla_flags([f"--{o}={v}" for o, v in _WANTED], os.environ)
COMPILE_OPTIONS = tuple((o, v) for o, v in _WANTED if f"--{o}" not in _UNKNOWN)


def xla_flags(flags: str, devices: int, keep_set: bool = False) -> str:
    """`flags` with exactly `devices` fake CPU devices and COMPILE_OPTIONS; `keep_set`: a compile
    option that `flags` already sets keeps its value."""
    names = ["xla_force_host_platform_device_count"] + (
        [] if keep_set else [o for o, _ in COMPILE_OPTIONS]
    )
    flags = (
        re.sub(rf"--({'|'.join(names)})=\S+", "", flags)
        + f" --xla_force_host_platform_device_count={devices}"
    )
    flags += "".join(f" --{o}={v}" for o, v in COMPILE_OPTIONS if f"--{o}=" not in flags)
    return " ".join(flags.split())


def cpu_env(devices: int = 8, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": xla_flags(os.environ.get("XLA_FLAGS", ""), devices),
        "JAX_PLATFORMS": "cpu",
        **extra,
    }
