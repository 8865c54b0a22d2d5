"""The Python API (README.md's "Python API" table, models.register, Trainer) checks its arguments:
one of the wrong type is one TypeError naming the entry point, the argument and what it takes,
raised before it could fail deep inside (jit, setup, a thread)."""

import jax
import pytest

import models
from checkpoint import hf
from checkpoint.__main__ import describe
from checkpoint.manager import open_checkpoint
from mesh.build import make_mesh
from mesh.spec import mesh_text
from models import model
from models.sample import generate
from plan.report import analyze
from train.core.config import build, from_args
from train.core.setup import setup
from train.run.loop import Trainer

CFG = build({"model.preset": "tiny"})


def _init(cfg, key):
    return {}


CASES = [
    (lambda: Trainer({"model.preset": "tiny"}), "Trainer: cfg must be a train.core.config.Config"),
    (lambda: Trainer("tiny"), "Trainer: cfg must be a train.core.config.Config"),
    (lambda: Trainer(CFG, mesh="data=8"), "Trainer: mesh= must be a jax Mesh"),
    (lambda: Trainer(CFG, on_log=5), "Trainer: on_log= must be a function (or None), got int 5"),
    (lambda: Trainer(CFG, data="runs/data"), "Trainer: data= must be an iterable of batch dicts"),
    (lambda: Trainer(CFG, loss="mse"), "Trainer: loss= must be a function (or None), got str"),
    (lambda: models.register("x", "init", None, 42), "models.register: init must be a function"),
    (lambda: models.register("x", _init, None, _init), "models.register: apply must be a function"),
    (lambda: models.register(5, _init, _init, _init), "models.register: name must be the model's"),
    (
        lambda: models.register("x", _init, _init, _init, config={"d_model": 8}),
        "models.register: config= must be a ModelConfig, got dict",
    ),
    (lambda: make_mesh(8), "make_mesh: spec must be --mesh text"),
    (lambda: make_mesh("data=8", devices=5), "make_mesh: devices must be a list of devices"),
    (lambda: mesh_text("data=8"), "mesh_text: sizes must be axis sizes"),
    (lambda: build("tiny"), "build: overrides must be a dict {'section.field': value}, got str"),
    (
        lambda: build({5: 1}),
        "build: an overrides key must be 'section.field' text, e.g. 'train.lr', got int 5",
    ),
    (lambda: build(None, 5), "build: yaml_path must be a YAML file's path (or a list), got int"),
    (lambda: from_args("--model tiny"), "from_args: argv must be a list of arguments"),
    (
        lambda: setup({"model.preset": "tiny"}, make_mesh()),
        "setup: cfg must be a train.core.config",
    ),
    (lambda: setup(CFG, "data=8"), "setup: mesh must be a jax Mesh"),
    (lambda: analyze(CFG), "analyze: s must be a RunSetup"),
    (lambda: model.init({"d_model": 8}, jax.random.key(0)), "models.model: cfg must be a Model"),
    (
        lambda: generate({"x": 1}, {}, [[1]], 0, max_new=4),
        "generate: cfg must be a ModelConfig",
    ),
    (
        lambda: generate(CFG.model, {}, [[1]], 0, max_new=4.5),
        "generate: max_new must be an integer, got float 4.5",
    ),
    (lambda: open_checkpoint(5), "open_checkpoint: path must be a directory's path, got int 5"),
    (lambda: describe(None), "open_checkpoint: path must be a directory's path, got NoneType"),
    (lambda: hf.from_pretrained(5), "from_pretrained: path must be an HF directory's path"),
    (lambda: hf.save_pretrained("x", "/tmp/y"), "save_pretrained: model must be a Model"),
    (lambda: hf.import_checkpoint(5, 6), "import_checkpoint: hf_dir must be a directory's path"),
    (lambda: hf.load_checkpoint(5), "open_checkpoint: path must be a directory's path"),
]


@pytest.mark.parametrize("call, words", CASES, ids=[w.split(" must")[0] for _, w in CASES])
def test_a_wrong_argument_type_is_one_clear_type_error(call, words):
    with pytest.raises(TypeError) as e:
        call()
    assert str(e.value).startswith(words) and "\n" not in str(e.value), e.value


def test_register_refuses_an_empty_name_and_generate_a_nan_temperature():
    from errors import UserError

    with pytest.raises(UserError, match="name '': give a non-empty name, no spaces"):
        models.register("", _init, _init, _init)
    with pytest.raises(UserError, match=r"^generate: temperature nan: must be a finite number"):
        generate(CFG.model, {}, [[1]], 0, max_new=4, temperature=float("nan"))


def test_the_right_types_still_pass():
    assert mesh_text(make_mesh("data=8").shape) == "data=8"
    assert build({"model.preset": "tiny"}, []).model == CFG.model
    assert from_args(["--model", "tiny"])[0].model == CFG.model
