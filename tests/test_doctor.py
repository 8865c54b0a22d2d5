"""`brigade doctor` (`python -m train doctor`): the run's checklist before it runs, on the suite's
8 fake devices (in process) and on 2 local processes: the union on process 0, a coordinator that
never answers and a process that never comes (each a FAIL line within --timeout, not JAX's
abort), a mesh that does not divide, a model that does not fit, an unknown XLA flag."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from test_multiprocess import REPO, child_env, free_port

from plan.doctor import environment
from plan.doctor.main import main

TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--model.dtype", "float32"]


def _doctor(capsys, *flags: str) -> tuple[int, dict]:
    code = main([*flags, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _by_name(report: dict) -> dict[str, dict]:
    return {c["check"]: c for c in report["checks"]}


def test_a_run_that_fits_passes_every_check(capsys, tmp_path):
    code, report = _doctor(
        capsys, *TINY, "--mesh", "data=2,fsdp=2,model=2", "--run-dir", str(tmp_path / "run")
    )
    checks = _by_name(report)
    assert code == 0 and report["ok"], report
    for name in ("versions", "xla flags", "platform", "mesh", "divisibility", "memory"):
        assert checks[name]["status"] == "OK", checks[name]
    for name in ("fsdp communication", "tensor parallelism", "step time", "planner", "data"):
        assert checks[name]["status"] in ("OK", "WARN"), checks[name]
    assert checks["run directory"]["status"] == checks["checkpoint store"]["status"] == "OK"
    assert "ids 0, 1, 2, 3, 4, 5, 6, 7" in checks["local devices"]["detail"]
    assert not (tmp_path / "run").exists()  # the doctor creates nothing


def test_a_mesh_that_does_not_divide_or_fit_fails_with_its_fix(capsys, tmp_path):
    code, report = _doctor(capsys, *TINY, "--mesh", "data=3", "--run-dir", str(tmp_path / "a"))
    mesh = _by_name(report)["mesh"]
    assert code == 1 and mesh["status"] == "FAIL" and "8 devices" in mesh["detail"], report
    assert "plan --search 8" in mesh["fix"]

    code, report = _doctor(capsys, *TINY, "--mesh", "model=8", "--run-dir", str(tmp_path / "b"))
    div = _by_name(report)["divisibility"]
    assert code == 1 and div["status"] == "FAIL" and "model" in div["detail"], report

    # 70B's parameters and Adam state over 8 CPU devices: far more than the host's RAM
    code, report = _doctor(
        capsys,
        "--model",
        "70b",
        "--mesh",
        "fsdp=8",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--run-dir",
        str(tmp_path / "c"),
    )
    memory = _by_name(report)["memory"]
    assert code == 1 and memory["status"] == "FAIL" and "does not fit" in memory["detail"], report
    assert "fsdp" in memory["fix"]


def test_an_unknown_xla_flag_is_named_before_xla_aborts():
    check = environment.xla_flags({"PATH": "/usr/bin:/bin", "XLA_FLAGS": "--xla_no_such_flag=1"})
    assert check.status == "FAIL" and "xla_no_such_flag" in check.detail, check


def test_mismatched_versions_and_devices_per_host_fail():
    assert environment.version_checks({"jax": "0.10.2", "jaxlib": "0.9.0"}).status == "FAIL"
    plugin = {"jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda12-plugin": "0.9.1"}
    assert environment.version_checks(plugin).status == "FAIL"
    facts = {
        0: {"versions": {"jax": "0.10.2"}, "local_devices": 8},
        1: {"versions": {"jax": "0.10.1"}, "local_devices": 4},
    }
    versions, devices = environment.agreement(facts)
    assert versions.status == devices.status == "FAIL"
    assert "process 1: 4" in devices.detail


def _start(args: list[str], port: int, pid: int, processes: int = 2) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "train",
            "doctor",
            *TINY,
            *args,
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            str(processes),
            "--process-id",
            str(pid),
        ],
        cwd=REPO,
        env=child_env(4),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_report_their_union_and_an_absent_peer_is_a_fail_line(tmp_path):
    """Both processes: process 0 prints one checklist for the job (8 devices, 2 x 4). Alone:
    process 1 with no coordinator, process 0 with no process 1: each prints its FAIL line
    within --timeout and exits 1 (not JAX's abort, 134)."""
    timeout = 8
    run = ["--mesh", "data=2,fsdp=2,model=2", "--mesh-dcn", "data=2"]
    port, lonely_port, empty_port = free_port(), free_port(), free_port()
    both = [_start([*run, "--run-dir", str(tmp_path / "run"), "--json"], port, i) for i in (0, 1)]
    t0 = time.monotonic()
    no_coordinator = _start([*run, "--timeout", str(timeout)], empty_port, 1)
    no_peer = _start([*run, "--timeout", str(timeout)], lonely_port, 0)
    alone = {}
    for name, p in (("no coordinator", no_coordinator), ("no peer", no_peer)):
        out, err = p.communicate(timeout=300)
        alone[name] = (p.returncode, out, err, time.monotonic() - t0)
    outs = [p.communicate(timeout=300) for p in both]

    assert [p.returncode for p in both] == [0, 0], outs
    report = json.loads(outs[0][0])
    checks = {c["check"]: c for c in report["checks"]}
    assert report["ok"] and report["devices"] == 8 and report["processes"] == 2, report
    assert checks["processes joined"]["status"] == "OK", checks
    assert checks["devices per host"]["detail"] == "4 on each of 2 process(es)", checks
    ids = [c for c in report["checks"] if c["check"] == "local devices"]
    assert {tuple(c["processes"]) for c in ids} == {(0,), (1,)}, ids  # each its own ids
    assert "sent to process 0" in outs[1][0]

    code, out, err, took = alone["no coordinator"]
    line = next(ln for ln in out.splitlines() if ln.startswith("FAIL"))
    assert code == 1 and f"127.0.0.1:{empty_port} did not answer within {timeout}s" in line, (
        out,
        err,
    )
    assert "fix: start process 0" in out
    code, out, err, took = alone["no peer"]
    assert code == 1 and "FAIL  processes joined" in out and f"{lonely_port}" in out, (out, err)
    assert took < timeout + 240, took  # its own deadline, not JAX's (300 s)
