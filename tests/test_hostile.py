"""Brigade as a hostile user meets it: bad or damaged input to every command (train, YAML, the run
directory, data, prepare, checkpoints, HuggingFace files, report). For each: exit status 2,
exactly one line on stderr naming the culprit, no traceback, and every file that existed before
still there, unchanged.

The commands run in-process through their entry points (`main(argv)`, as `python -m` calls them),
so the table costs no interpreter start-ups; the real-process versions of the cases that need one
(concurrent runs, --overwrite, a full disk, damaged metadata) are in test_rundir.py,
test_data_trust.py and test_checkpoint_trust.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from data_files import file_hashes as listing
from data_files import jsonl_file, tiktoken_file
from test_data_trust import _edit_index, _set

TINY = [
    "--model",
    "tiny",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "0",
    "--logging.progress",
    "false",
    "--logging.tensorboard",
    "false",
    "--steps",
    "2",
]


# ------------------------------------------------------------------ the inputs every case damages


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """corpus/ (text), ds/ (a prepared dataset), run/ (a finished run with checkpoints at steps 1,
    2) and, where transformers is installed, hf/ (a tiny Llama) and hf-ckpt/ (its import)."""
    from train.core.config import build
    from train.data import prepare
    from train.run.loop import Trainer

    root = tmp_path_factory.mktemp("pristine")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"{i}.txt").write_text(f"document {i} " * 200)
    prepare.prepare([str(root / "corpus")], str(root / "ds"), progress=False)
    Trainer(
        build(
            {
                "model.preset": "tiny",
                "train.batch_size": 8,
                "train.seq_len": 32,
                "train.steps": 2,
                "train.eval_every": 0,
                "train.sample_tokens": 0,
                "checkpoint.every": 1,
                "logging.progress": False,
                "logging.tensorboard": False,
                "logging.run_dir": str(root / "run"),
            }
        )
    ).fit()
    try:
        from test_hf import CASES, make_hf

        from checkpoint.__main__ import main as checkpoint_main

        make_hf(root / "hf", **CASES["gqa"])
        assert (
            checkpoint_main(["hf", "import", str(root / "hf"), "--out", str(root / "hf-ckpt")]) == 0
        )
    except ImportError:  # transformers/torch are dev extras
        pass
    return root


def edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def step_dir(ws: Path, step: int = 2) -> Path:
    return ws / "run" / "checkpoints" / str(step)


def data_file(ws: Path) -> Path:
    d = step_dir(ws) / "state" / "d"
    return d / max(os.listdir(d), key=lambda n: (d / n).stat().st_size)


# ------------------------------------------------------------------ the cases
# (id, command, setup(ws) -> argv, words the error line must hold). `ws` is a copy of `pristine`.


def train(*args):
    return lambda ws: [*TINY, "--run-dir", str(ws / "new-run"), *args]


def yaml(text: str):
    def setup(ws):
        (ws / "c.yaml").write_text(text)
        return [*TINY, "--run-dir", str(ws / "new-run"), "--config", str(ws / "c.yaml")]

    return setup


def with_files(files: dict[str, str], argv):
    def setup(ws):
        for name, text in files.items():
            (ws / name).parent.mkdir(parents=True, exist_ok=True)
            (ws / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        return argv(ws)

    return setup


def dataset(edit, *args):
    def setup(ws):
        _edit_index(str(ws / "ds"), edit)
        return [*TINY, "--run-dir", str(ws / "new-run"), "--data", str(ws / "ds"), *args]

    return setup


def meta(edit, command="inspect"):
    def setup(ws):
        edit_json(step_dir(ws) / "meta" / "metadata", edit)
        if command == "inspect":
            return ["inspect", str(step_dir(ws))]
        return [
            *TINY,
            "--run-dir",
            str(ws / "new-run"),
            "--steps",
            "4",
            "--resume",
            str(step_dir(ws)),
        ]

    return setup


def truncated_data(argv):
    def setup(ws):
        f = data_file(ws)
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
        return argv(ws)

    return setup


def hf_config(edit):
    def setup(ws):
        edit_json(ws / "hf" / "config.json", edit)
        return ["import", str(ws / "hf"), "--out", str(ws / "imported")]

    return setup


def hf_bytes(name: str, data: bytes | None = None, header: bytes | None = None):
    def setup(ws):
        path = ws / "hf" / name
        if header is not None:  # a safetensors file: 8-byte length, then the header
            raw = path.read_bytes()
            path.write_bytes(header + raw[8:])
        else:
            path.write_bytes(data)
        return ["import", str(ws / "hf"), "--out", str(ws / "imported")]

    return setup


def hf_index(index):
    def setup(ws):
        (ws / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
        return ["import", str(ws / "hf"), "--out", str(ws / "imported")]

    return setup


def export_edited(edit):
    def setup(ws):
        step = ws / "hf-ckpt"
        steps = [p for p in step.rglob("meta") if p.is_dir()]
        edit_json(steps[0] / "metadata", edit)
        return ["export", str(step), "--out", str(ws / "exported")]

    return setup


def prepare(out, inputs=("corpus",), overwrite=True, cwd=False):
    def setup(ws):
        if cwd:
            os.chdir(ws / out)
        return [
            *(str(ws / i) for i in inputs),
            "--out",
            "." if cwd else str(ws / out),
            "--no-progress",
            "--workers",
            "1",
            *(["--overwrite"] if overwrite else []),
        ]

    return setup


def _broken_tiktoken(ws) -> str:
    """A rank file that loads but lacks bytes 0xb8-0xbf (tiktoken panics in Rust on them)."""
    path = tiktoken_file(ws)
    lines = Path(path).read_text().splitlines()
    Path(path).write_text("\n".join(lines[:0xB8] + lines[0xC0:]) + "\n")
    return str(path)


def model_edit(key, value):
    return lambda m: {
        **m,
        "model": {**m["model"], key: value},
        "config": {**m["config"], "model": {**m["config"]["model"], key: value}},
    }


CASES = [
    # -- command line: ranges, types, choices, divisibility
    ("lr-nan", "train", train("--lr", "nan"), ["--lr nan", "finite number > 0"]),
    ("lr-negative", "train", train("--lr=-0.01"), ["--lr -0.01", "> 0"]),
    (
        "warmup-negative",
        "train",
        train("--train.warmup_steps=-5"),
        ["--train.warmup_steps -5", ">= 0"],
    ),
    ("b1-above-1", "train", train("--train.b1", "1.5"), ["--train.b1 1.5", "[0, 1)"]),
    ("grad-clip-negative", "train", train("--train.grad_clip=-1"), ["--train.grad_clip -1"]),
    ("prefetch-negative", "train", train("--data.prefetch=-1"), ["--data.prefetch -1"]),
    (
        "eval-fraction-1.5",
        "train",
        train("--data.eval_fraction", "1.5"),
        ["--data.eval_fraction 1.5"],
    ),
    (
        "eval-batches-0",
        "train",
        train("--eval-every", "5", "--train.eval_batches", "0"),
        ["eval_batches"],
    ),
    ("steps-not-int", "train", train("--steps", "2.5"), ["train.steps", "2.5"]),
    ("unknown-option", "train", train("--checkpoint.asyn", "true"), ["--checkpoint.asyn", "async"]),
    ("unknown-preset", "train", train("--model", "gpt9"), ["gpt9"]),
    ("mesh-unknown-axis", "train", train("--mesh", "tensor=8"), ["tensor"]),
    (
        "mesh-wrong-size",
        "train",
        train("--mesh", "data=3"),
        ["--mesh", "multiply to 3", "8 devices"],
    ),
    ("batch-not-divisible", "train", train("--batch-size", "12"), ["--batch-size 12", "data=8"]),
    ("seq-too-long", "train", train("--seq-len", "100000"), ["--seq-len 100000", "max_seq_len"]),
    ("bad-compression", "train", train("--comm.compression", "zip"), ["zip", "int8"]),
    ("bad-schedule", "train", train("--pipeline.schedule", "nope"), ["nope", "gpipe"]),
    ("bad-param-dtype", "train", train("--model.param_dtype", "int8"), ["param_dtype", "int8"]),
    ("bad-profile-window", "train", train("--profile.steps", "5:2"), ["--profile.steps '5:2'"]),
    ("resume-missing", "train", train("--resume", "/nonexistent/run"), ["/nonexistent/run"]),
    # -- YAML
    ("yaml-list", "train", yaml("- 1\n- 2\n"), ["must be a mapping"]),
    ("yaml-syntax", "train", yaml("train: {lr: [\n"), ["not valid YAML"]),
    ("yaml-unknown-section", "train", yaml("trainer: {lr: 1}\n"), ["unknown section 'trainer'"]),
    ("yaml-nan", "train", yaml("train: {lr: .nan}\n"), ["lr", "finite number > 0"]),
    (
        "yaml-bool-for-int",
        "train",
        yaml("train: {warmup_steps: true}\n"),
        ["train.warmup_steps", "expected int"],
    ),
    (
        "yaml-section-not-mapping",
        "train",
        yaml("train: 5\n"),
        ["section 'train' must be a mapping"],
    ),
    (
        "yaml-section-twice",
        "train",
        yaml("train: {lr: 0.5}\ntrain: {steps: 3}\n"),
        ["key 'train'", "lines 1 and 2"],
    ),
    (
        "yaml-alias-bomb",
        "train",
        yaml(
            "a: &a [x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
            )
            + "train: {prompt: *i}\n"
        ),
        ["aliases expand to", "100000"],
    ),
    (
        "yaml-binary",
        "train",
        with_files(
            {"c.yaml": b"\x89PNG\r\n\x1a\n\xff" * 8},
            lambda ws: [*TINY, "--run-dir", str(ws / "new-run"), "--config", str(ws / "c.yaml")],
        ),
        ["c.yaml", "not UTF-8"],
    ),
    (
        "yaml-missing-file",
        "train",
        lambda ws: [*TINY, "--config", str(ws / "none.yaml")],
        ["none.yaml"],
    ),
    # -- the run directory
    (
        "run-dir-of-a-project",
        "train",
        with_files(
            {"proj/config.json": '{"lr": 1}', "proj/main.py": "x"},
            lambda ws: [*TINY, "--run-dir", str(ws / "proj")],
        ),
        ["not a Brigade run directory"],
    ),
    (
        "run-dir-is-a-file",
        "train",
        with_files({"afile": "x"}, lambda ws: [*TINY, "--run-dir", str(ws / "afile")]),
        ["not a directory"],
    ),
    (
        "run-dir-is-home-like",
        "train",
        with_files({"home/.bashrc": "x"}, lambda ws: [*TINY, "--run-dir", str(ws / "home")]),
        ["not a Brigade run directory", ".bashrc"],
    ),
    # -- data
    (
        "data-binary-file",
        "train",
        with_files(
            {"some.bin": b"PK\x03\x04\xff\xfe" * 64},
            lambda ws: [*TINY, "--run-dir", str(ws / "new-run"), "--data", str(ws / "some.bin")],
        ),
        ["some.bin", "UTF-8"],
    ),
    ("data-missing", "train", train("--data", "/nonexistent/ds"), ["/nonexistent/ds"]),
    ("index-missing-key", "train", dataset(lambda ix: ix.pop("dtype")), ["index.json", "'dtype'"]),
    ("index-wrong-type", "train", dataset(_set("vocab_size", "259")), ["index.json", "vocab_size"]),
    (
        "index-absolute-shard",
        "train",
        dataset(_set("shards", 0, "tokens", "/etc/passwd")),
        ["/etc/passwd"],
    ),
    (
        "index-dotdot-shard",
        "train",
        dataset(_set("shards", 0, "offsets", "../../x.npy")),
        ["../../x.npy"],
    ),
    (
        "index-max-token-lies",
        "train",
        dataset(_set("shards", 0, "max_token", 5000)),
        ["max_token 5000"],
    ),
    (
        "tokens-beyond-vocab",
        "train",
        dataset(lambda ix: None, "--model.vocab_size", "128"),
        ["128", "vocab"],
    ),
    (
        "mixture-weight-tiny",
        "train",
        lambda ws: [*TINY, "--run-dir", str(ws / "r"), "--data", f"{ws / 'ds'}:1e-20,default:1"],
        ["1e-20"],
    ),
    (
        "mixture-weight-inf",
        "train",
        lambda ws: [*TINY, "--run-dir", str(ws / "r"), "--data", f"{ws / 'ds'}:inf,default:1"],
        ["inf"],
    ),
    # -- prepare
    (
        "prepare-out-cwd",
        "prepare",
        prepare("corpus", inputs=("ds",), cwd=True),
        ["current directory"],
    ),
    ("prepare-out-is-input", "prepare", prepare("corpus"), ["is or contains the input"]),
    (
        "prepare-out-holds-input",
        "prepare",
        prepare(".", inputs=("corpus/0.txt",)),
        ["is or contains"],
    ),
    (
        "prepare-out-not-dataset",
        "prepare",
        with_files({"mine/notes.txt": "x"}, prepare("mine")),
        ["mine"],
    ),
    ("prepare-out-exists", "prepare", prepare("ds", overwrite=False), ["already exists"]),
    (
        "prepare-tiktoken-panic",
        "prepare",
        lambda ws: [
            jsonl_file(ws / "t.jsonl", ["\u00ff"]),
            "--tokenizer",
            _broken_tiktoken(ws),
            "--out",
            str(ws / "o"),
        ],
        ["256 single bytes"],
    ),
    (
        "prepare-input-missing",
        "prepare",
        lambda ws: [str(ws / "nope.txt"), "--out", str(ws / "o")],
        ["nope.txt"],
    ),
    # -- checkpoints
    ("meta-is-a-list", "checkpoint", meta(lambda m: []), ["meta/metadata"]),
    (
        "meta-step-wrong-type",
        "checkpoint",
        meta(lambda m: {**m, "step": "two"}),
        ["meta/metadata", "step"],
    ),
    (
        "meta-mesh-wrong-type",
        "checkpoint",
        meta(lambda m: {**m, "mesh": [8]}),
        ["meta/metadata", "mesh"],
    ),
    ("resume-meta-is-a-list", "train", meta(lambda m: [], command="train"), ["meta/metadata"]),
    (
        "truncated-data-inspect",
        "checkpoint",
        truncated_data(lambda ws: ["inspect", str(step_dir(ws)), "--json"]),
        ["state/d/"],
    ),
    (
        "truncated-data-resume",
        "train",
        truncated_data(
            lambda ws: [
                *TINY,
                "--run-dir",
                str(ws / "new-run"),
                "--steps",
                "4",
                "--resume",
                str(step_dir(ws)),
            ]
        ),
        ["state/d/"],
    ),
    ("inspect-missing", "checkpoint", lambda ws: ["inspect", str(ws / "nope")], ["nope"]),
    (
        "init-from-empty",
        "train",
        with_files(
            {"empty/x.txt": "x"},
            lambda ws: [*TINY, "--run-dir", str(ws / "new-run"), "--init-from", str(ws / "empty")],
        ),
        ["empty"],
    ),
    # -- HuggingFace files
    ("hf-config-list", "hf", hf_config(lambda c: [c]), ["config.json"]),
    (
        "hf-config-string-number",
        "hf",
        hf_config(lambda c: {**c, "hidden_size": "64"}),
        ["hidden_size"],
    ),
    (
        "hf-header-absurd",
        "hf",
        hf_bytes("model.safetensors", header=(2**60).to_bytes(8, "little")),
        ["model.safetensors"],
    ),
    (
        "hf-header-not-json",
        "hf",
        hf_bytes("model.safetensors", data=(10).to_bytes(8, "little") + b"{not json!"),
        ["model.safetensors"],
    ),
    ("hf-index-list", "hf", hf_index([1, 2]), ["model.safetensors.index.json"]),
    (
        "hf-weight-map-absolute",
        "hf",
        hf_index({"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}}),
        ["/etc/passwd"],
    ),
    (
        "hf-weight-map-dotdot",
        "hf",
        hf_index({"weight_map": {"model.embed_tokens.weight": "../x.safetensors"}}),
        ["../x.safetensors"],
    ),
    ("hf-export-lying-meta", "hf", export_edited(model_edit("n_heads", 2)), ["n_heads"]),
    # -- report
    (
        "report-not-a-dir",
        "train",
        lambda ws: ["report", str(ws / "corpus" / "0.txt")],
        ["not a directory"],
    ),
    ("report-no-metrics", "train", lambda ws: ["report", str(ws / "corpus")], ["metrics.jsonl"]),
]


def run(command: str, argv: list[str]) -> int:
    if command == "train":
        from train.cli.main import main
    elif command == "prepare":
        from train.data.prepare import main
    elif command == "checkpoint":
        from checkpoint.__main__ import main
    else:  # hf: `python -m checkpoint hf ...`
        from checkpoint.__main__ import main

        argv = ["hf", *argv]
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return e.code


def test_the_table_is_wide():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[1] for c in CASES} == {"train", "prepare", "checkpoint", "hf"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup, command, words", [(c[2], c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_input_is_one_line_and_changes_nothing(
    tmp_path, pristine, capfd, monkeypatch, setup, command, words
):
    if command == "hf" and not (pristine / "hf").exists():
        pytest.skip("transformers not installed")
    ws = tmp_path / "ws"
    shutil.copytree(pristine, ws, symlinks=True)
    monkeypatch.chdir(ws)
    monkeypatch.setenv("HOME", str(ws / "home"))
    argv = setup(ws)
    before = listing(ws)
    capfd.readouterr()
    code = run(command, argv)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err and "panicked" not in err, (code, err[-3000:])
    assert len(lines) == 1, err[-3000:]
    assert all(w in lines[0] for w in words), (words, lines[0])
    after = listing(ws)
    assert {k: after.get(k) for k in before} == before, "files deleted or changed"
