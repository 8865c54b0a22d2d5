"""`--xla-preset gpu|tpu|cpu|none`: recommended XLA flags, set before JAX starts its backend.

XLA reads XLA_FLAGS (and libtpu reads LIBTPU_INIT_ARGS) once, when the first backend is created,
so a preset must be in the environment before that: `python -m train` reads `--xla-preset` from
argv before importing jax; in a notebook call
`os.environ.update(known_preset_flags("gpu", os.environ))` first.
This module must not import jax.

Flags a user already set (same name, any value) are kept as the user wrote them: a preset only
adds what is missing. Every GPU and CPU flag name is checked by tests/test_xla.py against the
installed jaxlib (XLA aborts on an unknown flag), and known_preset_flags leaves out, with a note,
one that a future jaxlib drops; the TPU flags are libtpu's and cannot be checked without a TPU.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

from errors import UserError

MiB = 2**20

# preset -> environment variable -> {flag: (value, why)}
PRESETS: dict[str, dict[str, dict[str, tuple[str, str]]]] = {
    "gpu": {
        "XLA_FLAGS": {
            # Sources: NVIDIA JAX-Toolbox "GPU performance" guide and MaxText's GPU run scripts.
            "--xla_gpu_enable_latency_hiding_scheduler": (
                "true",
                "schedule collectives as async start/done pairs around independent compute",
            ),
            "--xla_gpu_enable_highest_priority_async_stream": (
                "true",
                "give the collective stream priority so compute kernels do not starve it",
            ),
            "--xla_gpu_enable_pipelined_all_gather": (
                "true",
                "FSDP: gather the next layer's weights during the current layer of the scan",
            ),
            "--xla_gpu_enable_pipelined_reduce_scatter": (
                "true",
                "FSDP: reduce-scatter a layer's gradients while the next layer's backward runs",
            ),
            "--xla_gpu_enable_pipelined_all_reduce": (
                "true",
                "data parallel: the same for per-layer gradient all-reduces inside the scan",
            ),
            "--xla_gpu_enable_while_loop_double_buffering": (
                "true",
                "unroll the layer scan by two so pipelined collectives have compute to hide behind",
            ),
            "--xla_gpu_all_reduce_combine_threshold_bytes": (
                str(128 * MiB),
                "bucket small gradient all-reduces into 128 MiB messages (fewer launches)",
            ),
            "--xla_gpu_all_gather_combine_threshold_bytes": (
                str(128 * MiB),
                "bucket FSDP weight all-gathers likewise",
            ),
            "--xla_gpu_reduce_scatter_combine_threshold_bytes": (
                str(64 * MiB),
                "bucket FSDP gradient reduce-scatters (half: their outputs are 1/n of the input)",
            ),
            "--xla_gpu_enable_triton_gemm": (
                "false",
                "cuBLAS(Lt) GEMMs are faster than Triton's for transformer matmul shapes",
            ),
            "--xla_gpu_enable_command_buffer": (
                "",
                "no CUDA graphs: they serialise the async collective streams",
            ),
        }
    },
    "tpu": {
        "LIBTPU_INIT_ARGS": {
            # Source: MaxText's TPU run scripts (LIBTPU_INIT_ARGS for v4/v5p/v6e training).
            "--xla_tpu_enable_data_parallel_all_reduce_opt": (
                "true",
                "overlap the data-parallel gradient all-reduce with the backward pass",
            ),
            "--xla_tpu_data_parallel_opt_different_sized_ops": (
                "true",
                "let that optimisation pipeline all-reduces of different sizes",
            ),
            "--xla_tpu_enable_async_collective_fusion": (
                "true",
                "run fused collectives asynchronously",
            ),
            "--xla_tpu_enable_async_collective_fusion_fuse_all_gather": (
                "true",
                "include all-gathers (FSDP weights) in the async collective fusions",
            ),
            "--xla_tpu_enable_async_collective_fusion_multiple_steps": (
                "true",
                "let an async collective span several compute steps",
            ),
            "--xla_tpu_overlap_compute_collective_tc": (
                "true",
                "overlap collectives with compute on the TensorCore",
            ),
            "--xla_enable_async_all_gather": (
                "true",
                "asynchronous all-gather, so FSDP gathers hide behind compute",
            ),
        }
    },
    # Measured (BENCHMARKS.md): turning Eigen's intra-op threads off on 8 fake devices was no faster
    # (and would halve a 1-device run on 2 cores); nothing else measured helps, so no flags yet.
    "cpu": {"XLA_FLAGS": {}},
    "none": {},
}


def _parse(flags: str) -> list[tuple[str, str | None]]:
    """'--a=1 --b' -> [('--a', '1'), ('--b', None)] (quoted values kept whole)."""
    out = []
    for tok in shlex.split(flags or ""):
        name, eq, value = tok.partition("=")
        out.append((name, value if eq else None))
    return out


def merge(existing: str, preset_flags: Mapping[str, tuple[str, str]]) -> str:
    """Append the preset's flags that `existing` does not set; the user's own flags win."""
    have = {name for name, _ in _parse(existing)}
    added = [f"{name}={value}" for name, (value, _) in preset_flags.items() if name not in have]
    return " ".join(x for x in [existing.strip(), *added] if x)


def apply(preset: str, env: Mapping[str, str]) -> dict[str, str]:
    """-> the environment variables to set for `preset` (merged with what `env` already holds)."""
    if preset not in PRESETS:
        raise UserError(f"--xla-preset: unknown preset '{preset}'; valid: {', '.join(PRESETS)}")
    return {var: merge(env.get(var, ""), flags) for var, flags in PRESETS[preset].items()}


def known_preset_flags(preset: str, environ: MutableMapping[str, str]) -> dict[str, str]:
    """apply(preset, environ) less the preset's XLA_FLAGS that the installed jaxlib does not know,
    each named in a note on stderr: flags come and go between jaxlib releases, and XLA aborts on
    an unknown one. The user's own flags are passed as written."""
    out = apply(preset, environ)
    if "XLA_FLAGS" in out:
        flags = PRESETS[preset]["XLA_FLAGS"]
        unknown = set(unknown_xla_flags([f"{name}={v}" for name, (v, _) in flags.items()], environ))
        for name in sorted(unknown):
            print(
                f"--xla-preset {preset}: this jaxlib does not know {name}; left out",
                file=sys.stderr,
            )
        known = {name: flag for name, flag in flags.items() if name not in unknown}
        out["XLA_FLAGS"] = merge(environ.get("XLA_FLAGS", ""), known)
    return out


def preset_from_argv(argv: list[str]) -> str | None:
    """The value of `--xla-preset X` / `--xla-preset=X` in argv (the last wins), without argparse:
    this runs before jax (and the config module, which imports it) is imported."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--xla-preset":
            if i + 1 >= len(argv):
                raise UserError(f"--xla-preset: expected one of {', '.join(PRESETS)}")
            found = argv[i + 1]
        elif arg.startswith("--xla-preset="):
            found = arg.partition("=")[2]
    return found


def describe(preset: str) -> str:
    """The preset as documentation: one line per flag with its reason."""
    lines = []
    for var, flags in PRESETS[preset].items():
        lines += [f"{var} {name}={value}  # {why}" for name, (value, why) in flags.items()]
    return "\n".join(lines) or "(no flags)"


def apply_argv(argv: list[str], environ) -> str | None:
    """If argv names a preset, merge it into `environ` (os.environ) and return its name.
    Call before anything imports jax: `python -m train` does it first thing."""
    preset = preset_from_argv(argv)
    if preset is not None:
        environ.update(known_preset_flags(preset, environ))
    return preset


# XLA:CPU runs every fake device's program, and the work a program runs concurrently, on one pool
# of max(PJRT_NPROC or NPROC or the core count, devices) threads (counted on jaxlib 0.10: 8 threads
# for 8 devices on 2 cores, 16 with PJRT_NPROC=16), and an in-process collective holds its thread
# until every device arrives. A device that runs two collectives at once (the explicit pipeline
# schedules run a tick's forward and backward layer loops concurrently) can leave another device
# without a thread to reach the collective they all wait for; XLA then aborts after its collective
# timeout. Seen with the MoE step through 1f1b and zb_h1, two test processes at once on 2 cores: 7
# of 8 runs aborted with 8 threads (the rendezvous log: 7 devices wait at one collective-permute
# while the 8th device's only thread waits at its second collective), none of 2 with 16, none of 4
# with 32.
CPU_THREADS_PER_DEVICE = 4
NPROC_VARS = ("PJRT_NPROC", "NPROC")  # what XLA:CPU reads for its pool size, the first set one wins


def cpu_pool_threads(environ: Mapping[str, str], devices: int, cores: int) -> int:
    """The XLA:CPU thread pool a process started with `environ` gets for `devices` fake devices."""
    for var in NPROC_VARS:
        if environ.get(var, "").strip().isdigit():
            return max(int(environ[var]), devices)
    return max(cores, devices)


def cpu_threads_env(environ: Mapping[str, str], devices: int) -> dict[str, str]:
    """PJRT_NPROC for CPU_THREADS_PER_DEVICE threads per fake device, unless the caller set one."""
    if any(environ.get(var) for var in NPROC_VARS):
        return {}
    return {"PJRT_NPROC": str(CPU_THREADS_PER_DEVICE * devices)}


# XLA aborts the process on a flag name it does not know ("Unknown flag in XLA_FLAGS"), and names
# come and go between jaxlib releases (--xla_cpu_use_fusion_emitters is gone in 0.12). No API lists
# the names a jaxlib knows, so a subprocess starts the CPU backend (which parses every XLA flag, the
# GPU ones too) with the flags, and the names it rejects are dropped and the rest tried again. The
# answers are kept in the environment under FLAG_PROBE_VAR, keyed by the interpreter and jaxlib
# version, so that the processes started from this one (test workers, training subprocesses)
# inherit them: the probe runs once per environment.
FLAG_PROBE_VAR = "BRIGADE_XLA_FLAG_PROBE"
_PROBE = "import jax; jax.devices('cpu')"
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")


def flag_name(flag: str) -> str:
    """'--xla_a=1' -> '--xla_a'."""
    return flag.partition("=")[0]


def _probe_key() -> str:
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib = "none"
    return f"{sys.executable} jaxlib=={jaxlib}"


def _cached(environ: Mapping[str, str]) -> dict[str, bool]:
    """name -> known, as recorded in `environ` for this interpreter and jaxlib (else nothing)."""
    try:
        record = json.loads(environ.get(FLAG_PROBE_VAR, ""))
    except ValueError:
        return {}
    if not isinstance(record, dict) or record.get("key") != _probe_key():
        return {}
    return {**dict.fromkeys(record["known"], True), **dict.fromkeys(record["unknown"], False)}


def _probe(flags: list[str], environ: Mapping[str, str]) -> dict[str, bool]:
    """name -> known for the names of `flags`, by starting the CPU backend with them. A start that
    fails for another reason (or hangs) decides nothing more: those names are left out, and
    the process that sets them will show the real error."""
    answers: dict[str, bool] = {}
    left = list(flags)
    while left:
        env = {**environ, "XLA_FLAGS": " ".join(left), "JAX_PLATFORMS": "cpu"}
        try:
            r = subprocess.run(
                [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600
            )
        except subprocess.TimeoutExpired:
            break
        if r.returncode == 0:
            answers.update(dict.fromkeys(map(flag_name, left), True))
            break
        bad = _UNKNOWN.search(r.stderr)
        rejected = {flag_name(tok) for tok in bad.group(1).split()} if bad else set()
        if not rejected & set(map(flag_name, left)):
            break
        answers.update(dict.fromkeys(rejected, False))
        left = [f for f in left if flag_name(f) not in rejected]
    return answers


def unknown_xla_flags(flags: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """The names among `flags` ('--name=value' each) that the installed jaxlib does not know.
    Only names `environ` holds no answer for are probed; the answers are recorded there."""
    answers = _cached(environ)
    ask = [f for f in flags if flag_name(f) not in answers]
    if ask:
        answers.update(_probe(ask, environ))
        environ[FLAG_PROBE_VAR] = json.dumps(
            {
                "key": _probe_key(),
                "known": sorted(n for n, ok in answers.items() if ok),
                "unknown": sorted(n for n, ok in answers.items() if not ok),
            }
        )
    return [flag_name(f) for f in flags if answers.get(flag_name(f)) is False]


def known_xla_flags(flags: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """`flags` less those whose name the installed jaxlib does not know (unknown_xla_flags)."""
    unknown = set(unknown_xla_flags(flags, environ))
    return [f for f in flags if flag_name(f) not in unknown]
