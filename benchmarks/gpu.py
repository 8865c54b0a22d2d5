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
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mesh.xla import known_xla_flags, unknown_xla_flags  # noqa: E402

OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|\bOOM\b")
FIELDS = (
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "mfu",
    "step_time_s",
    "data_wait_s",
    "moe/dropped_fraction",
)
# Mixtral 8x7B's layout (GQA 2:1, 8 experts, top-2, expert width 3.5 x d_model) at 1/4 the width and
# 1/4 the depth: 0.8B parameters (Adam state ~13 GB), so batch 8-16 at seq 2048 fits one H200.
MOE_SHAPES = {
    "mixtral-small": (
        "mixtral-8x7b",
        [
            "--model.n_layers",
            "8",
            "--model.d_model",
            "1024",
            "--model.n_heads",
            "16",
            "--model.n_kv_heads",
            "8",
            "--model.d_ff",
            "3584",
            "--model.d_ff_expert",
            "3584",
        ],
    )
}
MOE_VARIANTS = {
    "dropless": ["--model.dispatch", "dropless"],  # kernel auto: ragged_dot on GPU
    "dropless-blocks": ["--model.dispatch", "dropless", "--model.dropless_kernel", "blocks"],
    "capacity": ["--model.dispatch", "capacity", "--model.capacity_factor", "1.25"],
}
# Settings compared on the first dense preset at --variant-batch, each against the plain run of
# that preset and batch: the XLA GPU preset (mesh/xla.py), the attention implementation, FP8.
# Long context on one GPU: the blockwise attention (pure JAX, memory linear in the sequence)
# against cuDNN's flash attention, the same preset and tokens per step
LONG_KINDS = {
    "blockwise": ["--model.attention", "blockwise"],
    "cudnn": ["--model.attention", "cudnn"],
}
# The dropless MoE's token exchange over an expert axis of several GPUs
EP_EXCHANGES = {
    "fixed": ["--model.dispatch", "dropless", "--model.ep_exchange", "fixed"],
    "ragged": ["--model.dispatch", "dropless", "--model.ep_exchange", "ragged"],
}
VARIANTS = {
    "xla-preset": ["--xla-preset", "gpu"],
    "attention-dense": ["--model.attention", "dense"],
    "attention-blockwise": ["--model.attention", "blockwise"],
    "attention-cudnn": ["--model.attention", "cudnn"],
    "fp8": ["--model.matmul_precision", "fp8"],
}


def say(*a) -> None:
    print(*a, flush=True)  # flushed so a hard kill still leaves the progress in the log


def parse_args():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
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
    args = p.parse_args(argv)
    args.extra = extra
    split_lists(p, args)
    return args


def add_long_and_ep_args(p: argparse.ArgumentParser) -> None:
    """The long-context and the expert-parallel MoE cases' flags."""
    p.add_argument(
        "--long-context",
        default="8192,32768",
        help="comma-separated sequence lengths of the long-context case ('' = none)",
    )
    p.add_argument("--long-preset", default="1b", help="the long-context case's preset")
    p.add_argument(
        "--long-kinds",
        default=",".join(LONG_KINDS),
        help=f"attentions compared at each length, from {', '.join(LONG_KINDS)}",
    )
    p.add_argument(
        "--ep-exchanges",
        default=",".join(EP_EXCHANGES),
        help=f"MoE token exchanges over the expert axis on more than one GPU, from"
        f" {', '.join(EP_EXCHANGES)}; '' = no such case",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="GPUs for the expert-parallel MoE case; 0 = nvidia-smi's count (a dry run without"
        " GPUs shows the commands for 8)",
    )


def split_lists(p: argparse.ArgumentParser, args) -> None:
    """The comma-separated flags as lists, each name checked against its table."""
    args.presets = [s for s in args.presets.split(",") if s]
    args.batch_sizes = sorted(int(s) for s in args.batch_sizes.split(",") if s)
    args.moe_variants = [s for s in args.moe_variants.split(",") if s]
    args.moe_batch_sizes = sorted(int(s) for s in args.moe_batch_sizes.split(",") if s)
    args.variants = [s for s in args.variants.split(",") if s]
    args.long_context = [int(s) for s in args.long_context.split(",") if s]
    args.long_kinds = [s for s in args.long_kinds.split(",") if s]
    args.ep_exchanges = [s for s in args.ep_exchanges.split(",") if s]
    for flag, given, valid in (
        ("--moe-variants", args.moe_variants, MOE_VARIANTS),
        ("--variants", args.variants, VARIANTS),
        ("--long-kinds", args.long_kinds, LONG_KINDS),
        ("--ep-exchanges", args.ep_exchanges, EP_EXCHANGES),
    ):
        bad = [v for v in given if v not in valid]
        if bad:
            p.error(f"{flag}: unknown {', '.join(bad)}; valid: {', '.join(valid)}")


def gpu_count() -> int:
    """Visible NVIDIA GPUs (nvidia-smi -L), 0 without a driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def cases(args, gpus: int) -> list[dict]:
    """What to run, in order: each dense preset, the long-context case (each length, each
    attention), the MoE shape once per dispatch variant, with `gpus` > 1 the MoE shape over an
    expert axis of all of them once per exchange, then the first dense preset's variants. name: the
    label in the results; preset + flags: the train command's model; seq_len and devices where
    they differ from --seq-len and one GPU."""
    out = [
        {"name": p, "preset": p, "flags": [], "batch_sizes": args.batch_sizes} for p in args.presets
    ]
    out += [
        {
            "name": f"{args.long_preset}/{kind}/{seq}",
            "preset": args.long_preset,
            "flags": [*LONG_KINDS[kind], "--model.max_seq_len", str(seq)],
            "batch_sizes": [1],
            "seq_len": seq,
        }
        for seq in args.long_context
        for kind in args.long_kinds
    ]
    preset, flags = MOE_SHAPES.get(args.moe_preset, (args.moe_preset, []))
    out += [
        {
            "name": f"{args.moe_preset}/{v}",
            "preset": preset,
            "flags": flags + MOE_VARIANTS[v],
            "batch_sizes": args.moe_batch_sizes,
        }
        for v in args.moe_variants
    ]
    if gpus > 1:
        out += [
            {
                "name": f"{args.moe_preset}/expert{gpus}/{x}",
                "preset": preset,
                "flags": flags + EP_EXCHANGES[x] + ["--mesh", f"expert={gpus}"],
                "batch_sizes": [b * gpus for b in args.moe_batch_sizes],
                "devices": gpus,
            }
            for x in args.ep_exchanges
        ]
    if args.presets:
        out += [
            {
                "name": f"{args.presets[0]}/{v}",
                "preset": args.presets[0],
                "flags": VARIANTS[v],
                "batch_sizes": [args.variant_batch],
            }
            for v in args.variants
        ]
    return out


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
    """The cost model's step time and MFU for this config on one device of --hardware (analytic,
    no compile; run on the host CPU so it takes no GPU memory from the runs)."""
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


def drop_unknown_xla_flags() -> None:
    """An unknown flag in XLA_FLAGS aborts every jax process, and flags come and go between
    jaxlib releases: drop the ones the installed jaxlib rejects (probed on CPU, mesh/xla.py)."""
    flags = os.environ["XLA_FLAGS"].split()
    for name in unknown_xla_flags(flags, os.environ):
        say(f"dropping XLA flag unknown to this jaxlib: {name}")
    os.environ["XLA_FLAGS"] = " ".join(known_xla_flags(flags, os.environ))


def environment() -> dict:
    info = {
        "xla_flags": os.environ["XLA_FLAGS"],
        "mem_fraction": os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
        "python": sys.version.split()[0],
    }
    info["packages"] = {
        d.metadata["Name"]: d.version
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith(("jax", "flax", "optax"))
    }
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["gpu"] = f"unknown ({e})"
    return info


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if "tokens_per_sec" in row:  # skip eval or other records
            rows.append(row)
    return rows


def summarise(rows: list[dict]) -> dict:
    steady = rows[1:] or rows  # the first logged interval includes compilation
    out = {"logged_steps": [r.get("step") for r in rows], "includes_compile": len(rows) < 2}
    for k in FIELDS:
        vals = [r[k] for r in steady if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(vals) if vals else None
    return out


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


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
    log_path, metrics_path = run_dir / "train.log", run_dir / "metrics.jsonl"
    t0, seen, proc = time.time(), 0, None
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            while proc.poll() is None:
                time.sleep(2)
                rows = read_metrics(metrics_path)
                for r in rows[seen:]:  # stream progress as it is logged
                    say(
                        f"  step {r.get('step')}: loss {r.get('loss'):.4f}"
                        f" tok/s {r.get('tokens_per_sec'):,.0f}"
                        f" mfu {r.get('mfu'):.1%} step {r.get('step_time_s'):.3f}s"
                    )
                seen = len(rows)
                if time.time() - t0 > timeout:
                    res["status"] = "timeout"
                    break
    except KeyboardInterrupt:
        res["status"] = "interrupted"
        raise
    finally:
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        res["rc"], res["wall_s"] = proc and proc.returncode, round(time.time() - t0, 1)
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        rows = read_metrics(metrics_path)
        if res["status"] == "running":
            res["status"] = (
                "ok"
                if proc is not None and proc.returncode == 0 and rows
                else "oom"
                if OOM.search(text)
                else "no-metrics"
                if proc is not None and proc.returncode == 0
                else "error"
            )
        res.update(summarise(rows))
        res["metrics"] = rows
        summary = run_dir / "summary.json"  # the CLI's end-of-run figures (compile time, goodput)
        if summary.exists():
            res["summary"] = {
                k: v for k, v in json.loads(summary.read_text()).items() if k != "sample"
            }
        if res["status"] != "ok":
            res["log_tail"] = text[-3000:]
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"{tag}-b{batch}.log").write_text(text)
        # A 1b checkpoint with optimizer state is ~16 GB; never let runs accumulate on disk.
        shutil.rmtree(run_dir, ignore_errors=True)
    say(
        f"--> {res['status']} rc={res['rc']} wall={res['wall_s']}s tok/s={res['tokens_per_sec']}"
        f" tok/s/dev={res['tokens_per_sec_per_device']} mfu={res['mfu']} step={res['step_time_s']}s"
    )


def table(runs: list[dict]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        "| preset | batch | seq | tokens/s | tokens/s/device | MFU | step (s) | predicted step (s)"
        " | predicted MFU"
        " | dropped | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['preset']} | {r['batch_size']} | {r['seq_len']}"
            f" | {f(r.get('tokens_per_sec'), ',.0f')}"
            f" | {f(r.get('tokens_per_sec_per_device'), ',.0f')} | {f(r.get('mfu'), '.1%')}"
            f" | {f(r.get('step_time_s'), '.3f')} | {f(r.get('predicted_step_time_s'), '.3f')}"
            f" | {f(r.get('predicted_mfu'), '.1%')} | {f(r.get('moe/dropped_fraction'), '.2%')}"
            f" | {r['status']} |"
        )
    return "\n".join(lines)


def dry_run(args, gpus: int) -> None:
    """Print the commands the sweep would run (the expert-parallel case as on 8 GPUs if fewer)."""
    say(f"XLA_FLAGS={shlex.quote(os.environ['XLA_FLAGS'])}")
    if gpus < 2 and args.ep_exchanges:
        say("# the expert-parallel MoE case as it would run on 8 GPUs:")
    for case in cases(args, gpus if gpus > 1 else 8):
        for b in case["batch_sizes"]:
            run_dir = f"<tmp>/{case['name'].replace('/', '-')}-b{b}"
            say(shlex.join(train_cmd(args, case, b, run_dir)))


def main() -> int:
    args = parse_args()
    gpus = args.gpus or gpu_count()
    if args.dry_run:
        dry_run(args, gpus)
        return 0

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
        if gpus < 2 and args.ep_exchanges:
            say("one GPU: the expert-parallel MoE case (--ep-exchanges) needs more; skipped")
        for case in cases(args, gpus):
            name = case["name"]
            seq = case.get("seq_len", args.seq_len)
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
    except KeyboardInterrupt:
        say("interrupted; saving partial results")
        results["interrupted"] = True
    finally:
        save()
        say(f"\nresults: {results_path}\n\n{table([r for r in results['runs'] if 'cmd' in r])}")
    return 0 if any(r.get("status") == "ok" for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
