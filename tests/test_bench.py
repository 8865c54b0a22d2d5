"""`python -m mesh.bench`: nccl-tests' bandwidth formulas, a tiny real run on 8 fake devices
(--json parsed), one-line errors for bad input, and a 2-process run."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mesh.bench import axis_groups, bandwidths, bus_factor, main, parse_sizes, peak_busbw

REPO = Path(__file__).resolve().parent.parent


def test_busbw_formulas_on_known_sizes():
    # 1 GB in 1 s on 8 devices: algbw 1 GB/s; bus factors as in nccl-tests' PERFORMANCE.md
    assert bandwidths("all_reduce", 8, 10**9, 1.0) == (1e9, 1.75e9)
    assert bandwidths("all_gather", 8, 10**9, 1.0) == (1e9, 0.875e9)
    assert bandwidths("reduce_scatter", 4, 10**9, 0.5) == (2e9, 1.5e9)
    assert bandwidths("all_to_all", 2, 10**9, 1.0) == (1e9, 0.5e9)
    assert bandwidths("ppermute", 8, 10**9, 2.0) == (0.5e9, 0.5e9)
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError):
        bus_factor("broadcast", 4)


def test_parse_sizes_and_groups():
    assert parse_sizes("1K:64M") == [
        1 << 10,
        1 << 12,
        1 << 14,
        1 << 16,
        1 << 18,
        1 << 20,
        1 << 22,
        1 << 24,
        1 << 26,
    ]
    assert parse_sizes("1K:8K:2") == [1024, 2048, 4096, 8192]
    assert parse_sizes("4096,1M") == [4096, 1 << 20]
    shape = {"pipeline": 1, "data": 4, "fsdp": 1, "expert": 1, "model": 2}
    assert axis_groups(shape, None) == [
        ("data", ("data",)),
        ("model", ("model",)),
        ("all", ("data", "model")),
    ]
    assert axis_groups(shape, "all,model") == [("all", ("data", "model")), ("model", ("model",))]
    rows = [
        {"op": "all_reduce", "axes": "data", "size_bytes": s, "busbw_GBps": b}
        for s, b in ((1, 9.0), (8, 2.0))
    ]
    assert peak_busbw(rows) == {"all_reduce": {"data": 2.0}}  # the largest size, not the best


def test_tiny_run_json(capsys):
    rc = main(
        [
            "--mesh",
            "data=4,model=2",
            "--ops",
            "all_reduce,all_gather,reduce_scatter,all_to_all,ppermute",
            "--sizes",
            "4K",
            "--dtypes",
            "float32,int8",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == "data=4,model=2" and out["devices"] == 8 and out["processes"] == 1
    rows = out["results"]
    assert len(rows) == 5 * 3 * 2  # ops x (data, model, all) x dtypes
    assert {(r["axes"], r["n"]) for r in rows} == {("data", 4), ("model", 2), ("all", 8)}
    for r in rows:
        assert (
            r["time_us"] > 0
            and r["size_bytes"] == 4096
            and r["count"] == 4096 // (4 if r["dtype"] == "float32" else 1)
        )
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], r["n"]))
    assert set(out["peak_busbw_GBps"]) == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "ppermute",
    }


def test_table_output(capsys):
    assert (
        main(
            [
                "--mesh",
                "data=8",
                "--ops",
                "all_reduce",
                "--sizes",
                "1K,4K",
                "--iters",
                "1",
                "--warmup",
                "0",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# mesh data=8: 8") and lines[1].split()[:3] == ["op", "axes", "n"]
    assert [line.split()[:5] for line in lines[2:4]] == [
        ["all_reduce", "data", "8", "float32", "1K"],
        ["all_reduce", "data", "8", "float32", "4K"],
    ]
    assert lines[-1].split()[0] == "all_reduce" and lines[-2].split() == ["op", "data"]


@pytest.mark.parametrize(
    "argv,culprit",
    [
        (
            ["--ops", "all_reduce,broadcast"],
            "--ops: unknown 'broadcast'; valid: all_reduce, all_gather",
        ),
        (
            ["--mesh", "data=4,model=2", "--axes", "fsdp"],
            "--axes: mesh axis 'fsdp' has size 1 in this mesh; valid: data, model, all",
        ),
        (["--mesh", "data=4,tensor=2"], "--mesh: unknown mesh axis 'tensor'; valid axes"),
        (["--mesh", "data=3"], "--mesh: axis sizes multiply to 3 but there are 8 devices"),
        (["--sizes", "12X"], "--sizes: '12X' is not a size"),
        (["--sizes", "1M:1K"], "--sizes: MAX 1K is below MIN 1M"),
        (["--dtypes", "float64"], "--dtypes: unknown 'float64'; valid: float32"),
        (["--iters", "0"], "--iters 0: must be an integer >= 1"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, culprit):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {culprit}") and err.count("\n") == 1, err


def test_unknown_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--size", "1K"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--size" in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes(tmp_path):
    """2 processes x 4 CPU devices (gloo): one 8-device mesh; only process 0 prints."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")
    }
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = []
    for i in range(2):
        out = open(tmp_path / f"p{i}.out", "wb")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mesh.bench",
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                    "--mesh",
                    "data=4,model=2",
                    "--mesh-dcn",
                    "data=2",
                    "--ops",
                    "all_reduce",
                    "--sizes",
                    "4K",
                    "--iters",
                    "2",
                    "--json",
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"p{i}.out").read_text() for i in range(2)]
    assert codes == [0, 0], logs
    objs = [[json.loads(line) for line in log.splitlines() if line.startswith("{")] for log in logs]
    assert objs[1] == [], logs[1]  # gloo's own connection lines aside, p1 prints nothing
    (out,) = objs[0]
    assert out["processes"] == 2 and out["devices"] == 8
    assert [r["axes"] for r in out["results"]] == ["data", "model", "all"]
