"""A stdout its reader closed (`python -m checkpoint inspect RUN --json | head -1`): every command
ends as it would have, printing no BrokenPipeError traceback, neither where it prints nor at the
interpreter's last flush (errors.py quiet_closed_stdout, in every CLI's main)."""

import io
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from cpu_env import cpu_env

from checkpoint.__main__ import main as checkpoint_main
from checkpoint.manager import Checkpointer
from errors import QuietWhenClosed
from train.cli.console import main as console_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def closed_stdout(monkeypatch):
    """-> put(): sys.stdout becomes a pipe whose reading end is already closed (what `| head -1`
    leaves). Called in the test itself: pytest puts capsys's own stdout back when a test starts."""
    r, w = os.pipe()
    os.close(r)
    stream = io.TextIOWrapper(io.FileIO(w, "w"), write_through=False)

    def put():
        monkeypatch.setattr(sys, "stdout", stream)
        return stream

    yield put
    stream.close()


@pytest.fixture
def checkpoint_dir(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), async_save=False)
    arrays = {f"w{i}": jnp.zeros((4,)) for i in range(20)}
    # more than a pipe holds (64 KiB): `head` is gone before the last write
    meta = {"step": 1, "mesh": {"data": 1}, "config": {"data": {"source": "x" * 200_000}}}
    ck.save(1, {"params": arrays}, meta)
    ck.close()
    return str(tmp_path / "ck")


def test_inspect_into_a_closed_pipe_is_quiet(capsys, closed_stdout, checkpoint_dir):
    stream = closed_stdout()
    assert checkpoint_main(["inspect", checkpoint_dir, "--json"]) == 0
    assert capsys.readouterr().err == ""
    assert sys.stdout is stream  # restored, and its descriptor now /dev/null:
    stream.write("x" * 100_000)
    stream.flush()  # the interpreter's flush at exit has nothing left to fail on


def test_the_console_entry_into_a_closed_pipe_is_quiet(capsys, closed_stdout):
    closed_stdout()
    assert console_main(["--help"]) == 0
    assert capsys.readouterr().err == ""


def test_prints_after_the_reader_left_go_nowhere(closed_stdout):
    stream = closed_stdout()
    quiet = QuietWhenClosed(stream)
    for _ in range(3):  # a training run's step lines: the first failing write, then the rest
        assert quiet.write("step 1 | loss 2.0\n" * 5000) == 90_000
        quiet.flush()
    assert quiet.fileno() == stream.fileno() and not quiet.isatty()


@pytest.mark.slow
def test_python_m_checkpoint_inspect_piped_to_head(checkpoint_dir):
    """The real pipeline: `python -m checkpoint inspect CKPT --json | head -1`."""
    head = subprocess.Popen(["head", "-1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    p = subprocess.run(
        [sys.executable, "-m", "checkpoint", "inspect", checkpoint_dir, "--json"],
        cwd=ROOT,
        env=cpu_env(1),
        stdout=head.stdin,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    head.stdin.close()
    assert head.stdout.read() == b"{\n" and head.wait() == 0
    assert p.returncode == 0 and "Traceback" not in p.stderr and "Broken" not in p.stderr, p.stderr
