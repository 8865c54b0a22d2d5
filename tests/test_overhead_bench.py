"""benchmarks/overhead.py: the hand-written baseline is timed as the framework times itself, and
its loss is the framework's (token_xent), not another cross-entropy."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import model as model_lib
from models.presets import PRESETS

REPO = Path(__file__).resolve().parent.parent


def _overhead():
    spec = importlib.util.spec_from_file_location("overhead", REPO / "benchmarks" / "overhead.py")
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))  # its `import common`
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return mod


def test_baseline_is_the_median_interval_without_the_first(monkeypatch):
    """A slow first interval (compile) is dropped and one slow interval does not move the median,
    as for the framework's logged step_time_s; a mean over all steps would count both. The clock
    is faked: each step advances it by its own duration."""
    overhead = _overhead()
    clock = [0.0]
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: clock[0])
    durations = iter([5.0] * 5 + [1.0] * 5 + [3.0] * 5 + [1.0] * 5 + [1.0] * 5 + [2.0] * 2)

    def one_step():
        clock[0] += next(durations)
        return jnp.zeros(())

    # intervals of 5, 5, 5, 5, 5 and 2 steps: per-step 5, 1, 3, 1, 1, 2; the median of the last 5
    assert overhead.interval_median(one_step, 27, 5) == 1.0
    with pytest.raises(ValueError):  # one interval: nothing left after the warm-up
        overhead.interval_median(lambda: jnp.zeros(()), 5, 5)


def test_hand_loss_is_the_frameworks():
    overhead = _overhead()
    cfg = PRESETS["tiny"]
    params = model_lib.init(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    _, loss_sum, _ = model_lib.objective(cfg, params, batch)
    np.testing.assert_allclose(
        overhead.hand_loss(cfg, params, tokens), loss_sum / batch["targets"].size, rtol=1e-6
    )
