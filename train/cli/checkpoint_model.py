"""A checkpoint's model, opened for `python -m train eval`, `python -m train sample` and the
harness: the checkpoint resolved as --resume PATH resolves it (a run, a checkpoint or one step's
directory, an HF import), the Config its metadata records with the flags on top, the setup on
--mesh, the parameters read into its shardings, and the tokenizer the checkpoint records."""

from __future__ import annotations

import dataclasses

import jax

from checkpoint.hf import config_from_meta, load_checkpoint
from checkpoint.layout import lora_base
from checkpoint.manager import Checkpointer, open_checkpoint
from errors import ArgParser, UserError
from mesh.build import start_mesh
from models.config import ModelConfig
from train.core.config import Config, build, make_parser
from train.core.setup import RunSetup, abstract_state, setup
from train.data import tokenizers
from train.run import checkpoint_match


@dataclasses.dataclass
class Opened:
    """A checkpoint's step, its metadata and the run config to use it with."""

    cfg: Config
    src: Checkpointer
    step: int
    meta: dict

    def setup(self) -> RunSetup:
        """The run's setup on --mesh: the rules, the batch and parameter shardings, the eval step's
        loss (nothing allocated)."""
        return setup(self.cfg, start_mesh(self.cfg.parallelism))

    def params(self, s: RunSetup):
        """The parameters alone (no optimizer state), read straight into `s`'s shardings. A LoRA
        run's step holds adapters only: they are merged into the base its metadata points at (on
        the host, as `hf export` merges), which is the model that run trained."""
        if lora_base(self.meta) is None:
            return self.src.restore_params(self.step, abstract_state(s).params)
        merged = load_checkpoint(self.src.step_dir(self.step)).params
        return jax.device_put(merged, s.state_shardings.params)


def command_parser(prog: str, description: str) -> ArgParser:
    """Every run flag (train/core/config.py) plus the checkpoint to use."""
    parser = make_parser(prog, description)
    parser.add_argument(
        "ckpt",
        metavar="CKPT",
        help="a run directory, a checkpoint directory, one step's directory"
        " or an HF import (as --resume PATH)",
    )
    return parser


def open_model(ckpt: str, ns, carried: tuple[str, ...] = ()) -> Opened:
    """The checkpoint at `ckpt` and the Config to run its model with: the model section of its
    metadata, then the `carried` settings of its run, then the flags in `ns` (any
    --section.field)."""
    src, step = open_checkpoint(ckpt)
    meta = src.meta(step)
    # every field type-checked
    model_cfg = config_from_meta(meta, f"checkpoint '{src.step_dir(step)}'")
    saved = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    run = {
        key: saved[section][name]
        for key in carried
        for section, _, name in [key.partition(".")]
        if isinstance(saved.get(section), dict) and name in saved[section]
    }
    preset = meta["model"].get("preset")
    model = {
        "model.preset": preset if isinstance(preset, str) else "default",
        **{f"model.{f.name}": getattr(model_cfg, f.name) for f in dataclasses.fields(ModelConfig)},
    }
    flags = {k: v for k, v in vars(ns).items() if "." in k}
    return Opened(build({**run, **model, **flags}, getattr(ns, "config", None)), src, step, meta)


def checkpoint_tokenizer(
    spec: str,
    meta: dict,
    who: str = "sample",
    how: str = "--tokenizer SPEC",
    required: bool = False,
) -> tokenizers.Tokenizer:
    """SPEC, else the tokenizer the checkpoint records, else the byte tokenizer (`required`: one
    line instead). `who` and `how` name the command and its option in the messages."""
    if spec:
        return tokenizers.load(str(spec))
    record = checkpoint_match.saved_tokenizer(meta)
    if record is None and required:
        raise UserError(
            f"{who}: the checkpoint records no tokenizer (an HF import without tokenizer.json, or"
            f" an older run); give one with {how} (byte, an HF model directory, KIND:PATH)"
        )
    if record is None or record["kind"] == "byte":
        return tokenizers.ByteTokenizer()
    try:
        return tokenizers.load(f"{record['kind']}:{record.get('path', '')}")
    except UserError as e:
        raise UserError(
            f"{who}: the checkpoint's tokenizer {record['id']} does not load ({e}); give one with"
            f" {how}"
        ) from None
