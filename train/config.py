"""Run configuration: typed dataclasses, YAML files and `--section.field VALUE` overrides.

Precedence: dataclass defaults < model preset < YAML (--config) < command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any

import yaml

from mesh.errors import UserError
from mesh.xla import PRESETS as XLA_PRESETS
from models.config import PRESETS, ModelConfig, preset
from models.config import SCHEDULES, PipelineConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 120
    batch_size: int = 16          # global, in sequences
    seq_len: int = 128
    micro_batches: int = 1        # gradient accumulation inside the jitted step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1     # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 12
    weight_decay: float = 0.1
    decay_embeddings: bool = False  # norms never decay; embeddings only if this is set
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0        # global-norm clipping; 0 disables
    seed: int = 0
    max_bad_steps: int = 5        # non-finite steps in a row (each skipped) before reloading the last checkpoint; 0 = never
    step_timeout: float = 900.0   # watchdog: seconds without progress (after the first compile) before exiting 4; 0 = off
    max_restarts: int = 0         # supervisor: restart a crashed run up to N times from its last checkpoint
    eval_every: int = 60          # 0 disables
    eval_batches: int = 4
    sample_tokens: int = 160      # tokens generated at the end of training; 0 disables
    prompt: str = "def "


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    mesh: str = ""                # e.g. data=2,fsdp=2,model=2; empty = all devices on data
    mesh_dcn: str = ""            # part of each axis that spans hosts/slices, e.g. data=4
    rules: str = ""               # logical-axis overrides, e.g. embed=fsdp+model,vocab=none
    coordinator: str = ""         # HOST:PORT of process 0 (multi-process); empty = auto-detect
    num_processes: int = 1
    process_id: int = 0
    peer_timeout: float = 45.0    # seconds before a lost peer process is declared (heartbeats; CPU collectives)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # default (stdlib corpus) | synthetic | DIR (prepared: DIR/index.json) | PATH (text file/dir, byte tokens)
    # | a mixture SRC:WEIGHT,SRC:WEIGHT (e.g. dirA:0.7,dirB:0.3) | FILE.yaml (a list of {source, weight})
    source: str = "default"
    eval_fraction: float = 0.02   # share of documents held out for eval
    prefetch: int = 2             # batches prepared ahead on a background thread
    packing: bool = True          # documents end to end in seq_len windows; false: one document chunk per row, padded
    packing_mask: bool = False    # also segment_ids/positions so attention stays inside a document
    verify: bool = True           # check every shard's sha256 against the prepared dataset's index at start


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/latest"
    log_every: int = 10
    tensorboard: bool = True
    progress: bool = True
    peak_tflops: float = 0.0      # per-device peak for MFU; 0 = from the device table (measured on CPU)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""                 # empty = <run_dir>/checkpoints
    every: int = 50               # steps between saves; 0 = only the final save
    keep: int = 3                 # the latest K checkpoints are kept; 0 = keep all
    keep_every: int = 0           # steps divisible by this are kept forever (recovery points); 0 = none
    async_save: bool = True       # flag and YAML name: `async` (a Python keyword cannot be a field)
    resume: str = "latest"        # latest | none | PATH (a run dir, a checkpoint dir or one step's dir)
    init_from: str = ""           # PATH: start a fresh run from these parameters (e.g. an HF import); fresh optimizer


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""               # A:B = trace steps A..B-1 with jax.profiler into <run_dir>/profile; empty = off


@dataclasses.dataclass(frozen=True)
class CommConfig:
    compression: str = "none"     # data-parallel gradient sync: none (XLA's float32 all-reduce) | int8 | int4 | topk
    topk_fraction: float = 0.01   # topk: share of each replica's gradient sent per step (values + int32 indices)
    # keep what compression did not send (per replica, checkpointed) and add it to the next step:
    # auto = on for int8/int4, off for topk (under AdamW it made top-k worse: BENCHMARKS.md)
    error_feedback: str = "auto"
    sync_every: int = 1           # local SGD / DiLoCo: local steps between data-parallel syncs; 1 = synchronous
    outer_lr: float = 0.7         # DiLoCo outer SGD learning rate (Douillard et al. 2023)
    outer_momentum: float = 0.9   # DiLoCo outer Nesterov momentum; 0 = plain SGD on the averaged deltas


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
    short = {v: k for k, v in ALIASES.items()}
    parser.add_argument("--model", "--model.preset", dest="model.preset", default=argparse.SUPPRESS, metavar="PRESET",
                        help=f"model preset: {', '.join(PRESETS)} (default: default)")
    for section in SECTIONS:
        group = parser.add_argument_group(section)
        for name, (_, tp, default) in _options(section).items():
            key = f"{section}.{name}"
            flags = [f"--{key}"] + ([short[key]] if key in short else [])
            shown = "from the preset" if section == "model" else SHOWN_DEFAULTS.get(key, default)
            group.add_argument(*flags, dest=key, type=_converter(tp), default=argparse.SUPPRESS,
                               metavar=tp.__name__.upper(), help=f"(default: {shown})")


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
    cfg = Config(model_preset=preset_name, **sections)
    cfg.model.validate()
    _validate(cfg)
    return cfg


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
    """UserError naming the `comm.*` option that is out of range."""
    if compression not in COMPRESSIONS:
        raise UserError(f"--comm.compression: '{compression}' is not one of {', '.join(COMPRESSIONS)}")
    error_feedback_on("int8", error_feedback)   # a valid value, whatever the compression
    if not 0 < topk_fraction <= 1:
        raise UserError(f"--comm.topk_fraction must be in (0, 1], got {topk_fraction}")
    if sync_every < 1:
        raise UserError(f"--comm.sync_every must be >= 1 (1 = synchronous training), got {sync_every}")
    if outer_lr <= 0:
        raise UserError(f"--comm.outer_lr must be positive, got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        raise UserError(f"--comm.outer_momentum must be in [0, 1), got {outer_momentum}")
    if sync_every > 1 and compression != "none":
        raise UserError(f"--comm.compression {compression} compresses the every-step gradient sync; with"
                        f" --comm.sync_every {sync_every} (DiLoCo) use --comm.compression none")


def _validate(cfg: Config) -> None:
    t = cfg.train
    for name in ("steps", "batch_size", "seq_len", "micro_batches"):
        if getattr(t, name) <= 0:
            raise UserError(f"train.{name} must be positive, got {getattr(t, name)}")
    if t.batch_size % t.micro_batches:
        raise UserError(f"--batch-size {t.batch_size} is not divisible by --micro-batches {t.micro_batches};"
                        f" valid micro-batch counts: {[m for m in range(1, t.batch_size + 1) if t.batch_size % m == 0]}")
    if t.seq_len > cfg.model.max_seq_len:
        raise UserError(f"--seq-len {t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if cfg.logging.log_every <= 0:
        raise UserError(f"--log-every must be positive, got {cfg.logging.log_every}")
    for name in ("step_timeout", "max_restarts", "max_bad_steps"):
        if getattr(t, name) < 0:
            raise UserError(f"train.{name} must be >= 0, got {getattr(t, name)}")
    if cfg.parallelism.peer_timeout <= 0:
        raise UserError(f"parallelism.peer_timeout must be positive, got {cfg.parallelism.peer_timeout}")
    m = cfg.comm
    validate_comm(m.compression, m.topk_fraction, m.sync_every, m.outer_lr, m.outer_momentum, m.error_feedback)
    c = cfg.checkpoint
    for name in ("every", "keep", "keep_every"):
        if getattr(c, name) < 0:
            raise UserError(f"checkpoint.{name} must be >= 0, got {getattr(c, name)}")
    profile_window(cfg.profile.steps, t.steps)
    pc = cfg.pipeline  # what needs the mesh (stages, layer and batch divisibility) the Trainer checks
    if pc.schedule not in SCHEDULES:
        raise UserError(f"--pipeline.schedule '{pc.schedule}' is not one of {', '.join(SCHEDULES)}")
    if pc.microbatches < 0:
        raise UserError(f"--pipeline.microbatches must be >= 0 (0 = as many as stages), got {pc.microbatches}")
    if pc.repeats < 1:
        raise UserError(f"--pipeline.repeats must be >= 1, got {pc.repeats}")
    if not c.resume:
        raise UserError("--resume: expected latest, none or a checkpoint PATH, got ''")


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
