"""--data.eval_source (train/data/evalsets.py, train/run/loop.py): a run's periodic eval on named
prepared datasets. One tiny float32 run with two sets (one with a loss mask), once; its logged
eval/<NAME>/loss is `python -m train eval` on the checkpoint of that step, the same run without
the sets trains identically, and bad specs are one line each."""

import glob
import json
import math

import jax
import numpy as np
import pytest
from data_files import TEXTS, tiktoken_file
from test_train import _tb_scalars

from checkpoint.manager import open_checkpoint
from train.cli import evaluate
from train.cli.main import main as train_main
from train.core.config import build
from train.data import prepare
from train.data.evalsets import open_eval_source
from train.run.loop import Trainer
from train.run.metrics import eval_text
from train.run.run import eval_record
from train.run.sinks import step_line

STEPS, EVAL_EVERY, EVAL_BATCHES = 4, 2, 2


def _prepared(
    root, name: str, records: list[dict], tokenizer: str = "byte", input_format: str = "text"
) -> str:
    src = root / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare.prepare(
        [str(src)],
        str(root / name),
        tokenizer,
        input_format=input_format,
        workers=1,
        progress=False,
    )
    return str(root / name)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """The training set, two eval sets (text; prompt/completion, whose prompts weigh 0), a set too
    small for one eval window and one prepared with another tokenizer."""
    root = tmp_path_factory.mktemp("evalsource")
    return {
        "root": root,
        "train": _prepared(root, "train", [{"text": t} for t in TEXTS]),
        "prose": _prepared(
            root, "prose", [{"text": " ".join(reversed(t.split()))} for t in TEXTS[:120]]
        ),
        "qa": _prepared(
            root,
            "qa",
            [
                {"prompt": f"question {i}: {t[:20]}?", "completion": t[20:]}
                for i, t in enumerate(TEXTS[:120])
            ],
            input_format="prompt_completion",
        ),
        "small": _prepared(root, "small", [{"text": t} for t in TEXTS[:3]]),
        "bpe": _prepared(root, "bpe", [{"text": t} for t in TEXTS[:60]], tiktoken_file(root)),
    }


def _over(sets) -> dict:
    return {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "data.source": sets["train"],
        "data.eval_fraction": 0.25,
        "train.steps": STEPS,
        "train.batch_size": 8,
        "train.seq_len": 32,
        "train.eval_every": EVAL_EVERY,
        "train.eval_batches": EVAL_BATCHES,
        "train.sample_tokens": 0,
        "logging.log_every": 1,
        "logging.progress": "none",
        "logging.tensorboard": False,
        "checkpoint.async": False,
        "checkpoint.every": EVAL_EVERY,
        "checkpoint.keep": 0,
    }


@pytest.fixture(scope="module")
def runs(sets):
    """A run evaluating two sets (with TensorBoard events) and the same run without them."""
    out = {}
    for name, source in (("with", f"qa={sets['qa']},{sets['prose']}"), ("without", "")):
        run_dir = sets["root"] / name
        trainer = Trainer(
            build(
                {
                    **_over(sets),
                    "data.eval_source": source,
                    "logging.run_dir": str(run_dir),
                    "logging.tensorboard": bool(source),
                }
            )
        )
        summary = trainer.fit()
        out[name] = {
            "trainer": trainer,
            "summary": summary,
            "dir": str(run_dir),
            "records": _records(run_dir / "metrics.jsonl"),
        }
    return out


def _evals(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if any(k.startswith("eval") for k in r)}


@pytest.mark.slow
def test_logged_set_loss_is_eval_of_that_steps_checkpoint(sets, runs, capsys):
    run = runs["with"]
    evals = _evals(run["records"])
    assert sorted(evals) == [2, 4]
    for rec in evals.values():
        assert set(rec) == {
            "step",
            "eval_loss",
            "eval_ppl",
            "eval/qa/loss",
            "eval/qa/perplexity",
            "eval/prose/loss",
            "eval/prose/perplexity",
        }
        assert rec["eval/qa/perplexity"] == pytest.approx(math.exp(rec["eval/qa/loss"]))
    # two sets, two figures
    assert abs(evals[2]["eval/qa/loss"] - evals[2]["eval/prose/loss"]) > 1e-3

    src, _ = open_checkpoint(run["dir"])
    assert (
        evaluate.main(
            [
                src.step_dir(2),
                "--data",
                f"qa={sets['qa']}",
                "--data",
                f"prose={sets['prose']}",
                "--eval-batches",
                str(EVAL_BATCHES),
                "--json",
            ]
        )
        == 0
    )
    offline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert offline["step"] == 2 and offline["split"] == "eval"
    for name in ("qa", "prose"):
        assert offline["sets"][name]["batches"] == EVAL_BATCHES
        assert evals[2][f"eval/{name}/loss"] == pytest.approx(
            offline["sets"][name]["loss"], rel=1e-6, abs=1e-6
        )

    # the last eval through the trainer's evaluator on the final parameters; the prompts weigh 0 as
    # in eval
    trainer = run["trainer"]
    opened = {
        s.name: s
        for s in open_eval_source(
            trainer.cfg.data,
            batch_size=8,
            seq_len=32,
            seed=0,
            eval_batches=EVAL_BATCHES,
            vocab_size=trainer.setup.model_cfg.vocab_size,
            sharding=trainer.setup.batch_sharding,
            check_tokenizer=lambda r, w: None,
        )
    }
    weights = np.concatenate(
        [np.asarray(jax.device_get(b["weights"])) for b in opened["qa"].batches]
    )
    assert 0 < weights.mean() < 1 and set(np.unique(weights)) <= {0.0, 1.0}
    for name in ("qa", "prose"):
        want = trainer.evaluator.loss(trainer.state.params, opened[name].batches)
        assert evals[4][f"eval/{name}/loss"] == pytest.approx(want, rel=1e-6, abs=1e-6)
        assert run["summary"][f"eval/{name}/loss"] == evals[4][f"eval/{name}/loss"]
    saved = json.load(open(f"{run['dir']}/summary.json"))
    assert (
        saved["eval/qa/loss"] == run["summary"]["eval/qa/loss"]
        and saved["eval_loss"] == evals[4]["eval_loss"]
    )
    (events,) = glob.glob(f"{run['dir']}/tb/events.out.tfevents.*")
    tags = _tb_scalars(events)
    for key in ("eval/qa/loss", "eval/prose/perplexity"):
        assert [s for s, _ in tags[key]] == [2, 4]
        np.testing.assert_allclose(
            [v for _, v in tags[key]], [evals[2][key], evals[4][key]], rtol=1e-6
        )


def test_the_eval_lines_name_each_set():
    rec = eval_record(6, 2.0, {"qa": 1.5, "prose": 3.0})
    assert rec == {
        "step": 6,
        "eval_loss": 2.0,
        "eval_ppl": math.exp(2.0),
        "eval/qa/loss": 1.5,
        "eval/qa/perplexity": math.exp(1.5),
        "eval/prose/loss": 3.0,
        "eval/prose/perplexity": math.exp(3.0),
    }
    assert (
        step_line(rec) == "step 6 | eval loss 2.000 | ppl 7.39 | eval qa 1.500 | eval prose 3.000"
    )
    # a training data that holds nothing out (a user's iterable): the sets alone
    assert step_line(eval_record(6, None, {"qa": 1.5})) == "step 6 | eval qa 1.500"
    assert (
        eval_text({"eval_loss": 2.0, "eval/qa/loss": 1.5, "eval/qa/perplexity": 4.5})
        == ", eval loss 2.000 (qa 1.500)"
    )
    assert eval_text({"eval_loss": None, "eval/qa/loss": 1.5}) == ", eval loss (qa 1.500)"
    assert eval_text({"eval_loss": None}) == ""


@pytest.mark.slow
def test_without_eval_source_the_run_is_unchanged(runs):
    with_sets, without = runs["with"], runs["without"]
    assert {k for r in _evals(without["records"]).values() for k in r} == {
        "step",
        "eval_loss",
        "eval_ppl",
    }
    assert not [k for k in without["summary"] if k.startswith("eval/")]

    # the same steps, losses, gradient norms, held-out eval losses and final parameters
    def train(run):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in run["records"] if "loss" in r]

    def held_out(run):
        return [(s, r["eval_loss"]) for s, r in _evals(run["records"]).items()]

    assert train(with_sets) == train(without) and len(train(without)) == STEPS
    assert held_out(with_sets) == held_out(without)
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(with_sets["trainer"].state.params),
        jax.device_get(without["trainer"].state.params),
    )


@pytest.mark.parametrize(
    "spec, words",
    [
        ("x={root}", ["--data.eval_source x=", "is not a prepared dataset (no index.json)"]),
        ("a={qa},a={prose}", ["--data.eval_source", "'a' is given twice"]),
        ("qa={qa},", ["--data.eval_source", "an empty entry"]),
        ("my set={qa}", ["--data.eval_source", "'my set'", "letters, digits"]),
        (
            "bpe={bpe}",
            [
                "--data.eval_source bpe=",
                "the training data's tokenizer is byte but the data's is tiktoken:",
                "--data.allow_tokenizer_mismatch true",
            ],
        ),
        (
            "small={small}",
            ["--data.eval_source small=", "its eval split holds", "not one window of --seq-len 32"],
        ),
    ],
)
def test_bad_spec_is_one_line(sets, capsys, spec, words):
    paths = {k: str(v) for k, v in sets.items()}
    over = {
        **_over(sets),
        "data.eval_source": spec.format(**paths),
        "logging.run_dir": str(sets["root"] / "bad"),
    }
    argv = [
        a
        for k, v in over.items()
        for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and all(w in err for w in words), err


def test_a_set_beyond_the_models_vocabulary_is_one_line(sets, capsys):
    """Another tokenizer, let through: its ids beyond the model's vocabulary still stop the run."""
    argv = [
        "--model",
        "tiny",
        "--model.vocab_size",
        "264",
        "--data",
        sets["train"],
        "--steps",
        "1",
        "--data.eval_source",
        f"bpe={sets['bpe']}",
        "--data.allow_tokenizer_mismatch",
        "true",
        "--run-dir",
        str(sets["root"] / "vocab"),
        "--logging.progress",
        "none",
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"error: --data.eval_source bpe={sets['bpe']}: data "
    ), err
    assert "vocab_size" in err, err
