"""Single-GPU throughput and MFU sweep: one H200, under 10 minutes, safe to run unattended.

    python benchmarks/gpu.py                      # 1b, bf16, batch 4, 8, 16 at seq 2048
    python benchmarks/gpu.py --presets 125m,1b --batch-sizes 8,16
    python benchmarks/gpu.py --dry-run            # print the train commands, run nothing
    python benchmarks/gpu.py -- --checkpoint.every 0  # args after `--` go to every train run
    # MoE only:
    python benchmarks/gpu.py --presets '' --moe-variants dropless,dropless-blocks,capacity
    python benchmarks/gpu.py --batch-sizes 8 --variants fp8,attention-cudnn --moe-variants ''

After the dense sweep, the first preset runs once per --variants entry at --variant-batch: the XLA
GPU preset, XLA vs cuDNN attention, FP8 matmuls; each row has the cost model's predicted step time
and MFU (`python -m train plan --hardware h200 --devices 1`, analytic) next to the measured ones.

The long-context case (after the dense presets) trains --long-preset at batch 1 for each length in
--long-context (8k-32k tokens) once per attention in --long-kinds: the blockwise attention
(models/blockwise.py, memory linear in the sequence) against cuDNN's fused flash attention.

The MoE case (after the long-context case) trains a Mixtral-shaped model small enough for one GPU
(`--moe-preset mixtral-small`: 8 layers, d_model 1024, 8 experts of width 3584, top-2; 0.8B
parameters, 0.27B active) once per dispatch variant; its MFU counts active parameters. On one GPU
there is no expert axis, so the variants compare the dropless grouped matmul (ragged_dot, or the
padded blocks) with capacity dispatch, not the exchanges. Any registered preset works as
`--moe-preset` (moe-tiny: a quick end-to-end run on CPU).

With more than one GPU (nvidia-smi's count, or --gpus N), the MoE shape also runs with its experts
split over all of them (`--mesh expert=N`, global batch --moe-batch-sizes x N) once per token
exchange in --ep-exchanges: `fixed` (all_to_all of worst-case buffers) against `ragged`
(ragged_all_to_all of the real rows). On one GPU this case is skipped.

The cases run in this order, the dense sweep first and the variants last; the budget (--budget-s,
default under 10 minutes) skips whatever no longer fits, and says so in the results.

Each config is its own `python -m train` subprocess (fresh GPU memory, hard timeout, killed as a
process group), so one hung or OOM config cannot eat the budget. A preset's batch sizes run
small to large and stop growing at the first OOM or timeout. Figures are the median of the
logged steps after the first (the first includes compilation) from <run-dir>/metrics.jsonl.

Results: $OUT/gpu_results.json if OUT is set, else benchmarks/gpu_results.json, rewritten after
every run so a hard kill keeps what finished. For BENCHMARKS.md paste the Markdown table printed
at the end, with this command line, the date, and the device/versions from the JSON.
"""

from __future__ import annotations

import os

# XLA reads XLA_FLAGS once, when a backend starts, so they must be in the environment before
# jax is imported. This process never imports jax (its backend would preallocate GPU memory
# the train subprocesses need); the subprocesses inherit the environment.
GPU_XLA_FLAGS = [
    # Schedules collectives asynchronously so they overlap compute; the standard JAX-on-GPU
    # recommendation (JAX "GPU performance tips", NVIDIA JAX-Toolbox default). One GPU has few
    # collectives; it is set so single-GPU figures use the same compiler setup as multi-GPU runs.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
]
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + GPU_XLA_FLAGS).strip()
# JAX preallocates 75% of GPU memory by default; 90% lets larger batches fit and still leaves
# room for cuBLAS/cuDNN workspaces.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_cases import (  # noqa: E402
    MOE_SHAPES,
    MOE_VARIANTS,
    VARIANTS,
    add_long_and_ep_args,
    cases,
    gpu_count,
    split_lists,
)
from gpu_env import drop_unknown_xla_flags, environment  # noqa: E402
from gpu_run import run_cmd, say, table  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--presets", default="1b", help="comma-separated dense model presets ('' = none)"
    )
    p.add_argument("--batch-sizes", default="4,8,16", help="comma-separated global batch sizes")
    p.add_argument(
        "--moe-variants",
        default="dropless,capacity",
        help=f"MoE dispatch variants to run, from {', '.join(MOE_VARIANTS)}; '' = no MoE case",
    )
    p.add_argument(
        "--moe-preset",
        default="mixtral-small",
        help=f"MoE shape: {', '.join(MOE_SHAPES)} or any registered MoE preset (e.g. moe-tiny)",
    )
    p.add_argument(
        "--moe-batch-sizes", default="8", help="comma-separated global batch sizes for the MoE case"
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"settings compared on the first dense preset, from {', '.join(VARIANTS)}; '' = none",
    )
    p.add_argument(
        "--variant-batch", type=int, default=8, help="global batch size of the variant runs"
    )
    add_long_and_ep_args(p)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="dense bf16 peak per device for MFU; 0 = the CLI's own table (H100/H200 SXM: 989)",
    )
    p.add_argument(
        "--budget-s", type=float, default=540, help="wall-clock budget for the whole sweep"
    )
    p.add_argument("--run-timeout-s", type=float, default=300, help="limit for one config")
    p.add_argument(
        "--min-run-s",
        type=float,
        default=75,
        help="do not start a config with less budget left (start-up + compile alone take ~1 min)",
    )
    p.add_argument(
        "--hardware",
        default="h200",
        help="cost-model profile whose prediction is put next to each run"
        " (python -m train plan --hardware); '' = none",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return p


def parse_args():
    """The sweep's settings, the comma-separated lists split and checked; what follows `--` goes
    to every train run (args.extra)."""
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = make_parser()
    args = p.parse_args(argv)
    args.extra = extra
    split_lists(p, args)
    return args


def train_cmd(args, case: dict, batch: int, run_dir: str) -> list[str]:
    # Synthetic data: the benchmark measures the step, not a dataset or disk. No eval and no
    # sample at the end (each costs an extra compile), no progress bar or TensorBoard files.
    cmd = [
        sys.executable,
        "-m",
        "train",
        "--model",
        case["preset"],
        *case["flags"],
        "--model.dtype",
        "bfloat16",
        "--steps",
        str(args.steps),
        "--batch-size",
        str(batch),
        "--seq-len",
        str(case.get("seq_len", args.seq_len)),
        "--log-every",
        str(args.log_every),
        "--data",
        "synthetic",
        "--eval-every",
        "0",
        "--train.sample_tokens",
        "0",
        "--logging.progress",
        "false",
        "--logging.tensorboard",
        "false",
        "--run-dir",
        run_dir,
    ]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    return cmd + args.extra


def predict(args, case: dict, batch: int) -> dict:
    """The cost model's step time and MFU for this config on its devices of --hardware (one, or
    all GPUs for the expert-parallel case; analytic, no compile; run on the host CPU so it takes
    no GPU memory from the runs)."""
    if not args.hardware:
        return {}
    model = train_cmd(args, case, batch, "unused")[3:]
    model = [
        a
        for i, a in enumerate(model)
        if a != "--xla-preset" and (i == 0 or model[i - 1] != "--xla-preset")
    ]
    cmd = [
        sys.executable,
        "-m",
        "train",
        "plan",
        "--hardware",
        args.hardware,
        "--devices",
        str(case.get("devices", 1)),
        "--json",
        *model,
    ]
    try:
        out = subprocess.run(
            cmd,
            cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return {"predicted_error": "plan timed out"}
    try:
        row = json.loads(out.stdout)
        return {
            "predicted_step_time_s": round(row["t_step_s"], 4),
            "predicted_mfu": round(row["mfu"], 4),
        }
    except (json.JSONDecodeError, KeyError):
        return {"predicted_error": out.stderr.strip()[-300:]}


def run_one(args, case: dict, res: dict, timeout: float, logs: Path | None) -> None:
    """Run one config and fill `res` (already in the results list, so an interrupt keeps it)."""
    preset, batch = res["preset"], res["batch_size"]
    tag = preset.replace("/", "-")
    run_dir = Path(tempfile.mkdtemp(prefix=f"brigade-gpu-{tag}-b{batch}-"))
    cmd = train_cmd(args, case, batch, str(run_dir))
    res.update(
        steps=args.steps, cmd=shlex.join(cmd), status="running", **predict(args, case, batch)
    )
    say(f"\n=== {preset} batch={batch} seq={res['seq_len']} (timeout {timeout:.0f}s)\n{res['cmd']}")
    run_cmd(cmd, REPO, run_dir, res, timeout, logs, tag)


def dry_run(args, gpus: int) -> int:
    """Print the XLA flags and every train command the sweep would run (the expert-parallel case
    as on 8 GPUs if fewer)."""
    say(f"XLA_FLAGS={shlex.quote(os.environ['XLA_FLAGS'])}")
    if gpus < 2 and args.ep_exchanges:
        say("# the expert-parallel MoE case as it would run on 8 GPUs:")
    for case in cases(args, gpus if gpus > 1 else 8):
        for b in case["batch_sizes"]:
            say(
                shlex.join(train_cmd(args, case, b, f"<tmp>/{case['name'].replace('/', '-')}-b{b}"))
            )
    return 0


def sweep(args, gpus: int, results: dict, deadline: float, out_dir: Path | None, save) -> None:
    """Run every case's batch sizes, small to large, into results['runs'] (saved after each run):
    a case stops growing at its first OOM or timeout, and no run starts with less than
    --min-run-s of the budget left."""
    if gpus < 2 and args.ep_exchanges:
        say("one GPU: the expert-parallel MoE case (--ep-exchanges) needs more; skipped")
    for case in cases(args, gpus):
        name, seq = case["name"], case.get("seq_len", args.seq_len)
        for b in case["batch_sizes"]:
            left = deadline - time.time()
            if left < args.min_run_s:
                say(f"\nbudget: {left:.0f}s left, skipping {name} batch={b}")
                results["runs"].append(
                    {
                        "preset": name,
                        "batch_size": b,
                        "seq_len": seq,
                        "status": "skipped-budget",
                    }
                )
                continue
            res = {"preset": name, "batch_size": b, "seq_len": seq}
            results["runs"].append(res)
            run_one(
                args,
                case,
                res,
                min(args.run_timeout_s, left - 15),
                out_dir / "gpu_logs" if out_dir else None,
            )
            save()
            if res["status"] in ("oom", "timeout"):
                say(f"stopping {name} at batch {b}: {res['status']}")
                break


def main() -> int:
    args = parse_args()
    gpus = args.gpus or gpu_count()
    if args.dry_run:
        return dry_run(args, gpus)

    start = time.time()
    deadline = start + args.budget_s
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    results_path = (out_dir or REPO / "benchmarks") / "gpu_results.json"
    results = {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": []}

    def save() -> None:
        results["elapsed_s"] = round(time.time() - start, 1)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=1))

    def on_term(signum, frame):  # an outer timeout: keep what finished
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)

    try:
        drop_unknown_xla_flags()
        results["environment"] = environment()
        say(json.dumps(results["environment"], indent=1))
        save()
        sweep(args, gpus, results, deadline, out_dir, save)
    except KeyboardInterrupt:
        say("interrupted; saving partial results")
        results["interrupted"] = True
    finally:
        save()
        say(f"\nresults: {results_path}\n\n{table([r for r in results['runs'] if 'cmd' in r])}")
    return 0 if any(r.get("status") == "ok" for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
