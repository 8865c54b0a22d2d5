"""Framework overhead: steady-state step time of `Trainer.fit()` vs a minimal hand-written
`jax.jit` step of the same model, loss, batch and mesh, interleaved in one run.

Both sides are timed alike: the device is synced every LOG_EVERY steps (the framework fetches its
metrics there), each interval's time per step is one sample, the first interval (compile and
warm-up) is dropped, and a run's figure is the median of its samples. The hand-written loss is the
framework's per-token cross-entropy (models.loss.token_xent), averaged over the batch's tokens.

    python benchmarks/overhead.py [--steps 30] [--reps 2] [--set section.field=value ...]
"""

import argparse
import statistics
import tempfile
import time

import common  # sets XLA_FLAGS first
import jax
import optax

from mesh.rules import axis_rules
from models import model as model_lib
from models.loss import token_xent
from train.core.config import build
from train.run.loop import Trainer

LOG_EVERY = 5  # steps between syncs, on both sides


def framework(overrides: dict, steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(
            build(
                {
                    **overrides,
                    "train.steps": steps,
                    "logging.log_every": LOG_EVERY,
                    "logging.run_dir": d,
                }
            )
        )
        tr.fit()
    return statistics.median(r["step_time_s"] for r in tr.history[1:])


def hand_written(overrides: dict, steps: int) -> float:
    """What an expert would write by hand: the same model function, optimizer and shardings (params
    and optimizer state sharded alike), a bare loss, jit with donation, no loop machinery."""
    tr = Trainer(build({**overrides, "train.steps": steps}))
    cfg, t, tx = tr.setup.model_cfg, tr.cfg.train, tr.setup.tx
    sh = tr.setup.state_shardings
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        params = jax.jit(lambda k: model_lib.init(cfg, k), out_shardings=sh.params)(
            jax.random.key(0)
        )
        opt = jax.jit(tx.init, out_shardings=sh.opt_state)(params)
        tokens = jax.device_put(
            jax.random.randint(jax.random.key(1), (t.batch_size, t.seq_len + 1), 0, 256),
            tr.setup.batch_sharding,
        )

        def step(params, opt, tokens):
            loss_value, g = jax.value_and_grad(lambda p: hand_loss(cfg, p, tokens))(params)
            u, opt = tx.update(g, opt, params)
            return optax.apply_updates(params, u), opt, loss_value

        f = jax.jit(
            step,
            in_shardings=(sh.params, sh.opt_state, tr.setup.batch_sharding),
            out_shardings=(sh.params, sh.opt_state, None),
            donate_argnums=(0, 1),
        )
        carry = [params, opt]

        def one_step():
            carry[0], carry[1], loss_value = f(carry[0], carry[1], tokens)
            return loss_value

        return interval_median(one_step, steps, LOG_EVERY)


def hand_loss(cfg, params, tokens_BT):
    """The framework's loss written by hand: the mean per-token cross-entropy (token_xent, the
    function the framework's objective sums) of the next token."""
    logits_BTV, _ = model_lib.apply(cfg, params, tokens_BT[:, :-1])
    return token_xent(logits_BTV, tokens_BT[:, 1:]).mean()


def interval_median(one_step, steps: int, every: int) -> float:
    """Time `steps` calls of `one_step` (-> an array to fetch) as the framework's loop times
    itself: fetch every `every` steps, one sample per interval (its time / its steps), the first
    interval (compile, warm-up) dropped; -> the median sample."""
    per_step, last, t0 = [], 0, time.perf_counter()
    for i in range(1, steps + 1):
        out = one_step()
        if i % every == 0 or i == steps:
            jax.device_get(out)
            now = time.perf_counter()
            per_step.append((now - t0) / (i - last))
            last, t0 = i, now
    if len(per_step) < 2:
        raise ValueError(f"{steps} steps make {len(per_step)} interval(s) of {every}; need 2+")
    return statistics.median(per_step[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--set", nargs="*", default=[], help="section.field=value overrides of the peer config"
    )
    a = ap.parse_args()
    overrides = dict(common.PEER)
    for kv in a.set:
        k, _, v = kv.partition("=")
        overrides[k] = v
    fw, hw = [], []
    for _ in range(a.reps):  # interleaved so both see the same machine noise
        fw.append(framework(overrides, a.steps))
        hw.append(hand_written(overrides, a.steps))
    pairs = [a / b for a, b in zip(fw, hw)]
    print(f"framework loop   s/step, runs: {', '.join(f'{x:.3f}' for x in fw)}")
    print(f"hand-written jit s/step, runs: {', '.join(f'{x:.3f}' for x in hw)}")
    print(
        f"overhead: {100 * (statistics.median(pairs) - 1):+.1f}% (median of the pairs'"
        f" ratios {', '.join(f'{r:.3f}' for r in pairs)})"
    )


if __name__ == "__main__":
    main()
