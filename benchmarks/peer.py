"""Brigade against MaxText side by side: the same decoder shape, mesh and machine, the two
frameworks' runs interleaved (MaxText, Brigade, MaxText, ...) so that both see the same load;
synthetic data, one fake CPU device per device of the mesh (8, or 1 for peer1). Median step time
of steps >= 3 per run, then the median over reps; the throughput ratio is MaxText's time /
Brigade's.

    python benchmarks/peer.py --maxtext-python PATH [--shapes peer,larger,...] [--reps 3]
        [--steps 16] [--dtype bfloat16|float32|default] [--maxtext-set key=value ...]
        [-- BRIGADE FLAGS]

PATH is the python of an environment with MaxText installed (`pip install maxtext==0.2.5` needs
Python >= 3.12); also read from $MAXTEXT_PYTHON. Brigade runs under this script's python: compare
at the same jax (the header prints both versions, the host CPU and its bf16 flags). --dtype sets
both frameworks' compute dtype; `default` leaves each its own default (MaxText: bfloat16; Brigade:
`auto`, see README). `moe` runs MaxText's dropless sparse_matmul path (ragged_dot), `moe_dense`
its dense-matmul path (sparse_matmul=False); Brigade runs its defaults in both.
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

# name -> (d_model, layers, heads, d_ff, vocab, seq, global batch, {axis: size}[, (experts,
# top-k)]); for an MoE shape d_ff is each expert's width
SHAPES = {
    "peer": (256, 2, 4, 1024, 32000, 128, 8, {"fsdp": 8}),
    "larger": (512, 4, 8, 2048, 32000, 256, 8, {"fsdp": 8}),
    "tp": (256, 2, 4, 1024, 32000, 128, 8, {"fsdp": 4, "model": 2}),
    "dp_fsdp": (256, 2, 4, 1024, 32000, 128, 8, {"data": 2, "fsdp": 4}),
    # the peer shape on one device (one fake CPU device, all host threads): the 1 -> 8 devices
    # scaling
    "peer1": (256, 2, 4, 1024, 32000, 128, 8, {"data": 1}),
    # 8 experts of width 512, top-2 (the active FFN width of the dense shapes), dropless, experts
    # split over expert=2 and fsdp=4
    "moe": (256, 2, 4, 512, 32000, 128, 8, {"fsdp": 4, "expert": 2}, (8, 2)),
    # the same MoE with one expert per device
    "moe_ep8": (256, 2, 4, 512, 32000, 128, 8, {"expert": 8}, (8, 2)),
    # the same as moe; MaxText on its dense-matmul MoE path (sparse_matmul=False)
    "moe_dense": (256, 2, 4, 512, 32000, 128, 8, {"fsdp": 4, "expert": 2}, (8, 2)),
    # where the layers carry the time: the larger shape deeper, longer, on other meshes, and with
    # a GPT-2-sized vocabulary
    "deep": (512, 8, 8, 2048, 32000, 256, 8, {"fsdp": 8}),
    "long": (512, 4, 8, 2048, 32000, 1024, 8, {"fsdp": 8}),
    "larger_tp": (512, 4, 8, 2048, 32000, 256, 8, {"fsdp": 4, "model": 2}),
    "larger_dp_fsdp": (512, 4, 8, 2048, 32000, 256, 8, {"data": 2, "fsdp": 4}),
    "v50k": (512, 4, 8, 2048, 50304, 256, 8, {"fsdp": 8}),
}
MAXTEXT_AXES = {
    "data": "ici_data_parallelism",
    "fsdp": "ici_fsdp_parallelism",
    "model": "ici_tensor_parallelism",
    "expert": "ici_expert_parallelism",
}


def env(mesh) -> dict:
    """One fake CPU device per device of the mesh."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={math.prod(mesh.values())}",
    }


def maxtext(py: str, name: str, steps: int, out: str, extra: list[str]) -> float:
    d, layers, heads, ff, vocab, seq, batch, mesh, *moe = SHAPES[name]
    # MaxText's dropless MoE: sparse_matmul with capacity_factor -1; megablox is a TPU (Pallas)
    # kernel, so off here, which takes jax.lax.ragged_dot; moe_dense: its dense-matmul path
    experts = (
        [
            f"num_experts={moe[0][0]}",
            f"num_experts_per_tok={moe[0][1]}",
            f"base_moe_mlp_dim={ff}",
            f"sparse_matmul={name != 'moe_dense'}",
            "megablox=False",
            "capacity_factor=-1",
        ]
        if moe
        else []
    )
    args = [
        py,
        "-m",
        "maxtext.trainers.pre_train.train",
        "run_name=r",
        f"base_output_directory={out}",
        "dataset_type=synthetic",
        f"steps={steps}",
        "hardware=cpu",
        "skip_jax_distributed_system=True",
        f"base_emb_dim={d}",
        f"base_num_decoder_layers={layers}",
        f"base_num_query_heads={heads}",
        f"base_num_kv_heads={heads}",
        f"base_mlp_dim={ff}",
        f"head_dim={d // heads}",
        f"vocab_size={vocab}",
        f"per_device_batch_size={batch / math.prod(mesh.values()):g}",
        f"max_target_length={seq}",
        "enable_checkpointing=false",
        "attention=dot_product",
        *experts,
        *[f"{MAXTEXT_AXES[a]}={n}" for a, n in mesh.items()],
        *extra,
    ]
    log = subprocess.run(args, cwd=out, env=env(mesh), capture_output=True, text=True, timeout=1800)
    times = [
        float(t)
        for s, t in re.findall(r"completed step: (\d+), seconds: ([\d.]+)", log.stdout + log.stderr)
        if int(s) >= 3
    ]
    if not times:
        sys.exit(f"MaxText run failed: {(log.stdout + log.stderr).strip().splitlines()[-1:]}")
    return statistics.median(times)


def brigade_cmd(shape, steps: int, out: str, extra: list[str]) -> list[str]:
    """The `python -m train` command of one peer shape on Brigade."""
    d, layers, heads, ff, vocab, seq, batch, mesh, *moe = shape
    experts = (
        [
            "--model.n_experts",
            str(moe[0][0]),
            "--model.experts_per_token",
            str(moe[0][1]),
            "--model.d_ff_expert",
            str(ff),
        ]
        if moe
        else []
    )
    # fmt: off
    return [
        sys.executable, "-m", "train", "--model", "tiny",
        "--model.vocab_size", str(vocab), "--model.d_model", str(d),
        "--model.n_layers", str(layers), "--model.n_heads", str(heads),
        "--model.n_kv_heads", str(heads), "--model.d_ff", str(ff),
        "--model.max_seq_len", str(seq), "--seq-len", str(seq), "--batch-size", str(batch),
        "--mesh", ",".join(f"{a}={n}" for a, n in mesh.items()), "--steps", str(steps),
        "--data", "synthetic", "--log-every", "1", "--eval-every", "0",
        "--train.sample_tokens", "0", "--checkpoint.every", "0", "--logging.progress", "lines",
        "--run-dir", out, *experts, *extra,
    ]
    # fmt: on


def brigade(name: str, steps: int, out: str, extra: list[str]) -> float:
    mesh = SHAPES[name][7]
    args = brigade_cmd(SHAPES[name], steps, out, extra)
    run = subprocess.run(args, env=env(mesh), capture_output=True, text=True, timeout=1800)
    if run.returncode:
        sys.exit(f"Brigade run failed: {run.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return statistics.median(
        r["step_time_s"] for r in recs if r.get("step", 0) >= 3 and "step_time_s" in r
    )


def header(maxtext_python: str) -> str:
    """The host and both frameworks' jax: what a row against MaxText must state."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = re.search(r"model name\s*:\s*(.+)", info).group(1).strip()
        flags = set(re.search(r"flags\s*:\s*(.+)", info).group(1).split())
    except (OSError, AttributeError):
        flags = set()
    bf16 = sorted(flags & {"avx512_bf16", "amx_bf16"}) or ["no bf16 flags"]
    probe = "import jax, sys; print(jax.__version__, sys.version.split()[0])"
    theirs = subprocess.run(
        [maxtext_python, "-c", probe], capture_output=True, text=True, timeout=120
    ).stdout.split()
    ours = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    ).stdout.split()
    return (
        f"host: {cpu}, {os.cpu_count()} cores, {' '.join(bf16)}; MaxText: jax {theirs[0]} (Python"
        f" {theirs[1]}); Brigade: jax {ours[0]} (Python {ours[1]})"
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--maxtext-python", default=os.environ.get("MAXTEXT_PYTHON", ""))
    ap.add_argument("--shapes", default="peer,larger,tp,dp_fsdp")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32", "default"),
        help="both frameworks' compute dtype; default: each its own",
    )
    ap.add_argument(
        "--maxtext-set", nargs="*", default=[], help="key=value overrides passed to MaxText"
    )
    ap.add_argument("extra", nargs="*", help="flags passed to Brigade (after --)")
    a = ap.parse_args()
    if not a.maxtext_python or not os.path.exists(a.maxtext_python):
        sys.exit(
            "--maxtext-python PATH: the python of an environment with MaxText installed"
            " (or $MAXTEXT_PYTHON)"
        )
    unknown = [s for s in a.shapes.split(",") if s not in SHAPES]
    if unknown:
        sys.exit(f"--shapes: unknown {', '.join(unknown)}; valid: {', '.join(SHAPES)}")
    theirs = a.maxtext_set + ([] if a.dtype == "default" else [f"dtype={a.dtype}"])
    ours = a.extra + ([] if a.dtype == "default" else ["--model.dtype", a.dtype])
    print(header(a.maxtext_python))
    print(f"command: {' '.join(sys.argv)}; dtype {a.dtype}; load {os.getloadavg()[0]:.1f}")
    print("| shape | mesh | MaxText s/step | Brigade s/step | Brigade/MaxText throughput |")
    print("|---|---|---|---|---|")
    for name in a.shapes.split(","):
        mt, us = [], []
        for _ in range(a.reps):
            with tempfile.TemporaryDirectory() as tmp:
                mt.append(maxtext(a.maxtext_python, name, a.steps, tmp, theirs))
                us.append(brigade(name, a.steps, os.path.join(tmp, "ours"), ours))
        m, o = statistics.median(mt), statistics.median(us)
        mesh = ",".join(f"{k}={v}" for k, v in SHAPES[name][7].items())
        print(
            f"| {name} | {mesh} | {m:.3f} ({', '.join(f'{x:.3f}' for x in mt)}) |"
            f" {o:.3f} ({', '.join(f'{x:.3f}' for x in us)}) | {m / o:.2f} |"
            f" <!-- load {os.getloadavg()[0]:.1f} -->",
            flush=True,
        )


if __name__ == "__main__":
    main()
