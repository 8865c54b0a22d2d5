"""Run configuration: typed dataclasses, YAML files and `--section.field VALUE` overrides.

Precedence: dataclass defaults < model preset < YAML (--config) < command line. Every int and float
option declares its valid range next to it (`ranged`); a section's validate() checks those, then the
rules between its own fields; Config.validate() runs them all, then the rules that span sections.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import typing
from typing import Any

import yaml

from errors import UserError
from mesh.xla import PRESETS as XLA_PRESETS
from models.config import PRESETS, ModelConfig, PipelineConfig, check_ranges, numeric_fields, preset, ranged


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = ranged(120, ">=1")
    batch_size: int = ranged(16, ">=1")        # global, in sequences
    seq_len: int = ranged(128, ">=1")
    micro_batches: int = ranged(1, ">=1")      # gradient accumulation inside the jitted step
    lr: float = ranged(3e-3, ">0")
    min_lr_ratio: float = ranged(0.1, "[0, 1]")  # cosine decays to lr * min_lr_ratio
    # more than steps is allowed (short smoke runs keep the default): the warmup is cut to steps - 1
    warmup_steps: int = ranged(12, ">=0")
    weight_decay: float = ranged(0.1, ">=0")
    decay_embeddings: bool = False  # norms never decay; embeddings only if this is set
    b1: float = ranged(0.9, "[0, 1)")
    b2: float = ranged(0.95, "[0, 1)")
    eps: float = ranged(1e-8, ">0")            # > 0: a parameter whose gradients are all zero would divide 0 by 0
    grad_clip: float = ranged(1.0, ">=0")      # global-norm clipping; 0 disables
    seed: int = ranged(0, f"[0, {2**63 - 1}]")  # jax.random.key takes a signed 64-bit seed
    # non-finite steps in a row (each skipped) before reloading the last checkpoint; 0 = never
    max_bad_steps: int = ranged(5, ">=0")
    # watchdog: seconds without progress (after the first compile) before exiting 4; 0 = off
    step_timeout: float = ranged(900.0, ">=0")
    # supervisor: restart a crashed run up to N times from its last checkpoint
    max_restarts: int = ranged(0, ">=0")
    # skip the start-up check of the step's per-device memory against what the machine has; the loop uses it
    skip_memory_check: bool = False
    eval_every: int = ranged(60, ">=0")        # 0 disables
    eval_batches: int = ranged(4, ">=0")       # at least 1 while eval_every > 0
    sample_tokens: int = ranged(160, ">=0")    # tokens generated at the end of training; 0 disables
    prompt: str = "def "

    def validate(self) -> "TrainConfig":
        check_ranges(self, functools.partial(public_flag, "train"))
        if self.batch_size % self.micro_batches:
            raise UserError(
                f"--batch-size {self.batch_size} is not divisible by --micro-batches {self.micro_batches}; valid"
                f" micro-batch counts: {[m for m in range(1, self.batch_size + 1) if self.batch_size % m == 0]}")
        if self.eval_every and not self.eval_batches:
            raise UserError(f"--train.eval_batches 0: must be >= 1 while --eval-every {self.eval_every} evaluates"
                            f" (--eval-every 0 turns evaluation off)")
        return self


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    mesh: str = ""                # e.g. data=2,fsdp=2,model=2; empty = all devices on data
    mesh_dcn: str = ""            # part of each axis that spans hosts/slices, e.g. data=4
    rules: str = ""               # logical-axis overrides, e.g. embed=fsdp+model,vocab=none
    coordinator: str = ""         # HOST:PORT of process 0 (multi-process); empty = auto-detect
    num_processes: int = ranged(1, ">=1")
    process_id: int = ranged(0, ">=0")         # below num_processes
    # seconds before a lost peer process is declared (heartbeats; CPU collectives)
    peer_timeout: float = ranged(45.0, ">0")

    def validate(self) -> "ParallelismConfig":
        check_ranges(self, functools.partial(public_flag, "parallelism"))
        if self.process_id >= self.num_processes:
            raise UserError(f"--process-id {self.process_id}: must be in [0, {self.num_processes - 1}]"
                            f" for --num-processes {self.num_processes}")
        return self


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # default (stdlib corpus) | synthetic | DIR (prepared: DIR/index.json) | PATH (text file/dir, byte tokens)
    # | a mixture SRC:WEIGHT,SRC:WEIGHT (e.g. dirA:0.7,dirB:0.3) | FILE.yaml (a list of {source, weight})
    source: str = "default"
    eval_fraction: float = ranged(0.02, "[0, 1)", why="the share of documents held out for eval;"
                                                      " 1 would leave nothing to train on")
    prefetch: int = ranged(2, ">=1")           # batches prepared ahead on a background thread
    packing: bool = True          # documents end to end in seq_len windows; false: one document chunk per row, padded
    packing_mask: bool = False    # also segment_ids/positions so attention stays inside a document
    verify: bool = True           # check every shard's sha256 against the prepared dataset's index at start

    def validate(self) -> "DataConfig":
        check_ranges(self, functools.partial(public_flag, "data"))
        return self


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/latest"
    log_every: int = ranged(10, ">=1")
    tensorboard: bool = True
    progress: bool = True
    # per-device peak for MFU; 0 = from the device table (measured on CPU)
    peak_tflops: float = ranged(0.0, ">=0")

    def validate(self) -> "LoggingConfig":
        check_ranges(self, functools.partial(public_flag, "logging"))
        return self


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""                 # empty = <run_dir>/checkpoints
    every: int = ranged(50, ">=0")             # steps between saves; 0 = only the final save
    keep: int = ranged(3, ">=0")               # the latest K checkpoints are kept; 0 = keep all
    keep_every: int = ranged(0, ">=0")         # steps divisible by this are kept forever (recovery points); 0 = none
    async_save: bool = True       # flag and YAML name: `async` (a Python keyword cannot be a field)
    resume: str = "latest"        # latest | none | PATH (a run dir, a checkpoint dir or one step's dir)
    init_from: str = ""           # PATH: start a fresh run from these parameters (e.g. an HF import); fresh optimizer

    def validate(self) -> "CheckpointConfig":
        check_ranges(self, functools.partial(public_flag, "checkpoint"))
        if not self.resume:
            raise UserError("--resume: expected latest, none or a checkpoint PATH, got ''")
        return self


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""               # A:B = trace steps A..B-1 with jax.profiler into <run_dir>/profile; empty = off

    def validate(self) -> "ProfileConfig":
        # no numeric options; the window is checked against --steps in Config.validate
        check_ranges(self, functools.partial(public_flag, "profile"))
        return self


@dataclasses.dataclass(frozen=True)
class CommConfig:
    compression: str = "none"     # data-parallel gradient sync: none (XLA's float32 all-reduce) | int8 | int4 | topk
    # topk: share of each replica's gradient sent per step (values + int32 indices)
    topk_fraction: float = ranged(0.01, "(0, 1]")
    # keep what compression did not send (per replica, checkpointed) and add it to the next step:
    # auto = on for int8/int4, off for topk (under AdamW it made top-k worse: BENCHMARKS.md)
    error_feedback: str = "auto"
    # local SGD / DiLoCo: local steps between data-parallel syncs; 1 = synchronous
    sync_every: int = ranged(1, ">=1")
    outer_lr: float = ranged(0.7, ">0")        # DiLoCo outer SGD learning rate (Douillard et al. 2023)
    # DiLoCo outer Nesterov momentum; 0 = plain SGD on the averaged deltas
    outer_momentum: float = ranged(0.9, "[0, 1)")

    def validate(self) -> "CommConfig":
        check_ranges(self, functools.partial(public_flag, "comm"))
        if self.compression not in COMPRESSIONS:
            raise UserError(f"--comm.compression: '{self.compression}' is not one of {', '.join(COMPRESSIONS)}")
        error_feedback_on("int8", self.error_feedback)   # a valid value, whatever the compression
        if self.sync_every > 1 and self.compression != "none":
            raise UserError(f"--comm.compression {self.compression} compresses the every-step gradient sync; with"
                            f" --comm.sync_every {self.sync_every} (DiLoCo) use --comm.compression none")
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

    def to_dict(self) -> dict:
        """Sections of public option names (what YAML and --section.field accept)."""
        d = dataclasses.asdict(self)
        d["model"] = {"preset": d.pop("model_preset"), **d["model"]}
        return {section: {PUBLIC_NAMES.get(f"{section}.{k}", k): v for k, v in values.items()}
                for section, values in d.items()}

    def validate(self) -> "Config":
        """Each section's own checks, then the rules that span sections; UserError on the first."""
        for section in SECTIONS:
            getattr(self, section).validate()
        if self.train.seq_len > self.model.max_seq_len:
            raise UserError(f"--seq-len {self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        profile_window(self.profile.steps, self.train.steps)
        return self


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "parallelism": ParallelismConfig,
            "data": DataConfig, "logging": LoggingConfig, "checkpoint": CheckpointConfig, "comm": CommConfig,
            "profile": ProfileConfig, "pipeline": PipelineConfig}

# Option names that differ from their dataclass field: "section.field" -> public name.
PUBLIC_NAMES = {"checkpoint.async_save": "async"}
# Defaults that --help describes rather than prints.
SHOWN_DEFAULTS = {"checkpoint.dir": "<run_dir>/checkpoints"}

# The stable short flags (README) and the field each one sets.
ALIASES = {
    "--model": "model.preset", "--mesh": "parallelism.mesh", "--mesh-dcn": "parallelism.mesh_dcn",
    "--steps": "train.steps", "--batch-size": "train.batch_size", "--seq-len": "train.seq_len",
    "--micro-batches": "train.micro_batches", "--lr": "train.lr", "--seed": "train.seed",
    "--eval-every": "train.eval_every", "--data": "data.source", "--run-dir": "logging.run_dir",
    "--log-every": "logging.log_every", "--peak-tflops": "logging.peak_tflops",
    "--coordinator": "parallelism.coordinator", "--num-processes": "parallelism.num_processes",
    "--process-id": "parallelism.process_id", "--resume": "checkpoint.resume",
    "--max-restarts": "train.max_restarts", "--init-from": "checkpoint.init_from",
}
_SHORT = {key: alias for alias, key in ALIASES.items()}


def public_flag(section: str, field: str) -> str:
    """How a user types the option of a dataclass field: its short alias (--lr) where there is one,
    else --section.name (with its public name: --checkpoint.async)."""
    key = f"{section}.{PUBLIC_NAMES.get(f'{section}.{field}', field)}"
    return _SHORT.get(key, f"--{key}")


def _parse_bool(s: str) -> bool:
    v = str(s).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{s}'")


def _converter(tp):
    return {bool: _parse_bool, int: int, float: float, str: str}[tp]


def _fields(cls) -> list[tuple[str, type, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], f.default) for f in dataclasses.fields(cls)]


def _options(section: str) -> dict[str, tuple[str, type, Any]]:
    """public option name -> (dataclass field, type, default) for one section."""
    return {PUBLIC_NAMES.get(f"{section}.{name}", name): (name, tp, default)
            for name, tp, default in _fields(SECTIONS[section])}


def _coerce(key: str, tp: type, value: Any) -> Any:
    """A YAML/dict/CLI value -> the field's type; never truncates (2.5 or true for an int is an error)."""
    if tp is str and isinstance(value, bool):   # YAML `true` for an auto|true|false option
        value = str(value).lower()
    if isinstance(value, str):
        try:
            return _converter(tp)(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise UserError(f"{key}: expected {tp.__name__}, got {value!r}") from None
    ok = (isinstance(value, bool) if tp is bool else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else False)
    if not ok:
        raise UserError(f"{key}: expected {tp.__name__}, got {value!r}")
    return tp(value)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line and exit 2 (no usage dump); an unknown option lists the
    valid ones of its section."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            flag = message.split(":", 1)[1].split()[0]
            section = flag.lstrip("-").partition(".")[0]
            if section in SECTIONS and "." in flag:
                names = ", ".join(_options(section))
                message = f"unknown option '{flag}'; valid {section} options: {names}"
            else:
                message = (f"unknown option '{flag}'; valid: --section.field with sections"
                           f" {', '.join(SECTIONS)}, or {', '.join(['--config', *ALIASES])}")
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Every field as --section.field, plus the stable short aliases; defaults shown in --help."""
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help="YAML file with config sections")
    # Acted on by train/__main__.py before jax is imported (mesh/xla.py); declared here for --help.
    parser.add_argument("--xla-preset", choices=list(XLA_PRESETS), default=argparse.SUPPRESS,
                        help="recommended XLA flags for the backend, merged into XLA_FLAGS / LIBTPU_INIT_ARGS"
                             " (flags already set win)")
    parser.add_argument("--model", "--model.preset", dest="model.preset", default=argparse.SUPPRESS, metavar="PRESET",
                        help=f"model preset: {', '.join(PRESETS)} (default: default)")
    for section in SECTIONS:
        group = parser.add_argument_group(section)
        ranges = {f.name: f.metadata["range"].spec for f in numeric_fields(SECTIONS[section])}
        for name, (field, tp, default) in _options(section).items():
            key = f"{section}.{name}"
            flags = [f"--{key}"] + ([_SHORT[key]] if key in _SHORT else [])
            shown = "from the preset" if section == "model" else SHOWN_DEFAULTS.get(key, default)
            valid = f" valid: {ranges[field]}" if field in ranges else ""
            group.add_argument(*flags, dest=key, type=_converter(tp), default=argparse.SUPPRESS,
                               metavar=tp.__name__.upper(), help=f"(default: {shown}){valid}")


def build(cli: dict[str, Any] | None = None, yaml_path: str | None = None) -> Config:
    """Resolve a Config from an optional YAML file and `{section.field: value}` overrides."""
    raw: dict[str, dict] = {s: {} for s in SECTIONS}
    if yaml_path:
        raw = _merge(raw, _load_yaml(yaml_path))
    for key, value in (cli or {}).items():
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise UserError(f"unknown option '{key}'; valid sections: {', '.join(SECTIONS)}")
        raw[section][name] = value
    model_raw = dict(raw.pop("model"))
    preset_name = model_raw.pop("preset", "default")
    sections = {}
    for section, cls in SECTIONS.items():
        base = preset(preset_name) if section == "model" else cls()
        values = model_raw if section == "model" else raw.get(section, {})
        options = _options(section)
        for name in values:
            if name not in options:
                raise UserError(f"unknown option '{section}.{name}'; valid {section} options: {', '.join(options)}")
        sections[section] = dataclasses.replace(
            base, **{options[n][0]: _coerce(f"{section}.{n}", options[n][1], v) for n, v in values.items()})
    return Config(model_preset=preset_name, **sections).validate()


# mesh/collectives.py METHODS plus the plain all-reduce; kept here so parsing flags needs no JAX
COMPRESSIONS = ("none", "int8", "int4", "topk")


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
        return _parse_bool(error_feedback)
    except argparse.ArgumentTypeError:
        raise UserError(f"--comm.error_feedback: '{error_feedback}' is not one of auto, true, false") from None


def validate_comm(compression: str, topk_fraction: float, sync_every: int, outer_lr: float,
                  outer_momentum: float, error_feedback: str | bool = "auto") -> None:
    """UserError naming the `comm.*` option that is out of range (CommConfig.validate, for callers
    that hold the values rather than a section)."""
    CommConfig(compression, topk_fraction, error_feedback, sync_every, outer_lr, outer_momentum).validate()


def profile_window(spec: str, steps: int) -> tuple[int, int] | None:
    """--profile.steps 'A:B' -> (A, B): trace steps A..B-1; '' -> None."""
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise UserError(f"--profile.steps '{spec}': expected START:STOP, e.g. 10:15 (steps 10 to 14)") from None
    if not 1 <= a < b <= steps + 1:
        raise UserError(f"--profile.steps '{spec}': need 1 <= START < STOP <= --steps + 1 = {steps + 1}")
    return a, b


def _load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise UserError(f"--config: cannot read '{path}': {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"--config: '{path}' is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"--config: '{path}' must be a mapping of sections")
    for section, values in data.items():
        if section not in SECTIONS:
            raise UserError(f"--config {path}: unknown section '{section}'; valid: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise UserError(f"--config {path}: section '{section}' must be a mapping")
    return data


def _merge(a: dict, b: dict) -> dict:
    return {s: {**a.get(s, {}), **b.get(s, {})} for s in set(a) | set(b)}


def from_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> tuple[Config, argparse.Namespace]:
    parser = parser or make_parser()
    ns = parser.parse_args(argv)
    cli = {k: v for k, v in vars(ns).items() if "." in k}
    return build(cli, getattr(ns, "config", None)), ns


def make_parser(prog: str = "python -m train", description: str = "Train a Transformer on a device mesh.") -> argparse.ArgumentParser:
    # allow_abbrev=False: a typo like --checkpoint.asyn must be an error, not a silent prefix match
    parser = OneLineParser(prog=prog, description=description, allow_abbrev=False,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(parser)
    return parser


def dump(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), indent=2)
