"""Pipeline parallelism: step time (forward + backward of a Block stack) and per-device memory for
pipeline=1/2/4, gpipe, circular (repeats 2), 1f1b, zb_h1 and interleaved_1f1b (repeats 2), M in
{P, 2P, 4P}; measured vs predicted bubble.

    python benchmarks/pipeline.py [--layers 8] [--d-model 128] [--batch 32] [--seq 64] [--steps 5]
        [--model-order] [--schedules gpipe,circular,1f1b,zb_h1,interleaved_1f1b]
        [--fixed-micro-batch]

`--fixed-micro-batch`: the batch grows with M (batch = M x batch/P rows), which is how 1F1B is used
to shrink the bubble: its temp memory stays flat, GPipe's grows with M.

Every configuration computes every tick on every stage (bubble ticks too: their results are
masked), so on a CPU whose 8 fake devices share the same cores the step time is proportional to
the total work, ticks x stages: measured bubble = 1 - t(pipeline=1) / t(pipeline=P), which the
schedule predicts as (P-1)/(R*M+P-1). On real accelerators the bubble is idle time instead, with
the same fraction.
"""

import argparse
import dataclasses
import json
import time

import common  # noqa: F401
import jax
import jax.numpy as jnp
from flax import nnx

from mesh.build import make_mesh
from mesh.rules import axis_rules, logical_to_spec, make_rules
from models import pipeline as pipeline_lib
from models.pipeline import EXPLICIT, explicit, schedule_bubble, timetable
from models.presets import PRESETS
from models.transformer import Block
from plan.hlo import parse_collectives, summarize


def block_stack(n_layers, d_model, d_ff):
    cfg = dataclasses.replace(
        PRESETS["tiny"],
        n_layers=n_layers,
        d_model=d_model,
        d_ff=d_ff,
        n_heads=4,
        n_kv_heads=4,
        dtype="float32",
    )

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(cfg, jnp.float32, jnp.float32, rngs=rngs)

    with nnx.use_eager_sharding(False):
        gdef, state = nnx.split(make(nnx.Rngs(0)))
    axes = nnx.to_pure_dict(
        jax.tree.map(
            lambda v: tuple(v.get_metadata()["out_sharding"]),
            state,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    )

    def layer(x_bTD, p, pos_bT):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        return nnx.merge(gdef, st)(x_bTD, pos_bT)[0]

    return layer, nnx.to_pure_dict(state), axes


def mean_square(stack):
    return lambda p, x, pos: jnp.mean(stack(p, x, pos) ** 2)


def _loss(args, P, M, R, schedule, layer, params):
    """The mean-square loss of the stack under one pipeline setting, and the parameters as it
    reads them (circular: in stage order unless --model-order)."""
    remat = jax.checkpoint_policies.nothing_saveable
    if P == 1:

        def stack(p, x, pos):
            body = jax.checkpoint(lambda x, lp: layer(x, lp, pos), policy=remat)
            return jax.lax.scan(lambda x, lp: (body(x, lp), None), x, p)[0]

        return mean_square(stack), params
    if schedule in EXPLICIT:
        # the loss is part of the schedule: the stack's input and the loss ride in the batch

        def loss(p, x, pos):
            return explicit.loss(
                lambda _, mb: mb["x"],
                lambda x, lp, mb: layer(x, lp, mb["pos"]),
                lambda _, y, mb: jnp.sum(jnp.square(y)) / x.size,
                {},
                p,
                {"x": x, "pos": pos},
                stages=P,
                microbatches=M,
                repeats=R,
                remat_policy=remat,
                schedule=schedule,
            )[0]

        return loss, params
    # circular: the layer stack stored in stage order, so each device's chunks are local
    ordered = R > 1 and not args.model_order
    params = pipeline_lib.to_stage_order(params, P, R) if ordered else params

    def stack(p, x, pos):
        return pipeline_lib.pipeline_apply(
            layer,
            p,
            x,
            pos,
            stages=P,
            microbatches=M,
            repeats=R,
            schedule=schedule,
            remat_policy=remat,
            stage_ordered=ordered,
        )

    return mean_square(stack), params


def _compiled_step(loss, params, axes, rules, mesh, x, pos):
    """The compiled value-and-grad step on the sharded inputs: (step, its arguments, compile
    seconds, memory analysis, the pipeline axis's collective-permute from the HLO)."""
    with jax.set_mesh(mesh), axis_rules(rules):
        shard = jax.tree.map(
            lambda n: jax.NamedSharding(mesh, logical_to_spec(n)),
            axes,
            is_leaf=lambda t: isinstance(t, tuple),
        )
        p = jax.device_put(params, shard)
        xs = jax.device_put((x, pos), jax.NamedSharding(mesh, logical_to_spec(("batch",))))
        t0 = time.perf_counter()
        step = (
            jax.jit(jax.value_and_grad(loss), out_shardings=(None, shard)).lower(p, *xs).compile()
        )
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(step(p, *xs))
        mem = step.memory_analysis()
        cp = summarize(parse_collectives(step.as_text(), mesh))["collective-permute"][
            "by_axes"
        ].get("pipeline", {})
    return step, (p, *xs), compile_s, mem, cp


def run(args, P, M, R, schedule, layer, params, axes, rules):
    mesh = make_mesh(f"pipeline={P},data={8 // P}")
    loss, params = _loss(args, P, M, R, schedule, layer, params)
    batch = args.batch * M // P if args.fixed_micro_batch else args.batch
    x = jax.random.normal(jax.random.key(1), (batch, args.seq, args.d_model))
    pos = jnp.broadcast_to(jnp.arange(args.seq), (batch, args.seq))
    step, step_args, compile_s, mem, cp = _compiled_step(loss, params, axes, rules, mesh, x, pos)
    theory = pipeline_lib.permute_bytes_theory(
        batch=batch,
        seq=args.seq,
        d_model=args.d_model,
        itemsize=4,
        stages=P,
        microbatches=M,
        repeats=R,
        batch_shards=8 // P,
    )

    def timed():
        return jax.block_until_ready(step(*step_args))

    return timed, {
        "P": P,
        "M": M,
        "R": R,
        "schedule": schedule if P > 1 else "-",
        "compile_s": compile_s,
        "params_MiB": mem.argument_size_in_bytes / 2**20,
        "temp_MiB": mem.temp_size_in_bytes / 2**20,
        "permute_hlo_KiB": cp.get("operand_bytes", 0) / 1024,
        "permute_theory_KiB": theory["sent"] / 1024,
        "bubble_pred": schedule_bubble(schedule, P, M, R) if P > 1 else 0.0,
    }


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--model-order",
        action="store_true",
        help="circular: keep the stack in model order (the weights are regrouped every step)",
    )
    ap.add_argument(
        "--schedules",
        default="gpipe,circular,1f1b,zb_h1,interleaved_1f1b",
        help="comma-separated schedules to run",
    )
    ap.add_argument(
        "--fixed-micro-batch",
        action="store_true",
        help="batch = M x batch/P: micro-batches of fixed size",
    )
    return ap.parse_args()


def round_robin(runs, steps: int) -> list[dict]:
    """Each run's row with its fastest step. Round-robin timing: on a shared CPU the load
    drifts, so every config sees the same drift."""
    times = [[] for _ in runs]
    for _ in range(steps):
        for (timed, _), ts in zip(runs, times):
            t0 = time.perf_counter()
            timed()
            ts.append(time.perf_counter() - t0)
    return [dict(r, step_s=min(ts)) for (_, r), ts in zip(runs, times)]


def print_table(args, rows: list[dict]) -> None:
    base = rows[0]["step_s"]
    print(
        f"\n{args.layers} Blocks, d_model {args.d_model}, batch {args.batch} x seq {args.seq},"
        f" float32, mesh pipeline=P,data=8/P, full remat; min of {args.steps} round-robin steps"
    )
    print(
        "| pipeline | schedule | R | M | ticks | step s | ms/tick | idle measured"
        " | bubble predicted | args MiB/dev | temp MiB/dev | permute KiB/dev HLO (theory)"
        " | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        # one stage (the "-" row) runs its micro-batches one after another: gpipe's count at P=1
        ticks = timetable(r["schedule"] if r["P"] > 1 else "gpipe").ticks(r["P"], r["M"], r["R"])
        measured = 1 - base / r["step_s"]
        print(
            f"| {r['P']} | {r['schedule']} | {r['R']} | {r['M']} | {ticks} | {r['step_s']:.3f} | "
            f"{1000 * r['step_s'] / ticks:.0f} | {measured:.1%} | {r['bubble_pred']:.1%} | "
            f"{r['params_MiB']:.2f} | {r['temp_MiB']:.1f} | "
            f"{r['permute_hlo_KiB']:.0f} ({r['permute_theory_KiB']:.0f}) | {r['compile_s']:.1f} |"
        )


def main():
    args = parse_args()
    layer, params, axes = block_stack(args.layers, args.d_model, 4 * args.d_model)
    rules = make_rules("layers=pipeline")
    configs = [(1, 1, 1, "gpipe")] + [
        (P, M, R, schedule)
        for P in (2, 4)
        for schedule, R in (
            ("gpipe", 1),
            ("circular", 2),
            ("1f1b", 1),
            ("zb_h1", 1),
            ("interleaved_1f1b", 2),
        )
        for M in (P, 2 * P, 4 * P)
        if schedule in args.schedules.split(",")
    ]
    runs = [run(args, *c, layer, params, axes, rules) for c in configs]
    rows = round_robin(runs, args.steps)
    for r in rows:
        print(json.dumps(r), flush=True)
    print_table(args, rows)


if __name__ == "__main__":
    main()
