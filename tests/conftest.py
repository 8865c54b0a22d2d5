"""Test setup: 8 fake CPU devices for every test, set before JAX initialises."""
import os
import re

# Replace any device count the caller set: the tests are written for exactly 8 devices.
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
