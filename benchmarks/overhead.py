"""Framework overhead: steady-state step time of `Trainer.fit()` vs a minimal hand-written
`jax.jit` step of the same model, batch and mesh, interleaved in one run.

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
from train.core.config import build
from train.run.loop import Trainer


def framework(overrides: dict, steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(
            build({**overrides, "train.steps": steps, "logging.log_every": 5, "logging.run_dir": d})
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
            def loss(p):
                logits, _ = model_lib.apply(cfg, p, tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

            loss_value, g = jax.value_and_grad(loss)(params)
            u, opt = tx.update(g, opt, params)
            return optax.apply_updates(params, u), opt, loss_value

        f = jax.jit(
            step,
            in_shardings=(sh.params, sh.opt_state, tr.setup.batch_sharding),
            out_shardings=(sh.params, sh.opt_state, None),
            donate_argnums=(0, 1),
        )
        params, opt, loss_value = f(params, opt, tokens)
        loss_value.block_until_ready()
        t0 = time.perf_counter()
        for _ in range(steps):
            params, opt, loss_value = f(params, opt, tokens)
        loss_value.block_until_ready()
    return (time.perf_counter() - t0) / steps


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
    f, h = min(fw), min(hw)
    print(f"framework loop   {f:.3f} s/step  (runs: {', '.join(f'{x:.3f}' for x in fw)})")
    print(f"hand-written jit {h:.3f} s/step  (runs: {', '.join(f'{x:.3f}' for x in hw)})")
    print(f"overhead: {100 * (f / h - 1):+.1f}%")


if __name__ == "__main__":
    main()
