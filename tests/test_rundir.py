"""The run directory is the run's own: a second run on it, a directory Brigade did not create,
and a full disk at the first write each end in one line and exit 2, with the user's files
untouched; a SIGKILLed run never blocks its own restart. Without --run-dir each run gets a fresh
named directory, runs/latest links to the newest, and --resume latest continues it."""

import datetime
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cpu_env import cpu_env
from data_files import file_hashes as listing

from errors import UserError
from train.core.config import build, dump
from train.run.named_runs import start_named_run
from train.run.rundir import LOCK, MARKER, RunDirLock, check_writable_run_dir
from train.run.supervisor import Fresh, child_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(1, PYTHONUNBUFFERED="1")
CMD = [
    "--model",
    "tiny",
    "--batch-size",
    "4",
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


def train(args, run_dir, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "train", *CMD, "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def test_lock_names_its_holder_and_is_released(tmp_path):
    run = tmp_path / "run"
    with RunDirLock(str(run)):
        assert (run / MARKER).is_file() and (run / LOCK).is_file()
        with pytest.raises(
            UserError, match=rf"in use by another run \(host .+, pid {os.getpid()}, since .+\)"
        ):
            RunDirLock(str(run)).acquire()
    with RunDirLock(str(run)):  # released on exit: the same directory can be claimed again
        pass


@pytest.mark.parametrize(
    "entries",
    [
        {"config.json": '{"name": "my project"}'},
        {"notes.txt": "mine"},
        {"config.json": "[1, 2]", "data.csv": "a,b"},
    ],
)
def test_a_directory_brigade_did_not_create_is_refused(tmp_path, entries):
    for name, text in entries.items():
        (tmp_path / name).write_text(text)
    before = listing(tmp_path)
    with pytest.raises(UserError, match="not a Brigade run directory"):
        RunDirLock(str(tmp_path)).acquire()
    assert listing(tmp_path) == before and not (tmp_path / LOCK).exists()


def test_what_a_run_may_write_into(tmp_path):
    check_writable_run_dir(str(tmp_path / "new"))  # new
    check_writable_run_dir(str(tmp_path))  # empty
    (tmp_path / "slurm-123.out").write_text("job log")  # a scheduler's log made before the run
    check_writable_run_dir(str(tmp_path))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(
        '{"model": {}, "train": {}, "parallelism": {}, "data": {}, "logging": {}, "checkpoint": {}}'
    )
    check_writable_run_dir(str(legacy))  # written before the marker existed
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        check_writable_run_dir(str(tmp_path / "file"))


@pytest.mark.slow
def test_a_second_run_on_a_busy_run_dir_exits_2_and_a_killed_run_restarts(tmp_path):
    run = tmp_path / "run"
    first = train(["--steps", "100000", "--checkpoint.every", "0"], run)
    try:
        deadline = time.monotonic() + 240
        # past the lock, training
        while time.monotonic() < deadline and not (run / "metrics.jsonl").exists():
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.5)
        before = listing(run)
        second = train(["--steps", "3"], run)
        _, err = second.communicate(timeout=240)
        assert second.returncode == 2, err[-3000:]
        lines = error_lines(err)
        assert (
            len(lines) == 1
            and "in use by another run" in lines[0]
            and f"pid {first.pid}" in lines[0]
        ), err
        after = listing(run)
        assert {k: v for k, v in after.items() if k in before and k != "metrics.jsonl"} == {
            k: v for k, v in before.items() if k != "metrics.jsonl"
        }  # the first run's files untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = train(
        ["--steps", "2", "--resume", "none", "--checkpoint.dir", str(tmp_path / "ck")], run
    )
    _, err = third.communicate(timeout=240)
    assert third.returncode == 0, err[-3000:]  # the kernel dropped the killed run's lock


@pytest.mark.slow
def test_run_dir_of_another_project_is_refused_by_the_cli(tmp_path):
    (tmp_path / "config.json").write_text('{"learning_rate": 0.1}')
    before = listing(tmp_path)
    p = train(["--steps", "2"], tmp_path)
    _, err = p.communicate(timeout=240)
    assert (
        p.returncode == 2 and len(error_lines(err)) == 1 and "not a Brigade run directory" in err
    ), err
    assert listing(tmp_path) == before


@pytest.fixture
def small_disk(tmp_path):
    """A 256 kB tmpfs (root only; CI runs as root): writes past it fail with ENOSPC."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_disk_at_the_first_write_is_one_line(small_disk):
    with open(
        small_disk / "filler", "wb", buffering=0
    ) as f:  # fill it: the run's first write fails
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    p = train(
        ["--steps", "2", "--checkpoint.dir", str(small_disk.parent / "ck")], small_disk / "run"
    )
    _, err = p.communicate(timeout=240)
    lines = error_lines(err)
    assert p.returncode == 2 and len(lines) == 1, err[-3000:]
    assert "No space left on device" in lines[0] and str(small_disk / "run") in lines[0], lines


NOON = datetime.datetime(2026, 1, 2, 12, 0, 0)


def test_runs_without_run_dir_get_fresh_names_and_latest_links_the_newest(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    cfg = build({"model.preset": "tiny", "parallelism.mesh": "data=2,fsdp=-1"})
    first = start_named_run(cfg, NOON)
    second = start_named_run(cfg, NOON)  # the same second: a suffix keeps them apart
    assert first.logging.run_dir == os.path.join("runs", "20260102-120000-tiny-data2.fsdpN")
    assert second.logging.run_dir == first.logging.run_dir + "-2"
    assert os.path.realpath("runs/latest") == os.path.realpath(second.logging.run_dir)
    # relative: the folder can move
    assert os.readlink("runs/latest") == "20260102-120000-tiny-data2.fsdpN-2"
    assert sorted(os.listdir("runs")) == [
        "20260102-120000-tiny-data2.fsdpN",
        "20260102-120000-tiny-data2.fsdpN-2",
        "latest",
    ]  # no temporary link left behind
    explicit = build({"logging.run_dir": str(tmp_path / "mine"), "checkpoint.resume": "latest"})
    assert start_named_run(explicit, NOON) is explicit  # an explicit --run-dir is used as it is
    assert "run directory: runs/20260102-120000-tiny-data2.fsdpN-2" in capsys.readouterr().out


def test_an_older_real_runs_latest_is_left_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    (tmp_path / "runs" / "latest" / "metrics.jsonl").write_text("{}\n")
    before = listing(tmp_path / "runs" / "latest")
    cfg = start_named_run(build({"model.preset": "tiny"}), NOON)
    assert cfg.logging.run_dir == os.path.join("runs", "20260102-120000-tiny-dataN")
    assert not os.path.islink("runs/latest") and listing(tmp_path / "runs" / "latest") == before
    assert "no longer updated" in capsys.readouterr().err


def test_a_cluster_job_needs_an_explicit_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(
        UserError, match=r"^--run-dir: a multi-process or cluster job \(SLURM_JOB_ID is set\)"
    ):
        start_named_run(build({}), NOON)
    assert not (tmp_path / "runs").exists()


def test_resume_latest_checks_the_settings_of_the_run_it_continues(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = start_named_run(
        build({"model.preset": "tiny", "train.steps": 4, "checkpoint.resume": "latest"}), NOON
    )
    assert old.checkpoint.resume == "auto"  # no earlier run: a fresh start
    with open(os.path.join(old.logging.run_dir, "config.json"), "w") as f:
        f.write(dump(old))
    # mesh and eval: no matter
    changed = build(
        {
            "model.preset": "tiny",
            "train.steps": 6,
            "train.lr": 0.5,
            "checkpoint.resume": "latest",
            "parallelism.mesh": "fsdp=-1",
            "train.eval_every": 3,
        }
    )
    with pytest.raises(UserError) as e:
        start_named_run(changed, NOON)
    assert (
        "train.steps 4 -> 6" in str(e.value)
        and "train.lr" in str(e.value)
        and "eval_every" not in str(e.value)
    )
    assert f"--resume {old.logging.run_dir}" in str(e.value) and "\n" not in str(e.value)
    same = start_named_run(
        build(
            {
                "model.preset": "tiny",
                "train.steps": 4,
                "checkpoint.resume": "latest",
                "parallelism.mesh": "fsdp=-1",
            }
        ),
        NOON,
    )
    assert (
        same.checkpoint.resume == old.logging.run_dir
        and same.logging.run_dir != old.logging.run_dir
    )


def test_resume_latest_through_a_dangling_link_names_it_and_continues_the_newest_run(
    tmp_path, monkeypatch, capsys
):
    """runs/latest points at a run that was deleted: --resume latest says so, naming the link's
    target, and continues the newest run that exists (it only reads that run); with none left it
    starts a new one, saying why."""
    monkeypatch.chdir(tmp_path)
    settings = {"model.preset": "tiny", "train.steps": 4}
    runs = []
    for minute in (0, 1, 2):  # three runs; the newest is then deleted
        run = start_named_run(build(settings), NOON + datetime.timedelta(minutes=minute))
        with open(os.path.join(run.logging.run_dir, "config.json"), "w") as f:
            f.write(dump(run))
        runs.append(run.logging.run_dir)
    (tmp_path / "runs" / "20260102-115900-tiny-dataN").mkdir()  # older, never started: no config
    for name in os.listdir(runs[2]):
        os.remove(os.path.join(runs[2], name))
    os.rmdir(runs[2])
    capsys.readouterr()
    later = NOON + datetime.timedelta(minutes=5)
    cont = start_named_run(build({**settings, "checkpoint.resume": "latest"}), later)
    out = capsys.readouterr().out
    assert cont.checkpoint.resume == runs[1], out  # the newest run that still exists
    assert (
        f"runs/latest is a dangling link (to {os.path.basename(runs[2])}, which does not exist);"
        f" continuing the newest run that exists, {runs[1]}" in out
    ), out
    for run in runs[:2] + [cont.logging.run_dir]:  # nothing left to continue
        for name in os.listdir(run):
            os.remove(os.path.join(run, name))
        os.rmdir(run)
    fresh = start_named_run(build({**settings, "checkpoint.resume": "latest"}), later)
    assert fresh.checkpoint.resume == "auto"
    assert "no other run under runs; starting a new one" in capsys.readouterr().out


def test_the_supervisor_gives_every_restart_the_one_named_run():
    argv = ["--model", "tiny", "--resume", "latest"]
    fresh = Fresh("runs/20260102-120000-tiny-dataN", "runs/20260101-080000-tiny-dataN")
    first, restart = child_argv(argv, fresh, None), child_argv(argv, fresh, 4)
    assert first[-4:] == ["--run-dir", fresh.run_dir, "--resume", fresh.resume]
    assert restart[-4:] == [
        "--run-dir",
        fresh.run_dir,
        "--resume",
        "auto",
    ]  # its own checkpoint, once it has one
    assert child_argv(argv, None, 4) == argv  # an explicit --run-dir: the command as it was


def named_run(args, cwd, **env):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            *CMD,
            "--data",
            "synthetic",
            "--steps",
            "4",
            "--checkpoint.every",
            "2",
            "--checkpoint.async",
            "false",
            *args,
        ],
        cwd=cwd,
        env={**ENV, **env},
        text=True,
        capture_output=True,
        timeout=240,
    )


@pytest.mark.slow
def test_resume_latest_continues_the_newest_run_from_the_command_line(tmp_path):
    hung = named_run(["--train.step_timeout", "2"], tmp_path, BRIGADE_INJECT_HANG_STEPS="3")
    assert hung.returncode == 4, hung.stderr[-3000:]  # the watchdog: step 2 is saved, 3 never ends
    first = os.path.realpath(tmp_path / "runs" / "latest")
    refused = named_run(["--resume", "latest", "--steps", "6"], tmp_path)
    lines = error_lines(refused.stderr)
    assert refused.returncode == 2 and len(lines) == 1 and "train.steps 4 -> 6" in lines[0], (
        refused.stderr[-3000:]
    )
    resumed = named_run(["--resume", "latest"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = os.path.realpath(tmp_path / "runs" / "latest")
    assert second != first and sorted(os.listdir(tmp_path / "runs")) == sorted(
        ["latest", os.path.basename(first), os.path.basename(second)]
    )
    assert "checkpoints/2 (step 2," in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    with open(os.path.join(second, "summary.json")) as f:
        assert json.load(f)["resumed_from"] == 2
