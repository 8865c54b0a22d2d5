"""Stragglers: each process's step split (compute, data wait, host) reaches process 0 through the
coordination service; process 0 logs the slowest process and its lead over the others' median,
and warns once the lead stays above --logging.straggler_threshold for 3 log intervals."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cpu_env import cpu_env

from train.run.stragglers import STREAK, Stragglers, compare

REPO = Path(__file__).resolve().parent.parent


def split(compute, data_wait=0.0, host=0.001, name="h"):
    return {"compute_s": compute, "data_wait_s": data_wait, "host_s": host, "host": name}


def test_without_a_straggler_the_ratio_stays_near_one():
    # in a synchronous step every process waits for the others: compute times differ by jitter only
    found = compare(
        {0: split(0.101), 1: split(0.100, host=0.002), 2: split(0.103), 3: split(0.100)}
    )
    assert found["step_time_max_over_median"] < 1.05, found
    assert compare({0: split(0.2)}) == {
        "step_time_max_over_median": 1.0,
        "slowest_process": 0,
        "slow_part": "compute_s",
        "excess_s": 0.0,
    }


def test_a_slow_host_or_a_slow_input_pipeline_is_named():
    # process 2 sleeps 0.3 s a step on its host; the others wait for it inside the step (compute)
    found = compare({0: split(0.40), 1: split(0.41), 2: split(0.10, host=0.30), 3: split(0.40)})
    assert found["slowest_process"] == 2 and found["slow_part"] == "host_s"
    assert found["step_time_max_over_median"] == pytest.approx(
        (0.10 + 0.30) / (0.10 + 0.001), rel=1e-6
    )
    assert found["excess_s"] == pytest.approx(0.299, rel=1e-6)
    found = compare({0: split(0.35), 1: split(0.10, data_wait=0.25)})
    assert (found["slowest_process"], found["slow_part"]) == (1, "data_wait_s")


class FakeStore:
    """The coordination service's key-value calls the check makes."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_the_warning_comes_once_after_three_slow_intervals_in_a_row():
    store = FakeStore()
    zero, one = Stragglers(1.5, 0, 2), Stragglers(1.5, 1, 2)
    zero.client = one.client = store
    lines = []
    for step, slow in zip(
        range(2, 20, 2), [True, False, True, True, True, True, True, False, True]
    ):
        one.observe(step, split(0.1, host=0.5 if slow else 0.001))
        fields, line = zero.observe(step, split(0.6 if slow else 0.1))
        assert fields["slowest_process"] == (1 if slow else fields["slowest_process"])
        assert (fields["step_time_max_over_median"] > 1.5) == slow
        lines += [(step, line)] if line else []
    # steps 6, 8, 10: the third in a row
    assert len(lines) == 1 and lines[0][0] == 2 * (2 + STREAK), lines
    line = lines[0][1]
    assert (
        line.startswith("warning: straggler: process 1 on host ")
        and "for 3 log intervals (steps 6-10" in line
    )
    assert "its host overhead is 0.499s per step above theirs" in line, line
    assert one.observe(20, split(0.1)) == ({}, "")  # only process 0 reports


def test_a_single_process_logs_the_same_fields_trivially():
    assert Stragglers(1.5, 0, 1).observe(1, split(0.2)) == (
        {"step_time_max_over_median": 1.0, "slowest_process": 0},
        "",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_delayed_process_is_named_within_three_log_intervals(tmp_path):
    """2 processes x 4 CPU devices; process 1 sleeps 0.3 s after each step."""
    port, procs = _free_port(), []
    env = cpu_env(4, BRIGADE_INJECT_STEP_DELAY="1:0.3", PYTHONUNBUFFERED="1")
    for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS"):
        env.pop(k, None)
    for i in range(2):
        args = [
            "--model",
            "tiny",
            "--model.dtype",
            "float32",
            "--mesh",
            "data=8",
            "--steps",
            "12",
            "--log-every",
            "2",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--eval-every",
            "0",
            "--train.sample_tokens",
            "0",
            "--data",
            "synthetic",
            "--logging.progress",
            "none",
            "--logging.tensorboard",
            "false",
            "--checkpoint.every",
            "0",
            "--run-dir",
            str(tmp_path / f"run{i}"),
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
        ]
        with open(tmp_path / f"{i}.out", "wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "train", *args],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + 200
    while (
        any(p.poll() is None for p in procs)
        and time.monotonic() < deadline
        and not any(p.poll() not in (None, 0) for p in procs)
    ):
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    logs = "\n".join((tmp_path / f"{i}.out").read_text(errors="replace")[-3000:] for i in range(2))
    assert [p.returncode for p in procs] == [0, 0], logs
    recs = [json.loads(ln) for ln in (tmp_path / "run0" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in recs if "loss" in r}
    assert sorted(by_step) == [1, 2, 4, 6, 8, 10, 12], logs
    # process 1's first split reaches process 0 by the second record; three
    # intervals on, the warning
    early = [by_step[s] for s in (2, 4, 6)]
    assert any(r["slowest_process"] == 1 and r["step_time_max_over_median"] > 1.5 for r in early), (
        early
    )
    late = [by_step[s] for s in (6, 8, 10, 12)]
    assert all(r["slowest_process"] == 1 and r["step_time_max_over_median"] > 1.5 for r in late), (
        late
    )
    out0 = (tmp_path / "0.out").read_text()
    line = [ln for ln in out0.splitlines() if ln.startswith("warning: straggler:")]
    assert (
        len(line) == 1 and "process 1 on host " in line[0] and "its host overhead is" in line[0]
    ), out0
    assert (
        os.path.getsize(tmp_path / "1.out") > 0
        and "warning: straggler" not in (tmp_path / "1.out").read_text()
    )
