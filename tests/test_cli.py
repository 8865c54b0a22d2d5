"""`python -m train` as a user runs it: --help, one-line errors (exit 2, no traceback) for every
kind of bad input, config precedence, and a real end-to-end run whose loss curve does not depend
on the mesh."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cpu_env import cpu_env

from errors import UserError
from train.core.config import build, from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(8)


def popen(args):
    return subprocess.Popen(
        [sys.executable, "-m", "train", *args],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def run(args, timeout=300):
    p = popen(args)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


# ------------------------------------------------------------------ --help

STABLE = [
    "--config",
    "--model",
    "--mesh",
    "--steps",
    "--batch-size",
    "--seq-len",
    "--micro-batches",
    "--lr",
    "--seed",
    "--data",
    "--run-dir",
    "--eval-every",
    "--log-every",
]


@pytest.fixture(scope="module")
def help_text():
    rc, out, err = run(["--help"], timeout=120)
    assert rc == 0, err
    return out


def test_help_lists_stable_flags(help_text):
    for flag in STABLE:
        assert f"{flag} " in help_text, flag


def test_help_lists_section_flags_with_defaults(help_text):
    lines = help_text.splitlines()

    def help_of(flag):  # the help text belongs to the flag's line or the next one
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(flag + " "))
        return " ".join(lines[i : i + 2])

    assert "(default: from the preset)" in help_of("--model.d_model")
    assert "(default: from the preset)" in help_of("--model.n_heads")
    assert "(default: 120)" in help_of("--train.steps")
    assert "--steps INT" in help_of("--train.steps")
    assert "(default: 16)" in help_of("--train.batch_size")
    assert "(default: 0.003) valid: >0" in help_of("--train.lr")
    assert "(default: 0.9) valid: [0, 1)" in help_of("--train.b1")  # each numeric option's range
    assert "(default: runs/latest)" in help_of("--logging.run_dir")
    assert "tiny, default, 125m, 1b, 7b, 70b" in help_text
    for flag in (
        "--model.remat",
        "--parallelism.rules",
        "--data.eval_fraction",
        "--logging.tensorboard",
    ):
        assert "(default:" in help_of(flag), flag


# ------------------------------------------------------------------ one-line errors

TINY = ["--model", "tiny"]
# (id, args, substrings the single stderr line must contain)
BAD = [
    (
        "unknown-axis",
        ["--mesh", "date=8"],
        ["'date'", "valid axes: pipeline, data, fsdp, context, expert, model"],
    ),
    ("product", ["--mesh", "data=2,model=2"], ["multiply to 4", "8 devices"]),
    ("two-minus-one", ["--mesh", "data=-1,fsdp=-1"], ["only one axis may be -1", "data, fsdp"]),
    ("mesh-size-not-int", ["--mesh", "data=x"], ["'data'", "integer", "'x'"]),
    (
        "mesh-dcn",
        ["--mesh", "data=8", "--mesh-dcn", "data=3"],
        ["--mesh-dcn", "data=3", "[1, 2, 4, 8]"],
    ),
    # tiny has n_kv_heads=2, which model=4 does not divide either; kv heads come first in the tree
    (
        "heads-6-on-model-4",
        TINY + ["--model.n_heads", "6", "--model.d_model", "96", "--mesh", "model=4,data=2"],
        ["model.n_kv_heads=2", "model=4", "[1, 2]"],
    ),
    (
        "n_heads-6-on-model-4",
        TINY
        + [
            "--model.n_heads",
            "6",
            "--model.n_kv_heads",
            "6",
            "--model.d_model",
            "96",
            "--mesh",
            "model=4,data=2",
            "--parallelism.rules",
            "kv_heads=none",
        ],
        ["model.n_heads=6", "model=4", "[1, 2, 3, 6]"],
    ),
    (
        "batch-10-on-8",
        TINY + ["--mesh", "data=4,fsdp=2", "--batch-size", "10"],
        ["--batch-size 10", "data=4", "fsdp=2", "multiple of 8"],
    ),
    (
        "micro-batches",
        TINY + ["--batch-size", "8", "--micro-batches", "3"],
        ["--batch-size 8", "--micro-batches 3", "[1, 2, 4, 8]"],
    ),
    ("unknown-preset", ["--model", "huge"], ["'huge'", "tiny, default, 125m, 1b, 7b, 70b"]),
    ("unknown-option", ["--train.nope", "1"], ["--train.nope"]),
    ("steps-not-int", ["--steps", "abc"], ["--steps", "'abc'", "int"]),
    ("bool", ["--logging.tensorboard", "maybe"], ["'maybe'", "true or false"]),
    ("d_model-heads", TINY + ["--model.d_model", "66"], ["d_model=66", "n_heads=4"]),
    ("remat", TINY + ["--model.remat", "some"], ["'some'", "none, full, dots"]),
    ("rules", ["--parallelism.rules", "embd=fsdp"], ["'embd'", "valid:", "embed"]),
    ("seq-too-long", TINY + ["--seq-len", "512"], ["--seq-len 512", "max_seq_len=256"]),
    ("bad-yaml", ["--config", "{bad_yaml}"], ["bad.yaml", "not valid YAML"]),
    (
        "unknown-section",
        ["--config", "{bad_section}"],
        ["'trian'", "valid: model, train, parallelism, data, logging"],
    ),
    (
        "yaml-unknown-option",
        ["--config", "{bad_option}"],
        ["'train.nope'", "valid train options", "batch_size"],
    ),
    ("missing-config", ["--config", "{missing}"], ["missing.yaml", "cannot read"]),
    ("plan-unknown-axis", ["plan", "--mesh", "date=8"], ["'date'", "valid axes"]),
]


# Through the entry point in-process (as `python -m train` calls it: no interpreter start-up per
# case); the cases in REAL_PROCESS also as real processes, so the process's own stderr and exit
# status are checked too.
REAL_PROCESS = ("unknown-axis", "bad-yaml")


def _in_process(args, capfd) -> tuple[int, str, str]:
    from train.cli.main import main

    capfd.readouterr()
    try:
        code = main(args)
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capfd.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def bad_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    (d / "bad.yaml").write_text("model: [1, 2\n")
    (d / "section.yaml").write_text("trian:\n  steps: 3\n")
    (d / "option.yaml").write_text("train:\n  nope: 3\n")
    return d, {
        "bad_yaml": d / "bad.yaml",
        "bad_section": d / "section.yaml",
        "bad_option": d / "option.yaml",
        "missing": d / "missing.yaml",
    }


def _bad_args(bad_paths, args):
    d, paths = bad_paths
    return [a.format(**paths) for a in args] + ["--run-dir", str(d / "never")]


def _assert_one_line(rc, out, err, needles, d):
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert out == ""
    assert not (d / "never").exists()  # no run got as far as writing anything


@pytest.mark.parametrize("name,args,needles", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line(bad_paths, capfd, name, args, needles):
    _assert_one_line(*_in_process(_bad_args(bad_paths, args), capfd), needles, bad_paths[0])


@pytest.mark.parametrize("name", REAL_PROCESS)
def test_bad_input_one_line_from_a_real_process(bad_paths, name):
    ((args, needles),) = [(a, n) for b, a, n in BAD if b == name]
    _assert_one_line(*run(_bad_args(bad_paths, args), timeout=180), needles, bad_paths[0])


def test_unknown_cli_option_lists_choices(bad_paths, capfd):
    _, _, err = _in_process(_bad_args(bad_paths, ["--train.nope", "1"]), capfd)
    assert "steps" in err and "batch_size" in err


# ------------------------------------------------------------------ config resolution (in-process)


def test_precedence_defaults_preset_yaml_cli(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  preset: tiny\n  d_ff: 128\ntrain:\n  steps: 7\n  lr: 0.01\n")
    cfg = build({"train.steps": 9}, str(y))
    assert cfg.model_preset == "tiny" and cfg.model.d_model == 64  # preset
    assert cfg.model.d_ff == 128 and cfg.train.lr == 0.01  # yaml over preset/defaults
    assert cfg.train.steps == 9  # cli over yaml
    assert cfg.train.batch_size == 16  # dataclass default
    cfg, _ = from_args(
        [
            "--config",
            str(y),
            "--steps",
            "3",
            "--model.n_layers",
            "1",
            "--mesh",
            "fsdp=8",
            "--logging.progress",
            "false",
        ]
    )
    assert (cfg.train.steps, cfg.model.n_layers, cfg.model.d_ff) == (3, 1, 128)
    assert cfg.parallelism.mesh == "fsdp=8" and cfg.logging.progress == "false"  # = none
    assert json.loads(json.dumps(cfg.to_dict()))["model"]["preset"] == "tiny"


def test_build_rejects_bad_values():
    with pytest.raises(UserError, match="train.steps: expected int, got 'x'"):
        build({"train.steps": "x"})
    with pytest.raises(
        UserError, match="unknown option 'model.depth'; valid model options: vocab_size"
    ):
        build({"model.depth": 3})
    with pytest.raises(UserError, match="--steps 0: must be an integer >= 1"):
        build({"train.steps": 0})
    with pytest.raises(UserError, match="--log-every 0: must be an integer >= 1"):
        build({"logging.log_every": 0})


@pytest.mark.parametrize("value", [2.5, True])
def test_build_rejects_non_integer_for_int_field(tmp_path, value):
    y = tmp_path / "c.yaml"
    y.write_text(f"train:\n  steps: {str(value).lower()}\n")
    with pytest.raises(UserError, match="train.steps"):
        build(None, str(y))


def test_build_rejects_unknown_section_key():
    with pytest.raises(UserError, match="trian"):
        build({"trian.steps": 5})


# ------------------------------------------------------------------ a real run, two meshes

E2E = [
    "--model",
    "tiny",
    "--steps",
    "6",
    "--log-every",
    "2",
    "--model.dtype",
    "float32",
    "--batch-size",
    "8",
    "--seq-len",
    "64",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "0",
    "--logging.progress",
    "false",
    "--logging.tensorboard",
    "false",
]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    procs = {
        mesh: (popen(E2E + ["--mesh", mesh, "--run-dir", str(d / mesh)]), d / mesh)
        for mesh in ("data=2,fsdp=2,model=2", "data=8")
    }  # concurrently: compiles are single-threaded
    out = {}
    for mesh, (p, run_dir) in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        out[mesh] = (p.returncode, stdout, stderr, run_dir)
    return out


def _curve(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_e2e_run(e2e):
    rc, stdout, stderr, run_dir = e2e["data=2,fsdp=2,model=2"]
    assert rc == 0, stderr[-3000:]
    recs = _curve(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 4, 6]  # step 1 logs the starting loss
    assert all(np.isfinite(r["loss"]) for r in recs)
    assert "mesh data=2,fsdp=2,model=2 (8 devices)" in stdout and "done: 6 steps" in stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_loss"] == recs[-1]["loss"]
    cfg = json.loads((run_dir / "config.json").read_text())
    assert (
        cfg["parallelism"]["mesh"] == "data=2,fsdp=2,model=2" and cfg["model"]["dtype"] == "float32"
    )


@pytest.mark.slow
def test_e2e_same_curve_on_data8(e2e):
    a, b = e2e["data=2,fsdp=2,model=2"], e2e["data=8"]
    assert a[0] == 0 and b[0] == 0, (a[2][-2000:], b[2][-2000:])
    ca, cb = _curve(a[3]), _curve(b[3])
    assert [r["step"] for r in ca] == [r["step"] for r in cb] == [1, 2, 4, 6]
    np.testing.assert_allclose([r["loss"] for r in ca], [r["loss"] for r in cb], rtol=1e-5)
    np.testing.assert_allclose([r["lr"] for r in ca], [r["lr"] for r in cb], rtol=1e-6)
