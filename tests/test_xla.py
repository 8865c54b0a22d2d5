"""mesh/xla.py: XLA flag presets are accepted by the installed XLA and never override user flags."""

import json
import os
import subprocess
import sys

import pytest
from cpu_env import cpu_env

from errors import UserError
from mesh import xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JIT = (
    "import jax, jax.numpy as jnp;"
    " print(float(jax.jit(lambda x: (x @ x).sum())(jnp.ones((64, 64)))))"
)


def run_python(code: str, xla_flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_installed_xla_accepts_the_preset(preset):
    """XLA aborts at backend start on an unknown flag name, and the CPU build parses the GPU flags
    too, so this checks every GPU flag name against the installed jaxlib."""
    flags = xla.apply(preset, {})["XLA_FLAGS"]
    r = run_python(JIT, flags)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "262144.0"


def test_unknown_flag_is_rejected_so_the_check_above_can_fail():
    r = run_python(JIT, "--xla_gpu_enable_no_such_thing=true")
    assert r.returncode != 0 and "Unknown flag" in r.stderr


def test_merge_keeps_user_flags_and_adds_the_rest():
    user = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d"
    out = xla.apply("gpu", {"XLA_FLAGS": user})["XLA_FLAGS"]
    names = [tok.partition("=")[0] for tok in out.split()]
    assert out.startswith(user)  # the user's text, untouched, first
    assert len(names) == len(set(names))  # nothing duplicated
    assert "--xla_gpu_enable_triton_gemm=false" not in out  # the user's value wins
    assert set(xla.PRESETS["gpu"]["XLA_FLAGS"]) <= set(names)  # everything else added
    assert xla.apply("gpu", {"XLA_FLAGS": out})["XLA_FLAGS"] == out  # idempotent
    tpu = xla.apply("tpu", {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"})
    assert (
        set(tpu) == {"LIBTPU_INIT_ARGS"}
        and "--xla_enable_async_all_gather=true" not in tpu["LIBTPU_INIT_ARGS"]
    )
    assert xla.apply("none", {"XLA_FLAGS": user}) == {}
    # an empty value (=) is a value: the flag is set to the empty string
    assert "--xla_gpu_enable_command_buffer=" in out.split()


def test_every_flag_says_why():
    for preset in xla.PRESETS:
        for flags in xla.PRESETS[preset].values():
            for name, (value, why) in flags.items():
                assert name.startswith("--xla_") and isinstance(value, str) and len(why) > 20
    assert "# " in xla.describe("gpu")


def test_preset_from_argv_and_errors():
    assert xla.preset_from_argv(["--steps", "3", "--xla-preset", "gpu"]) == "gpu"
    assert xla.preset_from_argv(["--xla-preset=tpu"]) == "tpu"
    assert xla.preset_from_argv(["plan", "--model", "tiny"]) is None
    with pytest.raises(
        UserError, match=r"--xla-preset: unknown preset 'fast'; valid: gpu, tpu, cpu, none"
    ):
        xla.apply("fast", {})
    with pytest.raises(UserError, match="--xla-preset: expected one of"):
        xla.preset_from_argv(["--xla-preset"])


def test_apply_argv_sets_flags_before_jax_starts():
    """What `python -m train` does first: the flags reach XLA (a GPU flag set this way is parsed by
    the backend, which would abort on a bad name) and the user's own flags stay."""
    code = (
        "import os, sys; from mesh.xla import apply_argv; "
        "assert 'jax' not in sys.modules; "
        "apply_argv(['--xla-preset', 'gpu'], os.environ); "
        + JIT
        + "; print(os.environ['XLA_FLAGS'])"
    )
    r = run_python(code, "--xla_force_host_platform_device_count=2")
    assert r.returncode == 0, r.stderr[-2000:]
    flags = r.stdout.splitlines()[-1]
    assert flags.startswith("--xla_force_host_platform_device_count=2 ")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags


def test_cli_applies_the_preset():
    """`python -m train ... --xla-preset NAME`: a bad name is one line and exit 2; a good one
    runs."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    bad = subprocess.run(
        [sys.executable, "-m", "train", "plan", "--xla-preset", "fast"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --xla-preset: unknown preset 'fast'; valid: gpu, tpu, cpu, none"
    ]
    # the search starts the CPU backend (which parses every GPU flag) but compiles nothing
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "plan",
            "--xla-preset",
            "gpu",
            "--model",
            "tiny",
            "--batch-size",
            "16",
            "--seq-len",
            "32",
            "--search",
            "8",
            "--hardware",
            "h100",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith("search: ")


POOL = (
    "import os, jax, jax.numpy as jnp;"
    " jax.pmap(lambda a: jax.lax.psum(a, 'i'), axis_name='i')(jnp.ones(8)).block_until_ready();"
    " print(sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'tf_XLAEigen'"
    " for t in os.listdir('/proc/self/task')))"
)


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc"
)
@pytest.mark.parametrize("nproc", [None, "16", "3"])
def test_cpu_pool_threads_counts_the_threads_xla_starts(nproc):
    """cpu_pool_threads is the size of the pool the installed XLA:CPU really starts for 8 fake
    devices (the MoE pipeline check in models/pipeline/explicit.py relies on it)."""
    env = {k: v for k, v in os.environ.items() if k not in xla.NPROC_VARS}
    env.update(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"},
        **({"PJRT_NPROC": nproc} if nproc else {}),
    )
    r = subprocess.run(
        [sys.executable, "-c", POOL], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) == xla.cpu_pool_threads(env, 8, os.cpu_count()), r.stdout
    assert xla.cpu_threads_env({}, 8) == {"PJRT_NPROC": str(8 * xla.CPU_THREADS_PER_DEVICE)}
    assert xla.cpu_threads_env({"NPROC": "3"}, 8) == {}  # the caller's choice is kept


def no_subprocess(*a, **k):
    raise AssertionError("probed again")


def test_probe_tells_unknown_flag_names_and_records_the_answer(monkeypatch):
    """The probe starts the installed jaxlib's CPU backend: a name it rejects is unknown, a name it
    parses is known; the answers go into the environment, so a second ask starts nothing."""
    environ = {}
    flags = [
        "--xla_backend_optimization_level=0",
        "--xla_gpu_enable_no_such_thing=true",
        "--xla_cpu_no_such_either=1",
    ]
    assert xla.unknown_xla_flags(flags, environ) == [
        "--xla_gpu_enable_no_such_thing",
        "--xla_cpu_no_such_either",
    ]
    assert xla.known_xla_flags(flags, environ) == ["--xla_backend_optimization_level=0"]

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    child = dict(environ)  # what a process started from this one inherits
    assert xla.known_xla_flags(flags, child) == ["--xla_backend_optimization_level=0"]
    # another interpreter or jaxlib does not trust the record
    stale = {xla.FLAG_PROBE_VAR: environ[xla.FLAG_PROBE_VAR].replace("jaxlib==", "jaxlib==0.0.")}
    with pytest.raises(AssertionError, match="probed again"):
        xla.unknown_xla_flags(flags, stale)


def test_preset_flag_unknown_to_this_jaxlib_is_left_out_with_a_note(monkeypatch, capsys):
    """`--xla-preset gpu` on a jaxlib that dropped one of its names (here: recorded as unknown)
    runs without it and says so, instead of XLA aborting; the user's flags stay as written."""
    names = list(xla.PRESETS["gpu"]["XLA_FLAGS"])
    gone = "--xla_gpu_enable_pipelined_all_reduce"
    record = {"key": xla._probe_key(), "known": [n for n in names if n != gone], "unknown": [gone]}
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d", xla.FLAG_PROBE_VAR: json.dumps(record)}
    monkeypatch.setattr(subprocess, "run", no_subprocess)  # answered from the record
    assert xla.apply_argv(["--xla-preset", "gpu"], environ) == "gpu"
    flags = environ["XLA_FLAGS"]
    assert flags.startswith("--xla_dump_to=/tmp/d ") and gone not in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert capsys.readouterr().err.splitlines() == [
        f"--xla-preset gpu: this jaxlib does not know {gone}; left out"
    ]


def test_suite_compile_options_are_known_to_this_jaxlib():
    """tests/cpu_env.py passes only compile options the installed jaxlib knows (jaxlib 0.12 dropped
    --xla_cpu_use_fusion_emitters, and XLA aborts on an unknown flag)."""
    r = run_python(JIT, cpu_env(2)["XLA_FLAGS"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "262144.0"
