"""Elastic training (`--train.elastic true`): the layout an attempt re-plans for the devices that
remain, the supervisors' rendezvous, and the drills: 2 processes x 4 CPU devices, one process
(its supervisor and its child) killed at a random step or inside a checkpoint save; the job
finishes on the 4 devices that remain without anyone restarting it, and grows back to 8 when
the lost process returns; its losses equal an uninterrupted run's step by step."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_multiprocess import REPO, child_env, free_port

from errors import UserError
from train.core.config import from_args
from train.run.elastic import Layout, layout, record_fields, shrink
from train.run.rendezvous import Generation, Rendezvous

ORIGIN = {
    "processes": 2,
    "devices": 8,
    "mesh": {"pipeline": 1, "data": 2, "fsdp": 2, "context": 1, "expert": 1, "model": 2},
    "dcn": {"pipeline": 1, "data": 2, "fsdp": 1, "context": 1, "expert": 1, "model": 1},
    "micro_batches": 1,
    "batch_size": 8,
}


def test_a_lost_process_shrinks_data_first_and_keeps_the_global_batch():
    assert shrink(ORIGIN, 2) == Layout("data=2,fsdp=2,model=2", "data=2", 1)
    assert shrink(ORIGIN, 1) == Layout("fsdp=2,model=2", "", 2)
    four = {**ORIGIN, "processes": 4, "devices": 16, "mesh": {**ORIGIN["mesh"], "data": 4}}
    four["dcn"] = {**ORIGIN["dcn"], "data": 4}
    # 3 of 4 hosts: data 4 -> 3 would split the batch of 8 unevenly; refused in one line
    with pytest.raises(UserError, match="elastic: .*cannot be shrunk"):
        shrink(four, 3)
    assert shrink(four, 2) == Layout("data=2,fsdp=2,model=2", "data=2", 2)
    fsdp_only = {**ORIGIN, "mesh": {**ORIGIN["mesh"], "data": 1, "fsdp": 4}, "dcn": {}}
    assert shrink(fsdp_only, 1) == Layout("fsdp=2,model=2", "", 2)
    assert layout(ORIGIN, 1, [], "") == shrink(ORIGIN, 1)


def test_the_planner_re_plans_for_the_devices_that_remain():
    """--train.elastic_hardware NAME: `plan --search` on the devices left picks the mesh, with at
    least as many micro-batches as the shrink would take (the global batch kept)."""
    argv = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--max-restarts", "1"]
    got = layout(ORIGIN, 1, [*argv, "--train.elastic", "true"], "cpu")
    sizes = dict(part.split("=") for part in got.mesh.split(","))
    assert np.prod([int(v) for v in sizes.values()]) == 4 and got.mesh_dcn == "", got
    assert got.micro_batches >= 2 and 8 % got.micro_batches == 0, got


def test_the_elastic_supervisor_starts_no_jax():
    """It must not take devices from its children: neither it nor what it imports loads JAX."""
    code = "import sys, train.run.elastic_supervisor; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_elastic_needs_the_supervisor():
    with pytest.raises(UserError, match="add --max-restarts"):
        from_args(["--train.elastic", "true"])
    cfg, _ = from_args(["--train.elastic", "true", "--max-restarts", "2"])
    assert cfg.train.elastic


def test_records_carry_the_mesh_and_the_elastic_counts(tmp_path):
    cfg, _ = from_args(
        ["--train.elastic", "true", "--max-restarts", "1", "--run-dir", str(tmp_path)]
    )
    (tmp_path / "elastic").mkdir()
    (tmp_path / "elastic" / "events.jsonl").write_text(
        json.dumps({"event": "shrink", "cost_s": 4.0})
        + "\n"
        + json.dumps({"event": "grow", "cost_s": 1.5})
        + "\n{cut short"
    )

    class Mesh:
        shape, size = {"data": 1, "fsdp": 2, "model": 2}, 4

    assert record_fields(cfg, Mesh) == {
        "mesh": "fsdp=2,model=2",
        "devices": 4,
        "elastic_shrinks": 1,
        "elastic_grows": 1,
        "elastic_resize_s": 5.5,
    }


def test_the_rendezvous_leaves_out_a_lost_slot_and_takes_it_back(tmp_path):
    def slot(s: int) -> Rendezvous:
        return Rendezvous(str(tmp_path), s, 2, f"host{s}", wait_s=0.5)

    got: dict[int, Generation | int] = {}

    def join(s: int) -> None:
        got[s] = slot(s).join(timeout_s=30)

    threads = [threading.Thread(target=join, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1] == Generation(0, (0, 1), {0: "host0", 1: "host1"})
    # slot 1 is lost: slot 0 alone fixes the next generation once the wait is over
    shrunk = slot(0).join(timeout_s=30)
    assert shrunk.number == 1 and shrunk.members == (0,)
    assert slot(0).newcomers(shrunk) == []
    # slot 1 returns: it announces in generation 2 and waits, however long the running slot 0
    # (which beats) takes to reach a checkpoint; slot 0 sees it
    back = threading.Thread(target=join, args=(1,))
    back.start()
    deadline = time.monotonic() + 30
    while not slot(0).newcomers(shrunk) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slot(0).newcomers(shrunk) == [1]
    for count in range(8):  # 4 x the wait: a returning slot alone must not fix generation 2
        slot(0).beat(count)
        time.sleep(0.25)
    assert not (tmp_path / "gen-2" / "members.json").exists() and back.is_alive()
    grown = slot(0).join(timeout_s=30)  # every member of generation 1 is here: no wait
    back.join()
    assert grown.members == (0, 1) and got[1] == grown
    # the job ends while a process waits to rejoin: it leaves with the job's status
    waiting = threading.Thread(target=join, args=(1,))
    waiting.start()
    time.sleep(0.3)
    slot(0).finish(0)
    waiting.join()
    assert got[1] == 0


# -- the drills -------------------------------------------------------------------------------
STEPS, EVERY, PEER_TIMEOUT = 14, 2, 10
TIMEOUT_S = 600  # a whole drill on 2 busy cores: three compiles and a lost peer's timeout
FLAGS = [
    "--model",
    "tiny",
    "--model.dtype",
    "float32",
    "--mesh",
    "data=2,fsdp=2,model=2",
    "--steps",
    str(STEPS),
    "--log-every",
    "1",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "0",
    "--logging.progress",
    "lines",
    "--logging.tensorboard",
    "false",
    "--checkpoint.every",
    str(EVERY),
]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec:
            out.append(rec)
    return out


def _by_step(records: list[dict]) -> dict[int, dict]:
    """The last record of each step: steps redone after a loss replace the ones before."""
    return {r["step"]: r for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: one process, 8 devices, the same flags. Started at once and waited
    for by the first drill that compares, so it compiles while the drill's processes do."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    log = open(run_dir.parent / "reference.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", *FLAGS, "--run-dir", str(run_dir)],
        cwd=REPO,
        env=child_env(8),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def losses() -> dict[int, float]:
        assert proc.wait(timeout=TIMEOUT_S) == 0, (run_dir.parent / "reference.log").read_text()
        return {s: r["loss"] for s, r in _by_step(_records(run_dir)).items()}

    yield losses
    if proc.poll() is None:
        proc.kill()
    log.close()


class Job:
    """One supervisor per process (`python -m train ... --max-restarts --train.elastic true`),
    each in its own process group (start_new_session) so that killing a "host" kills its
    supervisor and its child."""

    def __init__(self, tmp_path: Path, port: int):
        self.tmp, self.port, self.run_dir = tmp_path, port, tmp_path / "run"
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()

    def start(self, name: str, slot: int, env: dict[str, str] | None = None) -> subprocess.Popen:
        args = [
            *FLAGS,
            "--run-dir",
            str(self.run_dir),
            "--max-restarts",
            "3",
            "--train.elastic",
            "true",
            "--train.elastic_wait",
            "3",
            "--mesh-dcn",
            "data=2",
            "--coordinator",
            f"127.0.0.1:{self.port}",
            "--num-processes",
            "2",
            "--process-id",
            str(slot),
            "--parallelism.peer_timeout",
            str(PEER_TIMEOUT),
        ]
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "train", *args],
                cwd=REPO,
                env={**child_env(4), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self.procs[name]

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()
        self.killed.add(name)

    def wait_for(self, what: str, ready, deadline: float) -> None:
        """Poll `ready()` (files the job writes: no event to wait on across processes)."""
        while not ready():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.logs()}", pytrace=False)
            if any(
                p.poll() not in (None, 0) for n, p in self.procs.items() if n not in self.killed
            ):
                pytest.fail(f"a supervisor failed while waiting for {what}\n{self.logs()}")
            time.sleep(0.1)

    def logs(self, tail: int = 5000) -> str:
        parts = []
        for name, p in self.procs.items():
            text = (self.tmp / f"{name}.log").read_text(errors="replace")
            text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("[Gloo]"))
            parts.append(f"--- {name} (rc={p.poll()}) ---\n{text[-tail:]}")
        return "\n".join(parts)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def committed(self) -> list[int]:
        ck = self.run_dir / "checkpoints"
        return sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit()) if ck.is_dir() else []

    def members(self, number: int) -> list[int] | None:
        path = self.run_dir / "elastic" / f"gen-{number}" / "members.json"
        return json.loads(path.read_text())["members"] if path.exists() else None


def _assert_same_losses(job: Job, ref: dict[int, float]) -> dict[int, dict]:
    got = _by_step(_records(job.run_dir))
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), job.logs()
    np.testing.assert_allclose(
        [got[s]["loss"] for s in sorted(ref)],
        [ref[s] for s in sorted(ref)],
        rtol=1e-5,
        err_msg=job.logs(),
    )
    return got


def _events(job: Job) -> list[dict]:
    """The shrinks and grows (a restart of both, when a loaded machine starves JAX's own
    heartbeat during a compile, is the supervisor's plain restart and not what is drilled)."""
    path = job.run_dir / "elastic" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] != "restart"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_drill_a_lost_process_shrinks_the_job_and_its_return_grows_it_back(tmp_path, reference):
    """Kill process 1 (supervisor and child) at a random step: process 0's child exits 5, its
    supervisor waits --train.elastic_wait for process 1, re-plans data=2,fsdp=2,model=2 on 8
    devices to fsdp=2,model=2 with 2 micro-batches on its 4 and resumes from the newest
    checkpoint. Process 1 comes back (the same command): at the shrunk attempt's first
    checkpoint the job stops and continues on 8 devices. The losses are the uninterrupted run's."""
    kill_at = random.Random().randint(3, 7)
    job = Job(tmp_path, free_port())
    deadline = time.monotonic() + TIMEOUT_S
    try:
        # process 0 sleeps 1 s after each step, so that the shrunk attempt cannot finish its steps
        # before process 1's supervisor is back (it starts no JAX: a second or two)
        slow = {"BRIGADE_INJECT_STEP_DELAY": "0:1"}
        job.start("slot0", 0, slow)
        job.start("slot1", 1, slow)
        job.wait_for(
            f"step {kill_at}",
            lambda: any(r["step"] >= kill_at for r in _records(job.run_dir)),
            deadline,
        )
        job.kill("slot1")
        job.wait_for("the shrunk generation", lambda: job.members(1) is not None, deadline)
        assert job.members(1) == [0], job.logs()
        # back once the shrunk attempt has trained (started earlier, it may grow before a step)
        job.wait_for(
            "a step on the shrunk mesh",
            lambda: any(r.get("mesh") == "fsdp=2,model=2" for r in _records(job.run_dir)),
            deadline,
        )
        job.start("slot1-back", 1, slow)
        for name in ("slot0", "slot1-back"):
            left = max(1.0, deadline - time.monotonic())
            assert job.procs[name].wait(timeout=left) == 0, job.logs()
    finally:
        job.stop_all()
    got = _assert_same_losses(job, reference())
    meshes = [r["mesh"] for r in _records(job.run_dir)]  # every attempt's, redone steps too
    assert "fsdp=2,model=2" in meshes and got[STEPS]["mesh"] == "data=2,fsdp=2,model=2", (
        meshes,
        kill_at,
    )
    assert [e["event"] for e in _events(job)] == ["shrink", "grow"], job.logs()
    shrink_event = _events(job)[0]
    assert shrink_event["devices_to"] == 4 and shrink_event["lost"] == [1]
    last = got[STEPS]
    assert last["elastic_shrinks"] == 1 and last["elastic_grows"] == 1, last
    assert job.committed()[-1] == STEPS


@pytest.mark.slow
@pytest.mark.multiprocess
def test_drill_a_process_lost_inside_a_save_finishes_on_the_devices_that_remain(
    tmp_path, reference
):
    """Process 1 killed as the save of step 4 begins (both inside Orbax's cross-process save):
    the job finishes on process 0's 4 devices, from the newest committed checkpoint, with the
    uninterrupted run's losses."""
    job = Job(tmp_path, free_port())
    deadline = time.monotonic() + TIMEOUT_S
    ck = job.run_dir / "checkpoints"
    try:
        job.start("slot0", 0)
        job.start("slot1", 1)
        job.wait_for(
            "the save of step 4",
            lambda: ck.is_dir() and any(d.name.split(".")[0] == "4" for d in ck.iterdir()),
            deadline,
        )
        job.kill("slot1")
        assert job.procs["slot0"].wait(timeout=max(1.0, deadline - time.monotonic())) == 0, (
            job.logs()
        )
    finally:
        job.stop_all()
    got = _assert_same_losses(job, reference())
    assert got[STEPS]["mesh"] == "fsdp=2,model=2" and got[STEPS]["devices"] == 4, job.logs()
    assert [e["event"] for e in _events(job)] == ["shrink"], job.logs()
