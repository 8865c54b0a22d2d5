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


def state_and_batch(cfg):
    """(RunSetup, initial train state, the run's first batch) of a built config on its mesh: what
    the step benchmarks time the train step on."""
    from mesh.build import make_mesh
    from train.core import state as train_state
    from train.core.setup import setup
    from train.data import make_pipeline

    s = setup(cfg, make_mesh(cfg.parallelism.mesh))
    state = train_state.create(cfg.model, s.tx, s.mesh, s.rules, 0, s.sync)
    t = cfg.train
    batch, _ = make_pipeline(
        cfg.data,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        seed=0,
        batch_sharding=s.batch_sharding,
        vocab_size=cfg.model.vocab_size,
    ).next()
    return s, state, batch
