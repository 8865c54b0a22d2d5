"""The smaller config sections, `profile`, `comm` and `lora`, with the policies that read them;
train/core/config.py (the section table) re-exports the section classes."""

from __future__ import annotations

import argparse
import dataclasses
import functools

from errors import UserError
from models.fields import check_ranges, option, ranged
from train.core.flags import parse_bool, public_flag


def _flag(section: str):
    """How a field of `section` is written on the command line."""
    return functools.partial(public_flag, section)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """The `profile` section: which steps jax.profiler traces."""

    steps: str = option(
        "", "A:B = trace steps A..B-1 with jax.profiler into <run_dir>/profile; empty = off"
    )

    def validate(self) -> ProfileConfig:
        # no numeric options; the window is checked against --steps in Config.validate
        check_ranges(self, _flag("profile"))
        return self


def profile_window(spec: str, steps: int) -> tuple[int, int] | None:
    """--profile.steps 'A:B' -> (A, B): trace steps A..B-1; '' -> None."""
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise UserError(
            f"--profile.steps '{spec}': expected START:STOP, e.g. 10:15 (steps 10 to 14)"
        ) from None
    if not 1 <= a < b <= steps + 1:
        raise UserError(
            f"--profile.steps '{spec}': need 1 <= START < STOP <= --steps + 1 = {steps + 1}"
        )
    return a, b


# mesh/collectives.py METHODS plus the plain all-reduce; kept here so that parsing flags needs no
# JAX
COMPRESSIONS = ("none", "int8", "int4", "topk")


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """The `comm` section: how data-parallel replicas sync (compression, error feedback, DiLoCo);
    `error_feedback_on` below applies its policy to values outside a section."""

    compression: str = option(
        "none", "data-parallel gradient sync: none (XLA's float32 all-reduce) | int8 | int4 | topk"
    )
    topk_fraction: float = ranged(
        0.01,
        "(0, 1]",
        help="topk: the share of each replica's gradient sent per step (values + int32 indices)",
    )
    error_feedback: str = option(
        "auto",
        "auto | true | false: keep what compression did not send (per replica,"
        " checkpointed) and add it to the next step; auto = on for int8/int4,"
        " off for topk (under AdamW it made top-k worse: BENCHMARKS.md)",
    )
    sync_every: int = ranged(
        1,
        ">=1",
        help="local SGD / DiLoCo: local steps between data-parallel syncs; 1 = synchronous",
    )
    outer_lr: float = ranged(
        0.7, ">0", help="DiLoCo outer SGD learning rate (Douillard et al. 2023)"
    )
    outer_momentum: float = ranged(
        0.9, "[0, 1)", help="DiLoCo outer Nesterov momentum; 0 = plain SGD on the averaged deltas"
    )

    def validate(self) -> CommConfig:
        check_ranges(self, _flag("comm"))
        if self.compression not in COMPRESSIONS:
            raise UserError(
                f"--comm.compression: '{self.compression}' is not one of {', '.join(COMPRESSIONS)}"
            )
        error_feedback_on("int8", self.error_feedback)  # a valid value, whatever the compression
        if self.sync_every > 1 and self.compression != "none":
            raise UserError(
                f"--comm.compression {self.compression} compresses the every-step gradient sync;"
                f" with --comm.sync_every {self.sync_every} (DiLoCo) use --comm.compression none"
            )
        return self


def error_feedback_on(compression: str, error_feedback: str | bool) -> bool:
    """Whether `--comm.error_feedback` (auto | true | false) keeps residuals for `compression`.
    auto: on for the quantisers, off for top-k, as measured under AdamW (BENCHMARKS.md: top-k's
    error-feedback bursts are stale many-step sums that Adam's normalisation turns into the wrong
    step; top-k 10% on the default model: +12% eval loss with, +1.3% without)."""
    if compression == "none":
        return False
    if str(error_feedback).strip().lower() == "auto":
        return compression != "topk"
    try:
        return parse_bool(error_feedback)
    except argparse.ArgumentTypeError:
        raise UserError(
            f"--comm.error_feedback: '{error_feedback}' is not one of auto, true, false"
        ) from None


# --lora.targets: the projections an adapter can wrap (train/core/lora.py maps them to the weights);
# named here so that parsing flags needs no JAX. MoE experts are not among them.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# --lora.base_dtype: held as is, or quantised at load (int8, nf4: models/quant.py FORMATS)
LORA_BASE_DTYPES = ("auto", "float32", "bfloat16", "int8", "nf4")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The `lora` section: low-rank adapters trained on a frozen base (--init-from),
    train/core/lora.py."""

    rank: int = ranged(0, ">=0", help="adapter rank r; 0 = LoRA off (every parameter trains)")
    alpha: float = ranged(16.0, ">0", help="the adapters' update is scaled by alpha / rank")
    targets: str = option(
        ",".join(LORA_TARGETS),
        f"comma-separated projections that get adapters: {', '.join(LORA_TARGETS)}",
    )
    base_dtype: str = option(
        "auto",
        "auto | float32 | bfloat16 | int8 | nf4: the dtype the frozen base is held in (auto ="
        " model.param_dtype); int8 (per output channel) and nf4 (4-bit NormalFloat per block)"
        " quantise its projections once at load (QLoRA, models/quant.py)",
    )
    block_size: int = ranged(
        64,
        ">=1",
        help="nf4: values per absmax block, along each projection's dims other than d_model"
        " (heads x head_dim, d_ff), which FSDP never splits; the embedding's and head's along"
        " d_model, aligned on 8 shards",
    )
    double_quant: bool = option(
        True,
        "nf4: quantise the block scales once more to int8, a float32 step per group of up to 256"
        " (QLoRA's double quantisation)",
    )
    quantize_embeddings: bool = option(
        True,
        "int8/nf4: quantise the embedding and LM head too (false: at the compute dtype, as"
        " bitsandbytes keeps them); the lookup dequantises its rows, the head each device's"
        " shard",
    )
    allow_random_base: bool = option(
        False,
        "allow LoRA without --init-from: adapters on randomly initialised"
        " base weights (almost always a mistake)",
    )
    base_fingerprint: str = option(
        "",
        "the base weights' fingerprint; empty = recorded from the base when the run"
        " starts; a run refuses a base whose fingerprint differs",
    )

    def target_list(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    def validate(self) -> LoraConfig:
        check_ranges(self, _flag("lora"))
        for name in self.target_list():
            if name not in LORA_TARGETS:
                why = (
                    " (LoRA does not adapt MoE experts or the router)"
                    if name in ("experts", "router")
                    else ""
                )
                raise UserError(
                    f"--lora.targets: unknown target '{name}'{why}; valid:"
                    f" {', '.join(LORA_TARGETS)}"
                )
        if self.rank and not self.target_list():
            raise UserError(
                f"--lora.targets: empty; name at least one of {', '.join(LORA_TARGETS)}"
            )
        if self.base_dtype not in LORA_BASE_DTYPES:
            raise UserError(
                f"--lora.base_dtype: '{self.base_dtype}' is not one of"
                f" {', '.join(LORA_BASE_DTYPES)} (a quantised base: int8 or nf4)"
            )
        return self
