"""`Trainer(...)`'s arguments checked before anything is built: a wrong type is one TypeError naming
the argument and what it takes (`Trainer({"model.preset": "tiny"})` failed with an AttributeError
on `.parallelism` deep inside setup). A dict is not turned into a Config here: `build()` is the one
place a Config is made (with its YAML files, presets and validation), and the message says so."""

from __future__ import annotations

from collections.abc import Iterable

from jax.sharding import Mesh

from errors import expect, expect_callable


def check(cfg, mesh, devices, on_log, data, eval_data, loss) -> None:
    """TypeError for the first argument of the wrong type (the optimizer and schedule are
    train/core/optim.py's to check: they need optax)."""
    from train.core.config import Config

    if isinstance(cfg, dict):
        raise TypeError(
            "Trainer: cfg must be a train.core.config.Config, got a dict; make one with"
            " train.core.config.build(overrides), e.g. Trainer(build({'model.preset': 'tiny'}))"
        )
    expect(
        "Trainer", "cfg", cfg, Config, "a train.core.config.Config (from train.core.config.build)"
    )
    expect(
        "Trainer", "mesh=", mesh, (Mesh, type(None)), "a jax Mesh (mesh.build.make_mesh) or None"
    )
    expect("Trainer", "devices=", devices, (list, tuple, type(None)), "a list of devices or None")
    expect_callable("Trainer", "on_log=", on_log, optional=True)
    expect_callable("Trainer", "loss=", loss, optional=True)
    for name, value in (("data=", data), ("eval_data=", eval_data)):
        expect("Trainer", name, value, (Iterable, type(None)), "an iterable of batch dicts or None")
        if isinstance(value, (str, bytes, dict)):
            raise TypeError(
                f"Trainer: {name} must be an iterable of batch dicts (a list, a generator, a"
                f" loader), got {type(value).__name__}; a dataset path is --data (data.source)"
            )
