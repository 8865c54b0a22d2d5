"""Test setup: 8 fake CPU devices for every test, set before JAX initialises, and one persistent
compilation cache shared by the test processes and the training subprocesses they start."""
import os
import re

# Replace any device count the caller set: the tests are written for exactly 8 devices.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
# XLA:CPU compile options for the test processes and the training processes they start
# (tests/cpu_env.py), measured on the tiny model's sharded step (data=2,fsdp=2,model=2; fsdp=8):
#   default (LLVM level 2)                         11-15 s compile,  85-110 ms/step
#   --xla_backend_optimization_level=0              9-10 s compile, 215-230 ms/step
#   level 0 + --xla_cpu_use_fusion_emitters=false   3-5 s compile,  175-180 ms/step
# Nearly all of a test is compilation, so the last: the fusions are then emitted by the older
# elemental IR emitter instead of the MLIR fusion pipeline. Same programs, same losses to 1e-6. A
# comparison test compiles both of its sides in one process, alike. Options the caller set in
# XLA_FLAGS are kept.
_flags += " --xla_force_host_platform_device_count=8"
for _option, _value in (("xla_backend_optimization_level", "0"), ("xla_cpu_use_fusion_emitters", "false")):
    if f"--{_option}=" not in _flags:
        _flags += f" --{_option}={_value}"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of a tiny training run is XLA compilation (about 80% of a 3-step run on CPU), and the suite
# compiles the same programs many times: in both workers and in every `python -m train` subprocess
# a crash or restart drill starts. The cache is keyed by the program, the compile options and the
# jax/XLA versions, so a hit is the very executable a fresh compile would produce. Subprocesses
# inherit these variables through os.environ.
_cache_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache_dir)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")


# The longest files first: pytest-xdist's --dist loadfile hands files to the workers in collection
# order, so a long file collected last (the README commands, ~300 s) ran alone at the end while the
# other worker idled.
_FIRST = ("test_readme.py", "test_context.py", "test_multiprocess.py", "test_crash.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))  # stable: the rest keep their order
