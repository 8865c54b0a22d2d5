"""Test setup: 8 fake CPU devices for every test, set before JAX initialises, and one persistent
compilation cache shared by the test processes and the training subprocesses they start."""
import os
import re

# Replace any device count the caller set: the tests are written for exactly 8 devices.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
# LLVM optimisation level 1 in the test processes: 15% less XLA:CPU compile time than the default
# (level 2). Level 0 saves another 20-28% of CPU on the compile-heavy files, but the fitted runs that
# tests/test_sharding.py compares across meshes then drifted one parameter of 4,096 past its
# tolerance (Adam amplifies rounding where a gradient is near zero). The training processes that
# drills start use level 0 (tests/cpu_env.py, tests/test_multiprocess.py): a drill compares runs
# that were compiled alike. A level the caller set in XLA_FLAGS is kept.
_flags += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level=" not in _flags:
    _flags += " --xla_backend_optimization_level=1"
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
