"""The run directory is the run's own: a second run on it, a directory Brigade did not create,
and a full disk at the first write each end in one line and exit 2, with the user's files
untouched; a SIGKILLed run never blocks its own restart."""
import os
import signal
import subprocess
import sys
import time

import pytest

from cpu_env import cpu_env
from errors import UserError
from data_files import file_hashes as listing
from train.rundir import LOCK, MARKER, RunDirLock, check_writable_run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(1, PYTHONUNBUFFERED="1")
CMD = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--log-every", "1", "--eval-every", "0",
       "--train.sample_tokens", "0", "--logging.progress", "false", "--logging.tensorboard", "false"]


def train(args, run_dir, **kw):
    return subprocess.Popen([sys.executable, "-m", "train", *CMD, "--run-dir", str(run_dir), *args], cwd=ROOT,
                            env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def test_lock_names_its_holder_and_is_released(tmp_path):
    run = tmp_path / "run"
    with RunDirLock(str(run)):
        assert (run / MARKER).is_file() and (run / LOCK).is_file()
        with pytest.raises(UserError, match=rf"in use by another run \(host .+, pid {os.getpid()}, since .+\)"):
            RunDirLock(str(run)).acquire()
    with RunDirLock(str(run)):  # released on exit: the same directory can be claimed again
        pass


@pytest.mark.parametrize("entries", [{"config.json": '{"name": "my project"}'}, {"notes.txt": "mine"},
                                     {"config.json": "[1, 2]", "data.csv": "a,b"}])
def test_a_directory_brigade_did_not_create_is_refused(tmp_path, entries):
    for name, text in entries.items():
        (tmp_path / name).write_text(text)
    before = listing(tmp_path)
    with pytest.raises(UserError, match="not a Brigade run directory"):
        RunDirLock(str(tmp_path)).acquire()
    assert listing(tmp_path) == before and not (tmp_path / LOCK).exists()


def test_what_a_run_may_write_into(tmp_path):
    check_writable_run_dir(str(tmp_path / "new"))            # new
    check_writable_run_dir(str(tmp_path))                    # empty
    (tmp_path / "slurm-123.out").write_text("job log")       # a scheduler's log made before the run
    check_writable_run_dir(str(tmp_path))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text('{"model": {}, "train": {}, "parallelism": {}, "data": {},'
                                        ' "logging": {}, "checkpoint": {}}')
    check_writable_run_dir(str(legacy))                      # written before the marker existed
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        check_writable_run_dir(str(tmp_path / "file"))


@pytest.mark.slow
def test_a_second_run_on_a_busy_run_dir_exits_2_and_a_killed_run_restarts(tmp_path):
    run = tmp_path / "run"
    first = train(["--steps", "100000", "--checkpoint.every", "0"], run)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (run / "metrics.jsonl").exists():  # past the lock, training
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.5)
        before = listing(run)
        second = train(["--steps", "3"], run)
        _, err = second.communicate(timeout=240)
        assert second.returncode == 2, err[-3000:]
        lines = error_lines(err)
        assert len(lines) == 1 and "in use by another run" in lines[0] and f"pid {first.pid}" in lines[0], err
        after = listing(run)
        assert {k: v for k, v in after.items() if k in before and k != "metrics.jsonl"} == \
               {k: v for k, v in before.items() if k != "metrics.jsonl"}  # the first run's files untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = train(["--steps", "2", "--resume", "none", "--checkpoint.dir", str(tmp_path / "ck")], run)
    _, err = third.communicate(timeout=240)
    assert third.returncode == 0, err[-3000:]  # the kernel dropped the killed run's lock


@pytest.mark.slow
def test_run_dir_of_another_project_is_refused_by_the_cli(tmp_path):
    (tmp_path / "config.json").write_text('{"learning_rate": 0.1}')
    before = listing(tmp_path)
    p = train(["--steps", "2"], tmp_path)
    _, err = p.communicate(timeout=240)
    assert p.returncode == 2 and len(error_lines(err)) == 1 and "not a Brigade run directory" in err, err
    assert listing(tmp_path) == before


@pytest.fixture
def small_disk(tmp_path):
    """A 256 kB tmpfs (root only; CI runs as root): writes past it fail with ENOSPC."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_disk_at_the_first_write_is_one_line(small_disk):
    with open(small_disk / "filler", "wb", buffering=0) as f:  # fill it: the run's first write fails
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    p = train(["--steps", "2", "--checkpoint.dir", str(small_disk.parent / "ck")], small_disk / "run")
    _, err = p.communicate(timeout=240)
    lines = error_lines(err)
    assert p.returncode == 2 and len(lines) == 1, err[-3000:]
    assert "No space left on device" in lines[0] and str(small_disk / "run") in lines[0], lines
