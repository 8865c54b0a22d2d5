"""Failures beyond a clean kill: a hung step (watchdog), a crash under `--max-restarts`
(supervisor), a checkpoint write that fails (full disk) and a checkpoint dir that cannot be made."""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest
from cpu_env import cpu_env

from train.run.goodput import CATEGORIES, Goodput, breakdown_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(1, PYTHONUNBUFFERED="1")
CMD = [
    "--model",
    "tiny",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "0",
    "--logging.progress",
    "false",
    "--logging.tensorboard",
    "false",
]


def train(args, run_dir, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "train", *CMD, "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        env={**ENV, **(env or {})},
        text=True,
        capture_output=True,
        timeout=300,
        **kw,
    )


def steps_logged(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(ln)["step"] for ln in f if ln.endswith("\n") and '"loss"' in ln]
    except OSError:
        return []


@pytest.mark.slow
def test_watchdog_dumps_stacks_and_exits_4_on_a_hang(tmp_path):
    t0 = time.monotonic()
    p = train(
        ["--steps", "10", "--train.step_timeout", "3"],
        tmp_path,
        env={"BRIGADE_INJECT_HANG_STEPS": "4"},
    )
    assert p.returncode == 4, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: watchdog")]
    assert len(lines) == 1 and "after step 4" in lines[0] and "step_timeout 3" in lines[0], (
        p.stderr[-3000:]
    )
    assert "Thread 0x" not in p.stderr and "Current thread" not in p.stderr  # in the file only
    stacks = (tmp_path / "watchdog-stacks.0.txt").read_text()
    assert (
        " in fit\n" in stacks and "train/run/loop.py" in stacks
    )  # where the main thread hung: the loop in fit()
    assert steps_logged(tmp_path) == [1, 2, 3]  # step 4 hung before it was logged
    assert time.monotonic() - t0 < 120


@pytest.mark.slow
def test_supervisor_restarts_a_killed_run_and_reports_lost_steps(tmp_path):
    out = open(tmp_path / "supervisor.log", "w")
    ck_dir = tmp_path / "checkpoints"
    sup = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "train",
            *CMD,
            "--run-dir",
            str(tmp_path),
            "--steps",
            "30",
            "--seq-len",
            "128",
            "--batch-size",
            "16",
            "--checkpoint.every",
            "4",
            "--max-restarts",
            "2",
        ],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        # 3 steps past a committed checkpoint
        while time.monotonic() < deadline and sup.poll() is None:
            saved = [int(d) for d in os.listdir(ck_dir) if d.isdigit()] if ck_dir.is_dir() else []
            if saved and max(steps_logged(tmp_path), default=0) >= max(saved) + 3:
                break
            time.sleep(0.02)
        pid = int(
            re.search(
                r"training started \(pid (\d+)", (tmp_path / "supervisor.log").read_text()
            ).group(1)
        )
        os.kill(pid, signal.SIGKILL)  # e.g. the OOM killer, or a node fault
        assert sup.wait(timeout=240) == 0, (tmp_path / "supervisor.log").read_text()[-3000:]
    finally:
        if sup.poll() is None:
            sup.kill()
    log = (tmp_path / "supervisor.log").read_text()
    (restart,) = [json.loads(ln) for ln in open(tmp_path / "restarts.jsonl")]
    assert restart["exit_code"] == -signal.SIGKILL and restart["checkpoint_step"] >= max(saved), (
        restart
    )
    assert restart["lost_steps"] == restart["last_logged_step"] - restart["checkpoint_step"] >= 0
    assert (
        "killed by SIGKILL" in log and f"restart 1/2 from step {restart['checkpoint_step']}" in log
    ), log[-3000:]
    assert "1 restart(s)" in log
    # every step logged once, the redone ones too
    assert steps_logged(tmp_path) == list(range(1, 31))
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["restarts"] == 1 and summary["recomputed_steps"] == restart["lost_steps"]
    assert summary["time_lost_s"] > 0


def test_supervisor_does_not_restart_a_configuration_error(tmp_path):
    p = train(["--max-restarts", "3", "--resume", str(tmp_path / "missing")], tmp_path)
    assert (
        p.returncode == 2
        and "restart" not in p.stderr
        and "no such checkpoint directory" in p.stderr
    ), p.stderr


@pytest.mark.slow
def test_full_disk_during_a_save_keeps_committed_checkpoints(tmp_path):
    first = train(["--steps", "8", "--checkpoint.every", "4"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]

    def small_files():  # writes past 50 kB fail with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))

    p = train(["--steps", "16", "--checkpoint.every", "4"], tmp_path, preexec_fn=small_files)
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    # Brigade's line, not Orbax's ERROR:absl records: those are in the file the line names
    # (the size limit also cuts JAX's compilation cache files: its warning may be there too)
    assert "ERROR:absl" not in p.stderr, p.stderr[-3000:]
    report = tmp_path / "orbax-errors.txt"
    assert errors[0].endswith(f"(Orbax's report: {report})") and "12" in report.read_text()
    assert "saving step 12" in errors[0] and "intact (steps 4, 8)" in errors[0], errors[0]
    assert "File too large" in errors[0] or "os_error_code" not in p.stderr, errors[
        0
    ]  # the OS reason, when told
    # space is back: resume and finish
    again = train(["--steps", "16", "--checkpoint.every", "4"], tmp_path)
    assert (
        again.returncode == 0 and "resumed from" in again.stdout and "(step 8," in again.stdout
    ), again.stdout


def test_checkpoint_dir_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    p = train(
        ["--steps", "2", "--checkpoint.dir", str(tmp_path / "file" / "ckpt")], tmp_path / "run"
    )
    assert (
        p.returncode == 2
        and p.stderr.startswith("error: --checkpoint.dir")
        and "cannot create" in p.stderr
    ), p.stderr
    assert p.stderr.count("\n") == 1


def test_goodput_carries_over_a_restart():
    gp = Goodput(started_at=1000.0)
    totals = {f"time_{c}_s": 1.0 for c in CATEGORIES} | {"time_total_s": 10.0, "time_other_s": 3.0}
    recs = [
        {"step": 4, "time": 900.0, **totals, "recomputed_steps": 0, "restarts": 0},
        {"step": 7, "time": 950.0, **totals, "time_total_s": 30.0},
    ]
    # resumed at the checkpoint of step 4; the run died after logging step 7
    gp.resume(recs, step=4)
    gp.add("productive", 5.0)
    out = gp.totals(now=1010.0)
    # lost: 20 s of work after step 4 (30 - 10) + 50 s down (950 -> 1000); total: 10 + 70 + 10 s now
    assert out["time_lost_s"] == pytest.approx(1.0 + 70.0) and out["time_total_s"] == pytest.approx(
        90.0
    )
    assert out["time_productive_s"] == pytest.approx(6.0) and out["goodput"] == pytest.approx(
        6.0 / 90.0
    )
    assert out["restarts"] == 1 and out["recomputed_steps"] == 3
    assert sum(out[f"time_{c}_s"] for c in (*CATEGORIES, "other")) == pytest.approx(
        out["time_total_s"]
    )


def test_goodput_counts_an_earlier_resume_that_died_after_the_checkpoint():
    """Attempt 2 resumed at step 4, logged steps 5-6 and died; attempt 3 resumes at step 4 again:
    both restarts and both rounds of recomputed steps count (the record at step 4 knows neither)."""
    totals = {f"time_{c}_s": 1.0 for c in CATEGORIES} | {"time_total_s": 10.0, "time_other_s": 3.0}
    recs = [
        {"step": 4, "time": 900.0, **totals, "recomputed_steps": 0, "restarts": 0},
        {
            "step": 6,
            "time": 990.0,
            **totals,
            "time_total_s": 40.0,
            "recomputed_steps": 3,
            "restarts": 1,
        },
    ]
    gp = Goodput(started_at=1000.0)
    gp.resume(recs, step=4)
    assert gp.restarts == 2 and gp.recomputed_steps == 3 + 2
    gp = Goodput(started_at=1000.0)
    gp.resume(recs, step=4, restarts=3)  # the run dir's count: one attempt died before logging
    assert gp.restarts == 3


def _attempt_records(t_end: float, step: int = 100) -> tuple[list[dict], dict]:
    """metrics.jsonl records of an attempt that ran steps 1..`step` and ended cleanly at `t_end`,
    and its summary.json (written a little after the last record: the final commit)."""
    totals = {f"time_{c}_s": 0.0 for c in (*CATEGORIES, "other")}
    recs = [
        {"step": s, "time": t_end - 2.0 - (step - s), **totals, "time_total_s": 58.0 - (step - s)}
        | {"time_productive_s": 40.0 - (step - s) * 0.5, "restarts": 0, "recomputed_steps": 0}
        for s in (1, step // 2, step)
    ]
    summary = {**recs[-1], "time_total_s": 60.0, "time": t_end, "exit_code": 0, "steps": step}
    return recs, {k: v for k, v in summary.items() if k != "step"}


@pytest.mark.parametrize("exit_code", [0, 143])
def test_continuing_a_cleanly_ended_run_later_is_idle_not_lost(exit_code):
    """A run that finished (or was stopped by SIGTERM with its checkpoint committed) continued 15
    minutes later: those 15 minutes are idle, outside the total, not lost."""
    recs, summary = _attempt_records(t_end=1000.0)
    gp = Goodput(started_at=1900.0)
    gp.resume(recs, step=100, ended={**summary, "exit_code": exit_code}, earlier=[])
    gp.add("productive", 30.0)
    out = gp.totals(now=1940.0)
    assert out["time_lost_s"] == 0.0 and out["idle_between_attempts_s"] == pytest.approx(900.0)
    assert out["time_total_s"] == pytest.approx(60.0 + 40.0)  # the idle 900 s are not in it
    assert out["goodput"] == pytest.approx((40.0 + 30.0) / 100.0)
    assert out["restarts"] == 0 and out["recomputed_steps"] == 0 and not gp.after_failure
    assert "900s idle between attempts, not counted" in breakdown_text(out)
    fresh_dir = Goodput(started_at=1900.0)  # --resume latest: another run's step, a new run dir
    fresh_dir.resume([], step=100, ended=None, earlier=[])
    assert fresh_dir.totals(now=1900.0)["restarts"] == 0 and not fresh_dir.after_failure


def test_an_attempt_that_died_unlogged_after_a_clean_end_is_lost_from_its_start():
    """Clean end at 1000; attempt 2 started at 1300 and was killed before it logged anything;
    attempt 3 starts at 1500: 300 s idle, then 200 s lost, and attempt 3 is a restart."""
    recs, summary = _attempt_records(t_end=1000.0)
    earlier = [{"step": 100, "time": 1300.0, "after": "clean end"}]
    gp = Goodput(started_at=1500.0)
    gp.resume(recs, step=100, ended=summary, earlier=earlier)
    out = gp.totals(now=1500.0)
    assert out["idle_between_attempts_s"] == pytest.approx(300.0) and out[
        "time_lost_s"
    ] == pytest.approx(200.0)
    assert out["time_total_s"] == pytest.approx(60.0 + 200.0)
    assert gp.after_failure and out["restarts"] == 1


def test_a_summary_older_than_the_last_record_is_no_clean_end():
    """Attempt 1 ended cleanly at step 100 (summary.json); attempt 2 continued, logged step 150
    and crashed: its summary is attempt 1's, older than the last record, so the gap is lost."""
    recs, summary = _attempt_records(t_end=1000.0)
    more = {**recs[-1], "step": 150, "time": 1100.0, "time_total_s": 150.0, "restarts": 0}
    gp = Goodput(started_at=1200.0)
    gp.resume([*recs, more], step=100, ended=summary, earlier=[])
    out = gp.totals(now=1200.0)
    # the work after step 100 (150 - 58) and the 100 s from the last record to this start
    assert (
        out["time_lost_s"] == pytest.approx(92.0 + 100.0) and out["idle_between_attempts_s"] == 0.0
    )
    assert gp.after_failure and out["restarts"] == 1 and out["recomputed_steps"] == 50


def test_the_run_dir_records_whether_a_resume_followed_a_clean_end(tmp_path):
    """prepare_run_dir reads summary.json and resumes.jsonl: a continuation after a clean end is
    recorded as such and counts no restart; the next resume after a crash does."""
    from train.run.rundir import prepare_run_dir

    recs, summary = _attempt_records(t_end=1000.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    gp = Goodput(started_at=1900.0)
    prepare_run_dir(str(tmp_path), "{}", 100, gp)
    assert gp.totals(now=1900.0)["time_lost_s"] == 0.0
    gp = Goodput(started_at=2000.0)  # the continuation was killed before it logged anything
    prepare_run_dir(str(tmp_path), "{}", 100, gp)
    lines = [json.loads(ln) for ln in (tmp_path / "resumes.jsonl").read_text().splitlines()]
    assert [ln["after"] for ln in lines] == ["clean end", "failure"]
    out = gp.totals(now=2000.0)
    assert out["restarts"] == 1 and out["idle_between_attempts_s"] == pytest.approx(900.0)
    assert out["time_lost_s"] == pytest.approx(100.0)


def test_closed_loop_echoes_are_dropped_and_nothing_else():
    import io

    from checkpoint.echoes import QuietClosedLoopEchoes

    out = io.StringIO()
    err = QuietClosedLoopEchoes(out)
    err.write("progress 10%\r")  # passes through at once (a progress bar has no newline)
    assert out.getvalue() == "progress 10%\r"
    err.write(
        "Traceback (most recent call last):\n"
        '  File "base_events.py", line 806, in call_soon_threadsafe\n'
    )
    err.write(
        "    self._check_closed()\nRuntimeError: Event loop is closed\n"
        "error: checkpoint: saving step 12 ...\n"
    )
    err.write('Traceback (most recent call last):\n  File "x.py", line 1\nValueError: a real one\n')
    assert out.getvalue() == (
        "progress 10%\rerror: checkpoint: saving step 12 ...\n"
        'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: a real one\n'
    )


def test_parsing_flags_and_the_supervisor_import_no_jax():
    """The supervisor parent must not import JAX (it would hold no devices, but a GPU build may init
    them)."""
    code = (
        "import sys; from train.core.config import from_args;"
        " import train.run.supervisor, checkpoint.echoes, mesh.xla;"
        " from_args(['--max-restarts', '2', '--comm.compression', 'int8']);"
        " print('jax' in sys.modules)"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr[-2000:]


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    """A short Python child that imports no JAX (the watchdog ends its process with os._exit)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_watchdog_waits_do_not_count_as_a_hang_but_their_own_limit_does(tmp_path):
    code = """if True:
        import sys, time
        from train.run.watchdog import Watchdog
        with Watchdog(0.5, sys.argv[1]) as dog:
            dog.beat("step 1")
            with dog.waiting("the commit of checkpoint step 8"):
                time.sleep(2.0)                       # four step timeouts: a save, not a hang
            print("commit waited out", flush=True)
            time.sleep(0.2)
            dog.beat("step 2")
            with dog.waiting("the restore of step 4", limit_s=1.0):
                time.sleep(30)                        # past the wait's own limit
    """
    p = _python(code, str(tmp_path / "stacks.txt"))
    assert p.returncode == 4 and p.stdout == "commit waited out\n", p.stderr[-3000:]
    # the stacks go to the file; stderr holds the one line naming it and nothing else
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: watchdog: still waiting for the restore of step 4 after 1s (limit 1s);"
    ), p.stderr[-3000:]
    assert f"stacks of all threads in {tmp_path / 'stacks.txt'};" in lines[0], lines[0]
    # where the main thread waited
    assert 'File "<string>"' in (tmp_path / "stacks.txt").read_text()


def test_two_threads_ending_the_process_at_once_print_one_line():
    code = """if True:
        import threading
        from train.run.watchdog import end_process
        go = threading.Barrier(3)
        def end(code):
            go.wait()
            end_process(f"error: verdict {code}", code)
        for c in (4, 5):
            threading.Thread(target=end, args=(c,)).start()
        go.wait()
        threading.Event().wait(10)
    """
    p = _python(code)
    lines = p.stderr.splitlines()
    assert p.returncode in (4, 5) and lines == [f"error: verdict {p.returncode}"], (
        p.returncode,
        p.stderr,
    )


@pytest.mark.parametrize("status,restarts", [(2, 0), (3, 0), (5, 1)])
def test_supervisor_restarts_crashes_but_never_a_final_status(tmp_path, status, restarts):
    """2 (configuration or input error) and 3 (diverged) end the supervision at once; a lost peer
    (5) or the watchdog (4) is a crash, restarted up to --max-restarts times."""
    from train.run.rundir import MARKER
    from train.run.supervisor import supervise

    (tmp_path / MARKER).write_text("{}")  # a run directory, as the child leaves it
    child = [sys.executable, "-c", f"import sys; sys.exit({status})"]
    code = supervise(
        [], 1, str(tmp_path), str(tmp_path / "checkpoints"), backoff_s=0, program=child
    )
    assert code == status
    log = tmp_path / "restarts.jsonl"
    lines = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    assert [r["exit_code"] for r in lines] == [status] * restarts


def test_supervisor_writes_nothing_into_a_run_dir_its_child_never_claimed(tmp_path):
    """A child that dies before it claims --run-dir: a restarts.jsonl written there would make
    the restarted child refuse the directory as not a Brigade run directory."""
    from train.run.supervisor import supervise

    child = [sys.executable, "-c", "import sys; sys.exit(1)"]
    assert (
        supervise(
            [],
            1,
            str(tmp_path / "run"),
            str(tmp_path / "run" / "checkpoints"),
            backoff_s=0,
            program=child,
        )
        == 1
    )
    assert not (tmp_path / "run").exists()
