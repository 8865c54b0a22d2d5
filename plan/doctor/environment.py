"""The doctor's checks of the environment: JAX, jaxlib and plugin versions (within a process and
across the job's), the XLA flags (an unknown one makes XLA abort the process at start), the
platform and device kind against what the installed plugins and --hardware expect, and the
same device count on every host."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

from plan.doctor.report import Check, fail, ok, warn

# distributions that plug a backend into jaxlib: they must be jaxlib's own version
PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
PLUGINS += ("jax-rocm-plugin", "jax-rocm-pjrt", "libtpu")
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.+)")
_probed: dict[str, str] = {}  # XLA_FLAGS -> XLA's complaint ('' for none), once per process


def versions() -> dict[str, str]:
    """jax, jaxlib and every installed backend plugin -> its version."""
    out = {}
    for name in ("jax", "jaxlib", *PLUGINS):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def version_checks(found: dict[str, str]) -> Check:
    jax, jaxlib = found.get("jax", "?"), found.get("jaxlib", "?")
    plugins = {k: v for k, v in found.items() if k not in ("jax", "jaxlib")}
    odd = {
        k: v
        for k, v in plugins.items()
        if k != "libtpu" and v.split("+")[0] != jaxlib.split("+")[0]
    }
    listed = ", ".join(f"{k} {v}" for k, v in plugins.items()) or "no backend plugins"
    if jax.split(".")[:2] != jaxlib.split(".")[:2]:
        return fail(
            "versions",
            f"jax {jax} with jaxlib {jaxlib}: JAX needs the jaxlib of its own release",
            f"pip install 'jax=={jax}' 'jaxlib=={jax}'",
        )
    if odd:
        names = ", ".join(f"{k} {v}" for k, v in odd.items())
        return fail(
            "versions",
            f"jaxlib {jaxlib} with {names}: a plugin of another jaxlib release is not loaded",
            f"pip install 'jax[cuda12]=={jax}' (or the plugin of your accelerator at {jaxlib})",
        )
    return ok("versions", f"jax {jax}, jaxlib {jaxlib}, {listed}")


def agreement(facts: dict[int, dict]) -> list[Check]:
    """Across the job's processes: the same versions, and the same number of devices per host."""
    out = []
    seen = {json_key(f["versions"]): p for p, f in sorted(facts.items())}
    if len(seen) > 1:
        which = "; ".join(
            f"process {p}: " + ", ".join(f"{k} {v}" for k, v in facts[p]["versions"].items())
            for p in seen.values()
        )
        out.append(
            fail(
                "versions across processes",
                f"the processes run different versions ({which})",
                "install one environment on every host (a container image, or the same pip pins)",
            )
        )
    else:
        out.append(ok("versions across processes", f"the same on all {len(facts)} process(es)"))
    counts = {p: f["local_devices"] for p, f in facts.items()}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        out.append(
            fail(
                "devices per host",
                f"hosts hold different numbers of devices ({shown}): the mesh's hosts are unequal",
                "give every process the same devices (CUDA_VISIBLE_DEVICES, the scheduler's"
                " --gpus-per-node)",
            )
        )
    else:
        n = next(iter(counts.values()))
        out.append(ok("devices per host", f"{n} on each of {len(counts)} process(es)"))
    return out


def json_key(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def xla_flags(environ=None) -> Check:
    """XLA_FLAGS read by a throw-away process that starts XLA's CPU client (which parses every
    flag of the build, GPU ones too): an unknown flag is named here instead of aborting the run."""
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "").strip()
    if not flags:
        return ok("xla flags", "XLA_FLAGS is not set")
    if flags not in _probed:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env={**environ, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        found = _UNKNOWN.search(probe.stderr)
        _probed[flags] = found.group(1).strip() if found else ""
        if probe.returncode and not found:
            _probed[flags] = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else ""
    complaint = _probed[flags]
    if complaint:
        return fail(
            "xla flags",
            f"XLA rejects XLA_FLAGS: {complaint} (XLA would abort the run at start)",
            'remove or correct that flag (`python -c "from mesh.xla import describe;'
            " print(describe('gpu'))\"` lists the presets' flags)",
        )
    return ok("xla flags", f"{len(flags.split())} flag(s), all known to this jaxlib")


def platform(devices: list, found: dict[str, str], hardware_name: str, profile_of) -> Check:
    """The platform and device kind that came up against what is installed and asked for."""
    d = devices[0]
    what = f"{d.platform}, {d.device_kind}, {len(devices)} local device(s)"
    cuda = [k for k in found if k.startswith("jax-cuda") or k.startswith("jax-rocm")]
    if cuda and d.platform == "cpu":
        return warn(
            "platform",
            f"{what}, though {', '.join(cuda)} is installed: JAX found no GPU",
            "check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES and JAX_PLATFORMS",
        )
    if "libtpu" in found and d.platform == "cpu":
        return warn(
            "platform",
            f"{what}, though libtpu is installed: JAX found no TPU",
            "check TPU_VISIBLE_CHIPS and JAX_PLATFORMS, and that no other process holds the TPU",
        )
    own = profile_of(d.device_kind, d.platform)
    if hardware_name and own and own != hardware_name:
        return warn(
            "platform",
            f"{what}, but --hardware {hardware_name} was asked for",
            f"--hardware {own}",
        )
    return ok("platform", what)
