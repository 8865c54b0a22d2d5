"""Runtime memory: the devices' counters (where the backend keeps them) and the host's resident
set, per logged step; an out-of-memory failure ends in one line with the predicted and measured
figures and the flags that lower them."""

import jax
import pytest

from errors import UserError
from train.core.config import build
from train.run import loop
from train.run.device_memory import (
    figures,
    host_rss_bytes,
    is_out_of_memory,
    out_of_memory_line,
    size_text,
)
from train.run.loop import Trainer

OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_figures_take_the_fullest_device_and_say_unavailable_without_counters():
    devices = [
        FakeDevice(
            {"bytes_in_use": 3 << 30, "peak_bytes_in_use": 5 << 30, "bytes_limit": 80 << 30}
        ),
        FakeDevice(
            {"bytes_in_use": 4 << 30, "peak_bytes_in_use": 4 << 30, "bytes_limit": 80 << 30}
        ),
    ]
    got = figures(devices)  # the loop logs those that are not None (train/run/run.py)
    assert (got["mem_bytes_in_use"], got["mem_peak_bytes"], got["mem_limit_bytes"]) == (
        4 << 30,
        5 << 30,
        80 << 30,
    )
    assert got["host_rss_bytes"] > 0
    cpu = figures(jax.local_devices())  # XLA:CPU keeps no allocator counters
    stats = jax.local_devices()[0].memory_stats()
    if stats is None:
        assert (
            cpu["mem_bytes_in_use"] is None
            and cpu["mem_peak_bytes"] is None
            and size_text(None) == "unavailable"
        )
    else:
        assert cpu["mem_peak_bytes"] >= cpu["mem_bytes_in_use"] > 0
    before = host_rss_bytes()
    ballast = bytearray(64 << 20)  # the resident set is now, not a peak: it follows an allocation
    assert host_rss_bytes() >= before + (48 << 20)
    del ballast


def test_an_out_of_memory_failure_is_one_line_with_the_figures_and_the_flags():
    with (
        pytest.raises(UserError) as e,
        out_of_memory_line(
            lambda: 3 << 30,
            [
                FakeDevice(
                    {
                        "bytes_in_use": 70 << 30,
                        "peak_bytes_in_use": 79 << 30,
                        "bytes_limit": 80 << 30,
                    }
                )
            ],
            lambda: "step 12",
        ),
    ):
        raise jax.errors.JaxRuntimeError(OOM)
    line = str(e.value)
    assert "\n" not in line and line.startswith("out of device memory (last activity: step 12)")
    assert "needs ~3.00 GiB per device (predicted), measured peak 79.00 GiB of 80.00 GiB" in line, (
        line
    )
    for flag in ("--model.remat full", "--mesh fsdp=N", "--micro-batches N", "--batch-size"):
        assert flag in line, line
    other = jax.errors.JaxRuntimeError("INTERNAL: something else")
    with (
        pytest.raises(jax.errors.JaxRuntimeError),
        out_of_memory_line(lambda: None, [], lambda: ""),
    ):
        raise other  # anything but an allocation failure passes through as it is
    assert is_out_of_memory(jax.errors.JaxRuntimeError(OOM)) and not is_out_of_memory(MemoryError())


def test_fit_turns_an_out_of_memory_compile_into_the_line(tmp_path, monkeypatch):
    tr = Trainer(
        build(
            {
                "model.preset": "tiny",
                "train.batch_size": 8,
                "train.seq_len": 32,
                "logging.progress": False,
                "logging.tensorboard": False,
                "logging.run_dir": str(tmp_path),
            }
        )
    )

    def exhausted(*_):
        raise jax.errors.JaxRuntimeError(OOM)

    monkeypatch.setattr(loop, "compile_checked", exhausted)  # the compile in Trainer.fit
    with pytest.raises(
        UserError,
        match=r"out of device memory \(last activity: compiling the train step\): "
        r"RESOURCE_EXHAUSTED: .*; the compiled step needs ~unavailable",
    ):
        tr.fit()
