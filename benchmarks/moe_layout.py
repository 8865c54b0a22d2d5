"""The MoE experts' two layouts over FSDP side by side (mesh/expert_layout.py): the real train step
with the experts sliced over fsdp (weights gathered per layer) and whole over expert x fsdp (tokens
exchanged over both), interleaved, on several layer shapes and meshes, and which one
`--parallelism.experts_over_fsdp auto` picks by its bytes count:

    python benchmarks/moe_layout.py [--reps 3] [--steps 6] [--dtype bfloat16 float32]

Each row: the bytes per device and layer each layout moves (mesh.expert_layout.moved_bytes), the
median step time of each (median of `steps` timed steps after a compiled one, per rep; median over
reps) and the layout auto takes. 8 fake CPU devices.
"""

import argparse
import statistics
import time

import common  # 8 fake devices, repo on sys.path
import jax

from mesh.build import make_mesh
from mesh.rules import axis_rules
from train.core.config import build
from train.core.setup import jit_step

# name: (d_model, expert width, experts, top-k, seq_len, mesh); batch 8, 2 layers, 4 heads
SHAPES = {
    "peer moe": (256, 512, 8, 2, 128, "fsdp=4,expert=2"),
    "peer moe, fsdp only": (256, 512, 8, 2, 128, "fsdp=8"),
    "seq 512": (256, 512, 8, 2, 512, "fsdp=4,expert=2"),
    "fine-grained (32 x 128, top-4)": (256, 128, 32, 4, 128, "fsdp=4,expert=2"),
    "d 512, width 1024": (512, 1024, 8, 2, 256, "fsdp=4,expert=2"),
    "with tensor parallel": (256, 512, 8, 2, 128, "fsdp=2,expert=2,model=2"),
}


def _config(shape, dtype: str, layout: str):
    d, f, e, k, seq, mesh = shape
    return build(
        {
            **common.PEER,
            "model.d_model": d,
            "model.n_experts": e,
            "model.experts_per_token": k,
            "model.d_ff_expert": f,
            "model.d_ff": f,
            "model.max_seq_len": seq,
            "train.seq_len": seq,
            "model.dtype": dtype,
            "parallelism.mesh": mesh,
            "parallelism.experts_over_fsdp": layout,
        }
    )


def step_time(cfg, steps: int) -> float:
    """Median seconds of `steps` train steps after a compiled one (state threaded through)."""
    s, state, batch = common.state_and_batch(cfg)
    with jax.set_mesh(s.mesh), axis_rules(s.rules):
        step = jit_step(s)
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def moved(cfg) -> dict:
    """Bytes per device and layer of each layout, and the one auto takes."""
    from mesh.expert_layout import experts_over_fsdp, moved_bytes
    from mesh.rules import make_rules
    from train.core.setup import run_rules
    from train.core.shapes import moe_traffic

    sizes = dict(make_mesh(cfg.parallelism.mesh).shape)
    dtype = cfg.model.compute_dtype("cpu")
    sliced = make_rules()
    whole = experts_over_fsdp(sliced, sizes)
    kw = moe_traffic(sliced, sizes, cfg.model, cfg.train, jax.numpy.dtype(dtype).itemsize, "cpu")
    return {
        "sliced MB": moved_bytes(sliced, sizes, **kw) / 1e6,
        "whole MB": moved_bytes(whole, sizes, **kw) / 1e6,
        "auto": "whole"
        if run_rules(cfg, sizes, dtype)["experts"] == whole["experts"]
        else "sliced",
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    a = ap.parse_args()
    print(
        "| shape | mesh | dtype | MB/layer sliced | whole | sliced s/step | whole s/step |"
        " whole speedup | auto |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.shapes:
        for dtype in a.dtype:
            got = {"off": [], "on": []}
            for _ in range(a.reps):  # interleaved
                for layout in got:
                    got[layout].append(step_time(_config(SHAPES[name], dtype, layout), a.steps))
            off, on = (statistics.median(got[k]) for k in ("off", "on"))
            b = moved(_config(SHAPES[name], dtype, "auto"))
            print(
                f"| {name} | {SHAPES[name][5]} | {dtype} | {b['sliced MB']:.2f} |"
                f" {b['whole MB']:.2f} | {off:.3f} | {on:.3f} | {off / on:.2f} | {b['auto']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
