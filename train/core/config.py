"""Run configuration: typed dataclasses, one per section, YAML files and `--section.field VALUE` overrides.

Each field declares next to it its valid range (`ranged`, for ints and floats) and the text
`--help` shows (`ranged(..., help=)` or `option`). Precedence: dataclass defaults < model preset
< YAML (--config) < command line. A section's validate() checks its ranges, then the rules
between its own fields; Config.validate() runs them all, then the rules that span sections, once,
when `build` makes the Config.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from typing import Any

from errors import ArgParser, UserError, expect
from mesh.xla import PRESETS as XLA_PRESETS
from models import registry
from models.config import (
    CONTEXT_STRATEGIES,
    ModelConfig,
    PipelineConfig,
    check_ranges,
    option,
    ranged,
)
from models.presets import PRESETS, preset
from train.core.flags import (
    ALIASES,
    PUBLIC_NAMES,
    SHORT,
    SHOWN_DEFAULTS,
    coerce,
    converter,
    help_line,
    load_yaml,
    public_flag,
    typed_fields,
)
from train.core.sections import CommConfig, LoraConfig, ProfileConfig, profile_window

# train/core/optim.py builds each from optax; named here so that parsing flags needs no JAX
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "muon")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The `train` section: the optimizer and its schedule, the batch, evaluation, sampling and recovery."""

    steps: int = ranged(120, ">=1", help="optimizer steps to run")
    batch_size: int = ranged(16, ">=1", help="global batch, in sequences")
    seq_len: int = ranged(128, ">=1", help="tokens per sequence; at most model.max_seq_len")
    micro_batches: int = ranged(
        1,
        ">=1",
        help="gradient accumulation inside the jitted step: the batch is split"
        " into this many micro-batches; must divide --batch-size",
    )
    lr: float = ranged(
        3e-3, ">0", help="peak learning rate: linear warmup to it, then a cosine decay"
    )
    min_lr_ratio: float = ranged(0.1, "[0, 1]", help="the cosine decays to lr * min_lr_ratio")
    warmup_steps: int = ranged(
        12,
        ">=0",
        help="steps of linear warmup; more than --steps is allowed (short smoke"
        " runs keep the default): the warmup is cut to steps - 1",
    )
    optimizer: str = option(
        "adamw",
        f"{' | '.join(OPTIMIZERS)} (flag --optim.name): optax's optimizer of that"
        " name, inside the same guards (train/core/optim.py); adafactor's --lr is relative"
        " to each weight's RMS, lion's 3-10x below adamw's",
    )
    weight_decay: float = ranged(
        0.1, ">=0", help="decoupled weight decay (AdamW's), whatever the optimizer"
    )
    decay_embeddings: bool = option(False, "weight decay on the embeddings too (norms never decay)")
    b1: float = ranged(
        0.9, "[0, 1)", help="decay of the gradient's running mean: the momentum (sgd: 0 = none)"
    )
    b2: float = ranged(
        0.95, "[0, 1)", help="decay of the squared gradient's running mean (lion: of the momentum)"
    )
    eps: float = ranged(
        1e-8, ">0", help="AdamW/Muon epsilon; > 0: all-zero gradients would divide 0 by 0"
    )
    grad_clip: float = ranged(1.0, ">=0", help="global-norm gradient clipping; 0 disables")
    offload_optimizer: bool = option(
        False,
        "keep the optimizer state in pinned host memory between steps; the"
        " step brings it to the device for the update and back (saves device"
        " memory, costs host-link traffic each step)",
    )
    seed: int = ranged(
        0,
        f"[0, {2**63 - 1}]",
        help="seed of the initial parameters, the data order and"
        " sampling; jax.random.key takes a signed 64-bit seed",
    )
    max_bad_steps: int = ranged(
        5,
        ">=0",
        help="skipped steps in a row (non-finite gradients or loss spikes) before"
        " reloading the last checkpoint; 0 = never",
    )
    spike_factor: float = ranged(
        0.0,
        ">=0",
        help="skip the update of a step whose loss exceeds this many times the"
        " median of the last 32 applied steps' losses (from 8 on); 0 = off,"
        " else >= 1",
    )
    step_timeout: float = ranged(
        900.0,
        ">=0",
        help="watchdog: seconds without progress (after the first compile)"
        " before exiting 4; 0 = off",
    )
    max_restarts: int = ranged(
        0, ">=0", help="supervisor: restart a crashed run up to N times from its last checkpoint"
    )
    skip_memory_check: bool = option(
        False,
        "skip the start-up check of the step's per-device memory against what the machine has",
    )
    eval_every: int = ranged(60, ">=0", help="steps between evaluations; 0 disables")
    eval_batches: int = ranged(
        4, ">=0", help="batches per evaluation; at least 1 while eval_every > 0"
    )
    sample_tokens: int = ranged(
        160, ">=0", help="tokens generated from --train.prompt at the end of training; 0 disables"
    )
    prompt: str = option("def ", "the text that sampling at the end of training continues")

    def validate(self) -> TrainConfig:
        check_ranges(self, functools.partial(public_flag, "train"))
        if self.batch_size % self.micro_batches:
            raise UserError(
                f"--batch-size {self.batch_size} is not divisible by --micro-batches {self.micro_batches}; valid"
                f" micro-batch counts: {[m for m in range(1, self.batch_size + 1) if self.batch_size % m == 0]}"
            )
        if self.eval_every and not self.eval_batches:
            raise UserError(
                f"--train.eval_batches 0: must be >= 1 while --eval-every {self.eval_every} evaluates"
                f" (--eval-every 0 turns evaluation off)"
            )
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optim.name '{self.optimizer}': valid: {', '.join(OPTIMIZERS)}")
        if 0 < self.spike_factor < 1:
            raise UserError(
                f"--train.spike_factor {self.spike_factor}: must be 0 (off) or >= 1 (every loss above the"
                f" running median would be a spike below 1)"
            )
        return self


VOCAB_PARALLEL = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """The `parallelism` section: the device mesh, the rule-table overrides and the multi-process job."""

    mesh: str = option(
        "",
        "mesh axis sizes, e.g. data=2,fsdp=2,model=2 (one may be -1: the rest); empty = all"
        " devices on data",
    )
    mesh_dcn: str = option("", "the part of each axis that spans hosts/slices, e.g. data=4")
    rules: str = option(
        "", "logical-axis overrides of the rule table, e.g. embed=fsdp+model,vocab=none"
    )
    vocab_parallel: str = option(
        "auto",
        "auto | on | off: shard the embedding and LM head on the vocabulary over"
        " the FSDP axes and gather the head's input instead of its weights; auto:"
        " where that moves fewer bytes (fewer tokens per FSDP group than vocab)",
    )
    context_strategy: str = option(
        "all_gather",
        "all_gather | ring: how attention reaches the keys of other"
        " sequence shards on the context axis: K/V gathered over it, or"
        " passed round a ring of collective-permutes, one block at a time",
    )
    sequence_parallel: bool = option(
        False,
        "split the residual stream's sequence over the model axis between"
        " blocks (Megatron sequence parallelism): each tensor-parallel"
        " all-reduce becomes a reduce-scatter + all-gather, and norms and"
        " residuals take 1/model of the memory",
    )
    coordinator: str = option("", "HOST:PORT of process 0 (multi-process); empty = auto-detect")
    num_processes: int = ranged(1, ">=1", help="processes in the job")
    process_id: int = ranged(0, ">=0", help="this process's rank; below num_processes")
    peer_timeout: float = ranged(
        45.0,
        ">0",
        help="seconds before a lost peer process is declared (heartbeats; CPU collectives)",
    )

    def validate(self) -> ParallelismConfig:
        check_ranges(self, functools.partial(public_flag, "parallelism"))
        if self.vocab_parallel not in VOCAB_PARALLEL:
            raise UserError(
                f"--parallelism.vocab_parallel '{self.vocab_parallel}': valid: {', '.join(VOCAB_PARALLEL)}"
            )
        if self.context_strategy not in CONTEXT_STRATEGIES:
            raise UserError(
                f"--parallelism.context_strategy '{self.context_strategy}': valid:"
                f" {', '.join(CONTEXT_STRATEGIES)}"
            )
        if self.process_id >= self.num_processes:
            raise UserError(
                f"--process-id {self.process_id}: must be in [0, {self.num_processes - 1}]"
                f" for --num-processes {self.num_processes}"
            )
        return self


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `data` section: where the tokens come from and how batches are made of them."""

    source: str = option(
        "default",
        "default (stdlib corpus) | synthetic | DIR (prepared: DIR/index.json) | PATH"
        " (text file/dir, byte tokens) | a mixture SRC:WEIGHT,SRC:WEIGHT (e.g."
        " dirA:0.7,dirB:0.3) | FILE.yaml (a list of {source, weight})",
    )
    eval_fraction: float = ranged(
        0.02,
        "[0, 1)",
        help="the share of documents held out for eval",
        why="the share of documents held out for eval; 1 would leave nothing to train on",
    )
    prefetch: int = ranged(2, ">=1", help="batches prepared ahead on a background thread")
    packing: bool = option(
        True, "documents end to end in seq_len windows; false: one document chunk per row, padded"
    )
    packing_mask: bool = option(
        False, "also segment_ids/positions so that attention stays inside a document"
    )
    verify: bool = option(
        True, "check every shard's sha256 against the prepared dataset's index at start"
    )
    allow_tokenizer_mismatch: bool = option(
        False,
        "use data prepared with another tokenizer than the one the"
        " --init-from (or evaluated) checkpoint records; refused"
        " otherwise: its token ids would mean other text",
    )
    eval_source: str = option(
        "",
        "[NAME=]DIR[,[NAME=]DIR ...]: prepared datasets also evaluated at every eval"
        " (--eval-every), each on its eval split (--data.eval_fraction) for"
        " --train.eval_batches batches, logged as eval/NAME/loss and eval/NAME/perplexity;"
        " NAME defaults to DIR's base name; empty = none",
    )

    def validate(self) -> DataConfig:
        check_ranges(self, functools.partial(public_flag, "data"))
        if (
            self.eval_source
        ):  # the syntax here; the directories are opened (and checked) when a run starts
            from train.data.evalsets import parse_source

            parse_source(self.eval_source)
        return self


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """The `logging` section: the run directory and what is reported while training."""

    run_dir: str = option(
        "runs/latest",
        "where the run writes its config, metrics, logs and checkpoints; the"
        " default gives each run a fresh runs/<YYYYmmdd-HHMMSS>-<model>-<mesh>"
        " and makes runs/latest a link to it; gs:// and s3:// work too",
    )
    log_every: int = ranged(10, ">=1", help="steps between metric lines")
    tensorboard: bool = option(True, "also write TensorBoard event files")
    progress: str = option(
        "auto",
        "auto | bar | lines | none: a tqdm bar, one plain line per logged step (for"
        " cluster log files), or neither; auto = bar when stderr is a terminal, else"
        " lines; true/false = auto/none",
    )
    wandb: str = option(
        "",
        "PROJECT: also log to this Weights & Biases project (pip install 'brigade[wandb]');"
        " <run_dir>/wandb_id keeps the run id, so a resumed run continues it; empty = off",
    )
    peak_tflops: float = ranged(
        0.0,
        ">=0",
        help="per-device peak TFLOP/s for MFU; 0 = from the device table (measured on CPU)",
    )
    straggler_threshold: float = ranged(
        1.5,
        ">1",
        help="warn when the slowest process's step time stays above this"
        " many times the median of the others for 3 log intervals",
    )

    def validate(self) -> LoggingConfig:
        check_ranges(self, functools.partial(public_flag, "logging"))
        from checkpoint.storage import require_backend
        from train.run.sinks import (
            check_tensorboard,
            check_tracker,
            check_wandb_mode,
            progress_mode,
        )

        progress_mode(self.progress)
        require_backend(self.run_dir, "--run-dir")  # gs:// without gcsfs: one line, at once
        if self.tensorboard:
            check_tensorboard(self.run_dir)
        if self.wandb:
            check_tracker("--logging.wandb", "wandb", "wandb")
            check_wandb_mode()
        return self


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The `checkpoint` section: when checkpoints are saved, which are kept, and where a run starts from."""

    dir: str = option("", "directory of the run's checkpoints (empty: the default)")
    every: int = ranged(50, ">=0", help="steps between saves; 0 = only the final save")
    keep: int = ranged(3, ">=0", help="the latest K checkpoints are kept; 0 = keep all")
    keep_every: int = ranged(
        0, ">=0", help="steps divisible by this are kept forever (recovery points); 0 = none"
    )
    # the option is `async` (flag and YAML): a Python keyword cannot be a field
    async_save: bool = option(True, "save in the background while training goes on")
    resume: str = option(
        "auto",
        "auto = the run dir's own newest intact checkpoint, if any | latest = continue"
        " the newest run under runs/ (its settings must match; with an explicit --run-dir:"
        " as auto) | none | PATH (a run dir, a checkpoint dir or one step's dir)",
    )
    init_from: str = option(
        "",
        "PATH: start a fresh run from these parameters (e.g. an HF import), with a fresh optimizer",
    )
    adopt: bool = option(
        False,
        "save into a --checkpoint.dir that belongs to another run, continuing from its"
        " steps (which this run then never deletes)",
    )
    local_dir: str = option(
        "",
        "host-local directory (fast disk, RAM disk) for frequent saves, each process"
        " its own copy in <local_dir>/process-<i>; empty = no local tier",
    )
    local_every: int = ranged(
        10, ">=0", help="steps between local-tier saves (>= 1 with local_dir)"
    )
    local_keep: int = ranged(
        2, ">=1", help="the latest K local-tier steps are kept on each process"
    )

    def validate(self) -> CheckpointConfig:
        check_ranges(self, functools.partial(public_flag, "checkpoint"))
        from checkpoint.storage import require_backend

        require_backend(self.dir, "--checkpoint.dir")
        if not self.resume:
            raise UserError("--resume: expected auto, latest, none or a checkpoint PATH, got ''")
        if self.local_dir and self.local_every < 1:
            raise UserError(
                f"--checkpoint.local_every {self.local_every}: must be >= 1 when"
                f" --checkpoint.local_dir is set (steps between local saves)"
            )
        return self


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=lambda: preset("default"))
    model_preset: str = "default"
    train: TrainConfig = TrainConfig()
    parallelism: ParallelismConfig = ParallelismConfig()
    data: DataConfig = DataConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    comm: CommConfig = CommConfig()
    profile: ProfileConfig = ProfileConfig()
    pipeline: PipelineConfig = PipelineConfig()
    lora: LoraConfig = LoraConfig()

    def to_dict(self) -> dict:
        """Sections of public option names (what YAML and --section.field accept)."""
        d = dataclasses.asdict(self)
        d["model"] = {"preset": d.pop("model_preset"), **d["model"]}
        return {
            section: {PUBLIC_NAMES.get(f"{section}.{k}", k): v for k, v in values.items()}
            for section, values in d.items()
        }

    def validate(self) -> Config:
        """Each section's own checks, then the rules that span sections; UserError on the first."""
        for section in SECTIONS:
            getattr(self, section).validate()
        if self.train.seq_len > self.model.max_seq_len:
            raise UserError(
                f"--seq-len {self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        profile_window(self.profile.steps, self.train.steps)
        if self.train.spike_factor and self.comm.sync_every > 1:
            raise UserError(
                f"--train.spike_factor {self.train.spike_factor}: not with --comm.sync_every"
                f" {self.comm.sync_every} (DiLoCo replicas step alone); use one or the other"
            )
        if (
            self.train.offload_optimizer and self.comm.sync_every > 1
        ):  # per-replica state, the outer optimizer
            raise UserError(
                f"--train.offload_optimizer true: not with --comm.sync_every {self.comm.sync_every}"
                f" (DiLoCo); use --comm.sync_every 1 or --train.offload_optimizer false"
            )
        return self


SECTIONS = {
    "model": ModelConfig,
    "train": TrainConfig,
    "parallelism": ParallelismConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "comm": CommConfig,
    "profile": ProfileConfig,
    "pipeline": PipelineConfig,
    "lora": LoraConfig,
}


def _options(section: str) -> dict[str, tuple[dataclasses.Field, type]]:
    """public option name -> (dataclass field, its type) for one section."""
    return {
        PUBLIC_NAMES.get(f"{section}.{f.name}", f.name): (f, tp)
        for f, tp in typed_fields(SECTIONS[section])
    }


def _unknown_option(flag: str) -> str:
    """The parser's error for an option it does not know: the valid options of the flag's section."""
    section = flag.lstrip("-").partition(".")[0]
    if section in SECTIONS and "." in flag:
        return f"unknown option '{flag}'; valid {section} options: {', '.join(_options(section))}"
    return (
        f"unknown option '{flag}'; valid: --section.field with sections"
        f" {', '.join(SECTIONS)}, or {', '.join(['--config', *ALIASES])}"
    )


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Every field as --section.field, plus the stable short aliases; each flag's help is its field's."""
    parser.add_argument(
        "--config",
        action="append",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="YAML file with config sections; repeatable: a later file's values win",
    )
    # Acted on by train/cli/main.py before jax is imported (mesh/xla.py); declared here for --help.
    parser.add_argument(
        "--xla-preset",
        choices=list(XLA_PRESETS),
        default=argparse.SUPPRESS,
        help="recommended XLA flags for the backend, merged into XLA_FLAGS / LIBTPU_INIT_ARGS"
        " (flags already set win)",
    )
    parser.add_argument(
        "--model",
        "--model.preset",
        dest="model.preset",
        default=argparse.SUPPRESS,
        metavar="PRESET",
        help=f"model preset: {', '.join(PRESETS)} (default: default)",
    )
    for section in SECTIONS:
        group = parser.add_argument_group(section)
        for name, (field, tp) in _options(section).items():
            key = f"{section}.{name}"
            shown = (
                "from the preset" if section == "model" else SHOWN_DEFAULTS.get(key, field.default)
            )
            group.add_argument(
                f"--{key}",
                *([SHORT[key]] if key in SHORT else []),
                dest=key,
                type=converter(tp),
                default=argparse.SUPPRESS,
                metavar=tp.__name__.upper(),
                help=help_line(key, field, shown),
            )


def build(cli: dict[str, Any] | None = None, yaml_path: str | list[str] | None = None) -> Config:
    """Resolve a Config from optional YAML files (a later file's values win) and `{section.field:
    value}` overrides."""
    _check_build_args(cli, yaml_path)
    raw: dict[str, dict] = {s: {} for s in SECTIONS}
    for path in [yaml_path] if isinstance(yaml_path, str) else yaml_path or []:
        for section, values in load_yaml(path, SECTIONS).items():
            raw[section].update(values)
    for key, value in (cli or {}).items():
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise UserError(f"unknown option '{key}'; valid sections: {', '.join(SECTIONS)}")
        raw[section][name] = value
    model_raw = dict(raw.pop("model"))
    preset_name = model_raw.pop("preset", "default")
    sections = {}
    for section, cls in SECTIONS.items():
        base = (
            registry.config(preset_name, PRESETS) if section == "model" else cls()
        )  # a preset or models.register's
        values = model_raw if section == "model" else raw[section]
        options = _options(section)
        for name in values:
            if name not in options:
                raise UserError(
                    f"unknown option '{section}.{name}'; valid {section} options: {', '.join(options)}"
                )
        sections[section] = dataclasses.replace(
            base,
            **{
                options[n][0].name: coerce(f"{section}.{n}", options[n][1], v)
                for n, v in values.items()
            },
        )
    if (
        "vocab_size" not in model_raw
    ):  # unset: the model takes the prepared data's vocabulary where it needs more
        from train.data.sources import dataset_vocab

        need = dataset_vocab(sections["data"].source)
        if (
            need is not None and need > sections["model"].vocab_size
        ):  # padded to 128 so that mesh axes split it
            sections["model"] = dataclasses.replace(
                sections["model"], vocab_size=-(-need // 128) * 128
            )
    return Config(model_preset=preset_name, **sections).validate()


def _check_build_args(cli, yaml_path) -> None:
    """build()'s arguments: TypeError naming the one of the wrong type (a preset name given as
    the overrides failed with AttributeError on `.items`)."""
    expect("build", "overrides", cli, (dict, type(None)), "a dict {'section.field': value}")
    for key in cli or {}:
        expect("build", "an overrides key", key, str, "'section.field' text, e.g. 'train.lr'")
    paths = yaml_path if isinstance(yaml_path, (list, tuple)) else [yaml_path]
    for path in paths if yaml_path is not None else []:
        expect("build", "yaml_path", path, (str, os.PathLike), "a YAML file's path (or a list)")


def from_args(
    argv: list[str], parser: argparse.ArgumentParser | None = None
) -> tuple[Config, argparse.Namespace]:
    expect("from_args", "argv", argv, (list, tuple), "a list of arguments, e.g. ['--lr', '0.1']")
    parser = parser or make_parser()
    ns = parser.parse_args(argv)
    cli = {k: v for k, v in vars(ns).items() if "." in k}
    return build(cli, getattr(ns, "config", None)), ns


def make_parser(
    prog: str = "python -m train", description: str = "Train a Transformer on a device mesh."
) -> argparse.ArgumentParser:
    # allow_abbrev=False: a typo like --checkpoint.asyn must be an error, not a silent prefix match
    parser = ArgParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        explain_unknown=_unknown_option,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_args(parser)
    return parser


def dump(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), indent=2)
