"""What `--model.dtype auto` computes in on CPU: bfloat16 where this host's XLA:CPU multiplies bf16
natively, else float32. Decided on the host and with the jax that runs, never from a figure
measured elsewhere.

Two things must hold for bf16 to be the faster choice on CPU:

- the CPU has bf16 dot-product instructions (x86 `avx512_bf16` or `amx_bf16`, Arm `bf16`): without
  them a bf16 matmul is converted to float32 and back, and only loses;
- this jaxlib's XLA:CPU keeps a bf16 matmul in bf16. Some versions (jaxlib 0.10) rewrite every
  bf16 dot into a float32 one between converts; then bf16 buys nothing but the conversions.
  Checked directly: one small bf16 matmul is compiled and its optimized HLO read (~50 ms, once per
  process), so no version table has to be kept.

Under jaxlib 0.10.2, whose XLA:CPU upcasts, bf16 was no faster than float32 (BENCHMARKS.md,
"Compute dtype on CPU": 0.97, inside the noise).
"""

from __future__ import annotations

import concurrent.futures
import functools
import re

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (AVX-512 / AMX), Arm (FEAT_BF16)


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo `flags` / `Features`); empty elsewhere."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def xla_keeps_bf16_dots() -> bool:
    """Whether this jaxlib's XLA:CPU compiles a bf16 x bf16 matmul as a bf16 dot (True) or
    rewrites it to float32 operands (False)."""
    # in a thread of its own: the caller's mesh context and jit trace are thread-local, and the
    # probe is first asked inside both (a model built in a traced step under its mesh)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hlo = pool.submit(_compiled_bf16_dot).result()
    dots = re.findall(r"= \S+ dot\(([^)]*)\)", hlo)
    operand_types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    # operands named in the dot line, typed by their definitions (fusion parameters included)
    return any(
        all(operand_types.get(o.strip().split(" ")[-1]) == "bf16" for o in d.split(","))
        for d in dots
    )


def _compiled_bf16_dot() -> str:
    """The optimized HLO of a layer's matmul on one CPU device: bf16 in and out (XLA:CPU of jaxlib
    0.10 keeps bf16 operands where the output is float32, and upcasts this one)."""
    import jax
    import jax.numpy as jnp

    # placed on the CPU by its sharding (jit's device= argument is deprecated)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    a = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=cpu)
    return jax.jit(jnp.dot).lower(a, a).compile().as_text()


def choose(flags: frozenset[str], keeps_bf16_dots: bool) -> tuple[str, str]:
    """-> (dtype, why): the rule, on facts detected elsewhere (tests fake them)."""
    have = sorted(set(BF16_FLAGS) & flags)
    if not have:
        return "float32", "auto: this CPU has no bf16 matmul instructions"
    if not keeps_bf16_dots:
        return "float32", "auto: this jaxlib's XLA:CPU computes bf16 matmuls in float32"
    return "bfloat16", f"auto: XLA:CPU multiplies bf16 natively on this CPU ({', '.join(have)})"


@functools.lru_cache(maxsize=1)
def auto() -> tuple[str, str]:
    """(dtype, why) for this host and this jax; detected once per process."""
    flags = cpu_flags()
    if not set(BF16_FLAGS) & flags:  # no need to compile anything
        return choose(flags, False)
    return choose(flags, xla_keeps_bf16_dots())
