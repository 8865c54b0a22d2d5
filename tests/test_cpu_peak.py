"""MFU on CPU (mesh/devices.py, train/run/metrics.py): the peak is the cores' FMA peak from the
CPU's flags and clock, which a loaded machine does not lower (a matmul timed at start-up did, and
MFU read 139-238%); a step faster than the peak raises the peak, in one line, never an MFU over
100%."""

import jax
import pytest

from mesh import devices as peaks
from train.run import metrics
from train.run.goodput import Goodput

INTEL = """processor	: 0
model name	: Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz
cpu MHz		: 800.000
flags		: fpu sse2 avx fma avx2 avx512f avx512_bf16 amx_bf16
processor	: 1
cpu MHz		: 3400.125
"""


@pytest.fixture
def intel(monkeypatch):
    monkeypatch.setattr(peaks, "_cpuinfo", lambda: INTEL)
    monkeypatch.setattr(peaks.glob, "glob", lambda pattern: [])  # no cpufreq: a VM's view
    monkeypatch.setattr(peaks, "usable_cores", lambda: 4)


def test_the_peak_comes_from_the_flags_and_the_highest_clock(intel):
    peak, text = peaks.fma_peak("float32")
    # 4 cores x 3.4 GHz (the fastest core's current clock, above the rated 2.3) x 2 AVX-512 FMAs
    assert peak == pytest.approx(4 * 3.400125e9 * 64)
    assert "4 cores x 3.40 GHz (/proc/cpuinfo cpu MHz) x 64 FLOP/cycle (AVX-512 FMA)" in text
    assert peaks.fma_peak("bfloat16")[0] == pytest.approx(4 * 3.400125e9 * 1024)  # AMX
    assert peaks.flops_per_cycle({"sse2", "avx", "avx2"}, "float32") == (32, "AVX2 FMA")
    assert peaks.flops_per_cycle({"foo"}, "float32") is None


def test_a_loaded_machine_does_not_lower_the_peak(intel, monkeypatch):
    """Before, the peak was a matmul timed at start-up: a busy host measured a fraction of it."""
    monkeypatch.setattr(peaks, "measured_host_flops", lambda dtype: 1e6)  # a loaded machine
    devices = jax.devices()[:2]
    peak, text = peaks.peak_flops("float32", devices=devices)
    assert peak == pytest.approx(4 * 3.400125e9 * 64) and text.startswith("CPU FMA peak 4 cores")
    # where the flags cannot be read, the fastest matmul measured, and said so
    monkeypatch.setattr(peaks, "_cpuinfo", lambda: "")
    assert peaks.peak_flops("float32", devices=devices) == (
        1e6,
        "fastest measured CPU matmul 0 GFLOP/s per host",
    )


def test_a_step_faster_than_the_peak_raises_the_peak_and_says_so(capsys):
    stats = metrics.StepStats(1000, 1e6, 1e8, 1, 0)  # 1e9 FLOP a step, against a 0.1 GFLOP/s peak
    rec, _, _ = stats.record(
        1,
        {"loss": 1.0, "grad_norm": 1.0, "lr": 0.1, "skipped_steps": 0, "bad_in_a_row": 0},
        Goodput(),
    )
    assert rec["mfu"] == pytest.approx(1.0) and stats.peak > 1e8
    out = capsys.readouterr().out
    assert "warning: step 1 ran at " in out and "above the peak of 0 GFLOP/s" in out, out
