"""Test setup: 8 fake CPU devices for every test, set before JAX initialises, and one persistent
compilation cache shared by the test processes and the training subprocesses they start."""
import os
import re

# Replace any device count the caller set: the tests are written for exactly 8 devices.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
# LLVM optimisation level 0 in the test processes, as in the training processes that drills start
# (tests/cpu_env.py): XLA:CPU compiles the tiny train step about a third faster than at level 1, and
# compiling is most of the suite (CPU time of tests/test_moe.py 26% less, test_comm.py 19%). The programs the
# cross-mesh equivalence tests compare are compiled at level 1 (tests/equivalence.py), where their
# float32 tolerances were set. A level the caller set in XLA_FLAGS is kept.
_flags += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level=" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
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
