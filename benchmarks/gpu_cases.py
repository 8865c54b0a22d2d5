"""What the GPU sweep (benchmarks/gpu.py) runs: the tables of shapes and settings it compares,
the flags that pick among them, and the ordered list of cases for a given number of GPUs.
"""

from __future__ import annotations

import argparse
import subprocess

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
# Long context on one GPU: the blockwise attention (pure JAX, memory linear in the sequence)
# against cuDNN's flash attention, the same preset and tokens per step.
LONG_KINDS = {
    "blockwise": ["--model.attention", "blockwise"],
    "cudnn": ["--model.attention", "cudnn"],
}
# The dropless MoE's token exchange over an expert axis of several GPUs.
EP_EXCHANGES = {
    "fixed": ["--model.dispatch", "dropless", "--model.ep_exchange", "fixed"],
    "ragged": ["--model.dispatch", "dropless", "--model.ep_exchange", "ragged"],
}
# Settings compared on the first dense preset at --variant-batch, each against the plain run of
# that preset and batch: the XLA GPU preset (mesh/xla.py), the attention implementation, FP8,
# LoRA on a bfloat16, int8 and NF4 base.
VARIANTS = {
    "xla-preset": ["--xla-preset", "gpu"],
    "attention-dense": ["--model.attention", "dense"],
    "attention-blockwise": ["--model.attention", "blockwise"],
    "attention-cudnn": ["--model.attention", "cudnn"],
    "fp8": ["--model.matmul_precision", "fp8"],
    # LoRA rank 16 on a random frozen base (the base's values do not change the step's work): a
    # bfloat16 base against QLoRA's int8 and NF4 (BENCHMARKS.md, QLoRA)
    **{
        f"lora-{dtype}": ["--lora.rank", "16", "--lora.alpha", "32", "--lora.base_dtype", dtype]
        + ["--lora.allow_random_base", "true"]
        for dtype in ("bfloat16", "int8", "nf4")
    },
}


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


def long_context_cases(args) -> list[dict]:
    """--long-preset at batch 1, each length in --long-context once per attention."""
    return [
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


def moe_cases(args, gpus: int) -> list[dict]:
    """The MoE shape once per dispatch variant on one GPU, then, with `gpus` > 1, with its experts
    over an expert axis of all of them (global batch x gpus) once per token exchange."""
    preset, flags = MOE_SHAPES.get(args.moe_preset, (args.moe_preset, []))
    out = [
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
    return out


def cases(args, gpus: int) -> list[dict]:
    """What to run, in order: each dense preset, the long-context case (each length, each
    attention), the MoE shape once per dispatch variant, with `gpus` > 1 the MoE shape over an
    expert axis of all of them once per exchange, then the first dense preset's variants. name: the
    label in the results; preset + flags: the train command's model; seq_len and devices where
    they differ from --seq-len and one GPU."""
    out = [
        {"name": p, "preset": p, "flags": [], "batch_sizes": args.batch_sizes} for p in args.presets
    ]
    out += long_context_cases(args) + moe_cases(args, gpus)
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
