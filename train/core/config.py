"""Run configuration: typed dataclasses, one per section, YAML files and `--section.field VALUE`
overrides.

Each field declares next to it its valid range (`ranged`, for ints and floats) and the text
`--help` shows (`ranged(..., help=)` or `option`). Precedence: dataclass defaults < model preset
< YAML (--config) < command line. A section's validate() checks its ranges, then the rules
between its own fields; Config.validate() runs them all, then the rules that span sections, once,
when `build` makes the Config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from errors import ArgParser, UserError, expect
from mesh.xla import PRESETS as XLA_PRESETS
from models import registry
from models.config import ModelConfig, PipelineConfig
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
    typed_fields,
)
from train.core.post_sections import PostConfig, check_config
from train.core.run_sections import CheckpointConfig, LoggingConfig
from train.core.sections import CommConfig, LoraConfig, ProfileConfig, profile_window
from train.core.step_sections import OPTIMIZERS, DataConfig, ParallelismConfig, TrainConfig

# the sections' classes are imported from here too (`from train.core.config import TrainConfig`)
__all__ = [
    "OPTIMIZERS",
    "CheckpointConfig",
    "CommConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "ParallelismConfig",
    "PostConfig",
    "ProfileConfig",
    "SECTIONS",
    "TrainConfig",
    "build",
    "dump",
    "from_args",
    "make_parser",
]


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
    post: PostConfig = PostConfig()

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
        check_config(self)  # the post-training objective's rules (train/core/post_sections.py)
        if self.train.spike_factor and self.comm.sync_every > 1:
            raise UserError(
                f"--train.spike_factor {self.train.spike_factor}: not with --comm.sync_every"
                f" {self.comm.sync_every} (DiLoCo replicas step alone); use one or the other"
            )
        # per-replica state, the outer optimizer
        if self.train.offload_optimizer and self.comm.sync_every > 1:
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
    "post": PostConfig,
}


def _options(section: str) -> dict[str, tuple[dataclasses.Field, type]]:
    """public option name -> (dataclass field, its type) for one section."""
    return {
        PUBLIC_NAMES.get(f"{section}.{f.name}", f.name): (f, tp)
        for f, tp in typed_fields(SECTIONS[section])
    }


def _unknown_option(flag: str) -> str:
    """The parser's error for an option it does not know: the valid options of the flag's
    section."""
    section = flag.lstrip("-").partition(".")[0]
    if section in SECTIONS and "." in flag:
        return f"unknown option '{flag}'; valid {section} options: {', '.join(_options(section))}"
    return (
        f"unknown option '{flag}'; valid: --section.field with sections"
        f" {', '.join(SECTIONS)}, or {', '.join(['--config', *ALIASES])}"
    )


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Every field as --section.field, plus the stable short aliases; each flag's help is its
    field's."""
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
        # a preset or models.register's
        base = registry.config(preset_name, PRESETS) if section == "model" else cls()
        values = model_raw if section == "model" else raw[section]
        options = _options(section)
        for name in values:
            if name not in options:
                raise UserError(
                    f"unknown option '{section}.{name}'; valid {section} options:"
                    f" {', '.join(options)}"
                )
        sections[section] = dataclasses.replace(
            base,
            **{
                options[n][0].name: coerce(f"{section}.{n}", options[n][1], v)
                for n, v in values.items()
            },
        )
    # unset: the model takes the prepared data's vocabulary where it needs more
    if "vocab_size" not in model_raw:
        from train.data.sources import dataset_vocab

        need = dataset_vocab(sections["data"].source)
        # padded to 128 so that mesh axes split it
        if need is not None and need > sections["model"].vocab_size:
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
