"""Shared setup for the CPU benchmarks: 8 fake devices before JAX starts, and the peer config."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The peer shape: the config a mature peer runs at 0.75-0.9 s/step on this machine.
PEER = {
    "model.preset": "tiny",
    "model.d_model": 256,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 4,
    "model.d_ff": 1024,
    "model.vocab_size": 32000,
    "model.max_seq_len": 128,
    "train.seq_len": 128,
    "train.batch_size": 8,
    "parallelism.mesh": "fsdp=8",
    "data.source": "synthetic",
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "logging.progress": False,
    "logging.tensorboard": False,
}


def median_time(fn, *args, reps: int) -> float:
    """Seconds per call of `fn(*args)`: compiled by a first call, then the median of `reps` timed
    calls, each waited for."""
    import statistics
    import time

    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
