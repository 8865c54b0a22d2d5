"""Test setup: 8 fake CPU devices for every test, set before JAX initialises, and one persistent
compilation cache shared by the test processes and the training subprocesses they start."""

import os

from cpu_env import xla_flags

from mesh.xla import cpu_threads_env

# Exactly 8 fake devices, replacing any count the caller set: the tests are written for 8. The
# suite's compile options (tests/cpu_env.py, 3x faster compiles); ones the caller set are kept.
os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), 8, keep_set=True)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Threads enough for the explicit pipeline schedules' concurrent collectives (mesh/xla.py)
os.environ.update(cpu_threads_env(os.environ, 8))
# Most of a tiny training run is XLA compilation (about 80% of a 3-step run on CPU), and the suite
# compiles the same programs many times: in both workers and in every `python -m train` subprocess
# a crash or restart drill starts. The cache is keyed by the program, the compile options and the
# jax/XLA versions, so a hit is the very executable a fresh compile would produce. Subprocesses
# inherit these variables through os.environ.
_cache_dir = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"
)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache_dir)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the settings above: JAX reads them when it is imported)

jax.config.update("jax_platforms", "cpu")


# The longest files first (the longest-processing-time rule): pytest-xdist's --dist loadfile hands
# files to the workers in collection order, so a long file collected last (the README commands,
# ~300 s) ran alone at the end while the other worker idled. Ordered by a full run's per-file time.
_FIRST = (
    "test_readme.py",
    "test_context.py",
    "test_equivalence_pipeline.py",
    "test_equivalence_schedules.py",
    "test_multiprocess.py",
    "test_pipeline_explicit.py",
    "test_resilience.py",
    "test_pipeline.py",
    "test_checkpoint.py",
    "test_moe.py",
    "test_crash.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    # stable: the rest keep their order
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))
