"""MoE benchmarks on CPU (8 fake devices):

    python benchmarks/moe.py kernels [--reps 5]   # the MoE layer alone, forward + backward
    python benchmarks/moe.py steps [--steps 6]    # moe-default's train steps: dispatch x mesh, plan
    python benchmarks/moe.py exchange [--reps 5]  # dropless expert=8: fixed vs ragged exchange

`kernels` times the dropless grouped-matmul kernels (lax.ragged_dot vs padded blocks) and capacity
dispatch at moe-default's layer shape (16 x 128 tokens, d_model 256, 8 experts of 384, top-2),
next to a dense SwiGLU with the same active FLOPs (the floor);
`steps` times whole train steps of moe-default for dropless/capacity on data=8 (experts replicated,
the expert axis unused) and expert=8 (expert parallel), and prints plan's all-to-all bytes next to
the theory;
`exchange` routes moe-default's layer input (16 x 128 tokens, router at init) on expert=8 and
counts the rows each device sends per direction with the fixed buffers and with the ragged
exchange (the real rows), then times the layer forward + backward with both. On CPU the ragged
exchange is the emulation (a fixed all_to_all of every slice at full length), so its time here
says nothing about GPU/TPU; the row counts do.
"""

import argparse
import dataclasses
import statistics
import tempfile
import time

import common  # 8 fake devices, repo on sys.path; the timer
import jax
import numpy as np

from mesh.build import make_mesh
from mesh.rules import axis_rules, logical_to_spec, make_rules
from models import moe
from models.presets import PRESETS
from plan.report import analyze
from train.core.config import build
from train.core.setup import compile_step, create_state
from train.run.loop import Trainer


def kernels(reps: int) -> None:
    cfg = dataclasses.replace(PRESETS["moe-default"], dtype="float32")
    d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_width
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (16, 128, d))
    w = (
        0.02 * jax.random.normal(ks[1], (d, e)),
        jax.random.normal(ks[2], (e, d, f)) / d**0.5,
        jax.random.normal(ks[3], (e, d, f)) / d**0.5,
        jax.random.normal(ks[4], (e, f, d)) / f**0.5,
    )

    def layer(c, kernel):
        def loss(x, router, wg, wu, wd):
            idx, gate, _ = moe.route(c, x, router)
            return moe.experts(c, x, idx, gate, wg, wu, wd, kernel)[0].sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

    k = cfg.experts_per_token
    wide = tuple(jax.random.normal(kk, (d, k * f)) / d**0.5 for kk in ks[2:4]) + (
        jax.random.normal(ks[4], (k * f, d)) / (k * f) ** 0.5,
    )

    def dense_active(x, wg, wu, wd):  # the floor: one dense SwiGLU with the MoE's active width k*F
        return ((jax.nn.silu(x @ wg) * (x @ wu)) @ wd).sum()

    variants = {
        "dropless, blocks": layer(cfg, "blocks"),
        "dropless, ragged_dot": layer(cfg, "ragged"),
        "capacity 1.25": layer(dataclasses.replace(cfg, dispatch="capacity"), None),
    }
    print(
        f"MoE layer fwd+bwd, 2048 tokens, D={d}, {e} experts of F={f},"
        f" top-{cfg.experts_per_token}, 1 device:"
    )
    for name, fn in variants.items():
        print(f"  {name:<38}{1e3 * common.median_time(fn, x, *w, reps=reps):8.1f} ms")
    fn = jax.jit(jax.grad(dense_active, argnums=(0, 1, 2, 3)))
    name = f"dense SwiGLU of width k*F={k * f} (floor)"
    print(f"  {name:<38}{1e3 * common.median_time(fn, x, *wide, reps=reps):8.1f} ms")


def timed_run(overrides: dict, tok, n_steps: int, with_report: bool):
    """One configuration's compiled train step run n_steps times on the fixed batch `tok`:
    (step seconds, compile seconds, the last step's metrics, the plan report or None)."""
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(build({**overrides, "logging.run_dir": d}))
        state = create_state(tr.setup)
        batch = jax.device_put(
            {
                "inputs": tok[:, :-1],
                "targets": tok[:, 1:],
                "weights": np.ones((16, 128), np.float32),
            },
            tr.setup.batch_sharding,
        )
        t0 = time.perf_counter()
        fn = compile_step(tr.setup, state, batch)
        compile_s = time.perf_counter() - t0
        times = []
        with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
            for _ in range(n_steps):
                t0 = time.perf_counter()
                state, m = fn(state, batch)
                jax.block_until_ready(m["loss"])
                times.append(time.perf_counter() - t0)
        r = analyze(tr.setup) if with_report else None
    return times, compile_s, m, r


def steps(n_steps: int, meshes=("data=8", "expert=8"), dispatches=("dropless", "capacity")) -> None:
    base = {
        "model.preset": "moe-default",
        "train.batch_size": 16,
        "train.seq_len": 128,
        "train.steps": n_steps,
        "train.eval_every": 0,
        "train.sample_tokens": 0,
        "logging.progress": False,
        "logging.tensorboard": False,
    }
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 256, (16, 129)).astype(np.int32)
    print(
        f"moe-default train step (16 x 128 tokens), median of {n_steps - 1} steps after the first:"
    )
    for mesh in meshes:
        for dispatch in dispatches:
            overrides = {**base, "parallelism.mesh": mesh, "model.dispatch": dispatch}
            times, compile_s, m, r = timed_run(overrides, tok, n_steps, mesh == "expert=8")
            line = (
                f"  {mesh:<10}{dispatch:<10}{statistics.median(times[1:]):7.3f} s/step"
                f"  compile {compile_s:5.1f} s  dropped {float(m['moe/dropped_fraction']):.3f}"
            )
            if r:
                th = r["theory_detail"]["all-to-all@expert"]
                line += (
                    f"  all-to-all {r['collectives']['all-to-all'] / 2**20:.2f} MiB measured,"
                    f" {th['operand_bytes'] / 2**20:.2f} MiB theory,"
                    f" {th['ideal_bytes'] / 2**20:.2f} MiB ragged ideal"
                )
            print(line, flush=True)


def exchange(reps: int, mesh_spec: str = "expert=8") -> None:
    cfg = dataclasses.replace(PRESETS["moe-default"], dtype="float32")
    d, e, f, k = cfg.d_model, cfg.n_experts, cfg.expert_width, cfg.experts_per_token
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (16, 128, d))
    w = (
        cfg.init_std * jax.random.normal(ks[1], (d, e)),
        jax.random.normal(ks[2], (e, d, f)) / d**0.5,
        jax.random.normal(ks[3], (e, d, f)) / d**0.5,
        jax.random.normal(ks[4], (e, f, d)) / f**0.5,
    )
    mesh = make_mesh(mesh_spec)
    ep = dict(zip(mesh.axis_names, mesh.devices.shape))["expert"]
    n, x_count = x.shape[0] * x.shape[1] // mesh.devices.size, e // ep
    # each device's rows
    idx = np.asarray(moe.route(cfg, x, w[0])[0]).reshape(mesh.devices.size, n * k)
    own = np.mean([np.sum(idx[i] // x_count == i % ep) for i in range(mesh.devices.size)])
    fixed = ep * n * min(k, x_count)
    print(
        f"dropless {mesh_spec}, {n} tokens x top-{k} per device, rows of d_model sent per direction"
        " and device:"
    )
    print(
        f"  fixed buffers {fixed} ({fixed - fixed // ep} leave the device); ragged {n * k}"
        f" ({n * k - own:.0f} leave on average): {fixed / (n * k):.1f}x fewer rows, receive buffer"
        f" kept at {fixed}"
    )

    def layer(exchange):
        def loss(x, router, wg, wu, wd):
            idx, gate, _ = moe.route(cfg, x, router)
            return moe.experts(cfg, x, idx, gate, wg, wu, wd, None, exchange)[0].sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

    with jax.set_mesh(mesh), axis_rules(make_rules()):
        xs = jax.device_put(x, logical_to_spec(moe.TOKENS_BT))
        for name in ("fixed", "emulated"):
            ms = 1e3 * common.median_time(layer(name), xs, *w, reps=reps)
            print(f"  layer fwd+bwd, {name:<9}{ms:8.1f} ms (CPU)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("kernels", "steps", "exchange"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--mesh", default="data=8;expert=8", help="meshes for `steps`, ';'-separated")
    ap.add_argument("--dispatch", default="dropless,capacity", help="dispatch modes for `steps`")
    a = ap.parse_args()
    if a.what == "kernels":
        kernels(a.reps)
    elif a.what == "exchange":
        exchange(a.reps)
    else:
        steps(a.steps, a.mesh.split(";"), a.dispatch.split(","))


if __name__ == "__main__":
    main()
