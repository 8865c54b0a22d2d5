"""Models besides the built-in decoder, by name: `models.register(name, init, apply, param_axes,
...)` once, then `--model NAME` (or `train.core.config.build({"model.preset": NAME})`) trains it on
any mesh, and `plan`, checkpoints and `sample` use it, with no other change.

A registered model keeps the decoder's contract (models/model.py), every function taking the
run's model config first:

    init(cfg, key) -> params            a nested dict of arrays
    apply(cfg, params, tokens_BT, positions_BT=None, cache=None, segment_ids_BT=None)
                                        -> (logits_BTV float32, cache)
    param_axes(cfg) -> the logical axis names of every parameter (the params' tree, tuples of
                       names from mesh/rules.py: "vocab", "embed", "mlp", "heads", ...); the
                       rules map them to mesh axes, so the model shards on every axis it names
    init_cache(cfg, batch, length, dtype=None) -> cache   optional: what `apply` decodes with;
                                        without it the model trains but `sample` refuses it in
                                        one line

Positions: on a mesh with a `context` axis the sequence is cut into chunks and reordered (the
zig-zag layout of models/context.py) before the model sees it, so token index t is no longer
position t and a model that masks by index would attend to the future. A model registered with
`takes_positions=True` promises to mask (and embed positions) by `positions_BT`, which it then
always receives (on any mesh: 0..T-1, restarting at each document when packed); any other model is
refused on a context axis in one line.

The config is a `ModelConfig` (its fields are the model's hyperparameters: vocab_size, d_model,
n_layers, d_ff, dtype, param_dtype, init_std, max_seq_len ... the model reads those it needs)
carrying the registered name in `arch`, so the functions in models/model.py, which every caller
uses, find the model from the config alone: this module is their one dispatch point.

`python -m train` finds models registered by installed packages through the `brigade.models`
entry-point group: each entry point names a module that calls `register` when imported.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable
from typing import Any, NamedTuple

from errors import UserError, expect, expect_callable
from models.config import ModelConfig, option

ENTRY_POINTS = "brigade.models"


@dataclasses.dataclass(frozen=True)
class RegisteredConfig(ModelConfig):
    """A ModelConfig whose model is the registered one named `arch`; flags and YAML override
    its fields as they do a preset's."""

    arch: str = option("", "the registered model this config belongs to (models.register)")


class Model(NamedTuple):
    """The functions of one model, with the built-in decoder's signatures."""

    init: Callable
    apply: Callable
    param_axes: Callable
    init_cache: Callable | None = None
    # (cfg, params, tokens, positions, segment_ids, pipeline) -> (logits, stats)
    forward: Callable | None = None
    takes_positions: bool = False  # masks by positions_BT, so a reordered sequence is safe


_MODELS: dict[str, tuple[Model, RegisteredConfig]] = {}
_loaded_entry_points = False


def register(
    name: str,
    init: Callable,
    apply: Callable,
    param_axes: Callable,
    *,
    config: ModelConfig | None = None,
    init_cache: Callable | None = None,
    forward: Callable | None = None,
    takes_positions: bool = False,
) -> RegisteredConfig:
    """Make `name` a model `--model` accepts -> its config (`config`'s fields, default the `tiny`
    preset's, with `arch=name`). `forward`: the training forward with MoE statistics, as
    models.model.forward returns them; default `apply` without a cache and no statistics.
    `takes_positions`: the model masks by the positions it is given, not by token index, and may
    then train with a `context` axis (see the module's docstring). Registering a name again
    replaces it (a notebook re-running its cell). Every argument is checked here: a wrong one
    would fail much later, inside jit or a training thread."""
    from models.presets import PRESETS

    expect("models.register", "name", name, str, "the model's name (what --model takes)")
    if not name.strip() or name != name.strip():
        raise UserError(
            f"models.register: name {name!r}: give a non-empty name, no spaces around it"
        )
    for arg, fn in (("init", init), ("apply", apply), ("param_axes", param_axes)):
        expect_callable("models.register", arg, fn)
    for arg, fn in (("init_cache=", init_cache), ("forward=", forward)):
        expect_callable("models.register", arg, fn, optional=True)
    expect("models.register", "config=", config, (ModelConfig, type(None)), "a ModelConfig")
    expect("models.register", "takes_positions=", takes_positions, bool, "True or False")

    if name in PRESETS:
        raise UserError(f"models.register: '{name}' is a built-in preset; choose another name")
    base = config if config is not None else PRESETS["tiny"]
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
    cfg = RegisteredConfig(**fields, arch=name).validate()
    _MODELS[name] = (
        Model(init, apply, param_axes, init_cache, forward, bool(takes_positions)),
        cfg,
    )
    return cfg


def names() -> list[str]:
    _load_entry_points()
    return sorted(_MODELS)


def config(name: str, presets: dict[str, ModelConfig]) -> ModelConfig:
    """The config `--model name` starts from: a built-in preset or a registered model's."""
    if name in presets:
        return presets[name]
    _load_entry_points()
    if name not in _MODELS:
        raise UserError(
            f"--model: unknown preset '{name}'; valid presets: {', '.join(presets)};"
            f" registered models: {', '.join(sorted(_MODELS)) or 'none (models.register adds one)'}"
        )
    return _MODELS[name][1]


def lookup(cfg: ModelConfig, builtin: Model) -> Model:
    """The model `cfg` belongs to: `builtin` (the decoder) unless it is a registered model's."""
    expect("models.model", "cfg", cfg, ModelConfig, "a ModelConfig (a Config's .model)")
    arch = getattr(cfg, "arch", "")  # only a RegisteredConfig has the field
    if not arch:
        return builtin
    _load_entry_points()
    if arch not in _MODELS:
        raise UserError(
            f"model '{arch}' is not registered in this process; registered models:"
            f" {', '.join(sorted(_MODELS)) or 'none'}"
            " (import the module that calls models.register)"
        )
    return _MODELS[arch][0]


def _registered(cfg: ModelConfig) -> Model | None:
    """The registered model `cfg` belongs to; None for the built-in decoder."""
    return lookup(cfg, None) if getattr(cfg, "arch", "") else None


def given_positions(cfg: ModelConfig) -> bool:
    """Whether the model is a registered one that takes positions: it gets them on every mesh."""
    impl = _registered(cfg)
    return impl is not None and impl.takes_positions


def check_sequence_order(cfg: ModelConfig, context: int) -> None:
    """One line for a registered model that masks by index on a mesh whose `context` axis (of
    size `context`) reorders the sequence (models/context.py): it would see future tokens."""
    impl = _registered(cfg)
    if context > 1 and impl is not None and not impl.takes_positions:
        raise UserError(
            f"model '{cfg.arch}' on a context axis of {context}: the sequence reaches each device"
            f" in zig-zag order, not token order, so a model masking by index would attend to"
            f" later tokens; register it with takes_positions=True (then mask by positions_BT), or"
            f" use a mesh without a context axis"
        )


def default_forward(
    model: Model,
    cfg: ModelConfig,
    params: dict,
    tokens_BT: Any,
    positions_BT: Any,
    segment_ids_BT: Any,
    pipeline: Any,
) -> tuple[Any, dict]:
    """The training forward of a model registered without one: `apply` with no cache, no MoE
    statistics. Pipeline stages need the model's own schedule, so a pipeline axis is refused."""
    import jax  # here, not at the top: `import models` stays free of JAX (data preparation workers)

    if pipeline is not None and jax.sharding.get_abstract_mesh().shape.get("pipeline", 1) > 1:
        raise UserError(
            f"model '{cfg.arch}' has no pipeline schedule"
            " (register it with forward= that takes one); use a mesh without a pipeline axis"
        )
    logits_BTV, _ = model.apply(cfg, params, tokens_BT, positions_BT, None, segment_ids_BT)
    return logits_BTV, {}


def _load_entry_points() -> None:
    """Import every installed `brigade.models` entry point once (each registers its models)."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        ep.load()
