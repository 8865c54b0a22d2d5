"""`python -m train eval` and `python -m train sample` (train/cli/evaluate.py, train/cli/sample.py)
and the tokenizer check of --init-from and eval (train/run/resume.py): a tiny chat model fine-tuned
for two steps in-process, once, then every command through its main(argv)."""

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from checkpoint import hf
from checkpoint.layout import tokenizer_record
from checkpoint.manager import open_checkpoint
from errors import UserError
from mesh.rules import axis_rules
from models.hf import Model
from models.sample import generate
from train.cli import evaluate
from train.cli import sample as sample_cli
from train.cli.main import main as train_main
from train.core.config import build
from train.data import chat, make_pipeline, prepare, tokenizers
from train.run import checkpoint_match
from train.run.loop import Trainer

VOCAB = 320  # the model's: above the tiny BPE vocabulary below (300) and the byte tokenizer's (264)
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["alpha", "beta", "gamma", "delta", "hello", "world", "why", "because", "sky", "blue"]


def _conversation(i: int) -> list[dict]:
    say = lambda k, n: " ".join(WORDS[(i * 7 + k * 3 + j) % len(WORDS)] for j in range(n))  # noqa: E731
    return [
        {"role": "user", "content": f"user {i}: {say(0, 3 + i % 4)}?"},
        {"role": "assistant", "content": f"answer {i}: {say(1, 4 + i % 5)}"},
    ]


def _model_dir(path) -> str:
    """A HuggingFace model directory: a tiny byte-level BPE tokenizer.json, tokenizer_config.json
    with its eos token and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [m["content"] for i in range(50) for m in _conversation(i)],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["</s>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    os.makedirs(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "chat_template": TEMPLATE}, f)
    return str(path)


def _prepared(root, name: str, records: list[dict], tokenizer: str, input_format: str) -> str:
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


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The model directory, three prepared sets (chat and text with its tokenizer, text with the
    byte tokenizer) and a two-step fine-tune on the chat set, saved in `run`."""
    root = tmp_path_factory.mktemp("evalsample")
    model_dir = _model_dir(root / "tiny-chat")
    texts = [{"text": " ".join(m["content"] for m in _conversation(i))} for i in range(200, 300)]
    sets = {
        "chat": _prepared(
            root, "chat", [{"messages": _conversation(i)} for i in range(200)], model_dir, "chat"
        ),
        "text": _prepared(root, "text", texts, model_dir, "text"),
        "bytes": _prepared(root, "bytes", texts, "byte", "text"),
    }
    over = {
        "model.preset": "tiny",
        "model.vocab_size": VOCAB,
        "model.dtype": "float32",
        "data.source": sets["chat"],
        "data.eval_fraction": 0.25,
        "train.steps": 2,
        "train.batch_size": 8,
        "train.seq_len": 32,
        "train.eval_every": 0,
        "train.sample_tokens": 0,
        "logging.run_dir": str(root / "run"),
        "logging.progress": "none",
        "logging.tensorboard": False,
        "checkpoint.async": False,
    }
    trainer = Trainer(build(over))
    trainer.fit()
    return {
        "root": root,
        "model_dir": model_dir,
        "run": str(root / "run"),
        "trainer": trainer,
        "over": over,
        **sets,
    }


def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_two_sets_is_trainer_eval_loss(world, capsys):
    w, trainer = world, world["trainer"]
    assert (
        evaluate.main(
            [
                w["run"],
                "--data",
                f"chat={w['chat']}",
                "--data",
                f"text={w['text']}",
                "--eval-batches",
                "2",
                "--json",
            ]
        )
        == 0
    )
    out = _json_out(capsys)
    # the run's split, step and batch shape
    assert (
        out["split"] == "eval"
        and out["step"] == 2
        and (out["batch_size"], out["seq_len"]) == (8, 32)
    )
    chat_set, text_set = out["sets"]["chat"], out["sets"]["text"]
    pipeline = make_pipeline(
        trainer.cfg.data,
        batch_size=8,
        seq_len=32,
        seed=0,
        batch_sharding=trainer.setup.batch_sharding,
        vocab_size=VOCAB,
    )
    want = trainer.evaluator.loss(
        trainer.state.params, pipeline.eval_batches(2)
    )  # the run's eval, at its last step
    assert chat_set["loss"] == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert chat_set["perplexity"] == pytest.approx(math.exp(chat_set["loss"]))
    assert chat_set["windows"] == 16 and chat_set["batches"] == 2 and chat_set["of_windows"] > 16
    assert math.isfinite(text_set["loss"]) and abs(text_set["loss"] - chat_set["loss"]) > 1e-3

    # another mesh, every window of the split once (the last batch's wrapped rows weigh
    # nothing), one line a set
    assert (
        evaluate.main([w["run"], "--data", w["chat"], "--mesh", "data=2,fsdp=2,model=2", "--json"])
        == 0
    )
    whole = _json_out(capsys)["sets"]["chat"]
    assert whole["windows"] == whole["of_windows"] == chat_set["of_windows"]
    assert whole["batches"] == -(-whole["windows"] // 8)
    assert (
        evaluate.main(
            [w["run"], "--data", w["chat"], "--mesh", "fsdp=4,model=2", "--eval-batches", "2"]
        )
        == 0
    )
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("chat: loss ") and "eval split of" in line and "16 of" in line, line
    assert float(line.split()[2].rstrip(",")) == pytest.approx(want, abs=1e-4)


def test_sample_is_seeded_and_greedy_is_generate(world, capsys):
    w, trainer = world, world["trainer"]
    texts = []
    for seed in (5, 5, 6):
        assert (
            sample_cli.main(
                [
                    w["run"],
                    "--prompt",
                    "user 3: hello",
                    "--max-new",
                    "12",
                    "--temperature",
                    "1.0",
                    "--seed",
                    str(seed),
                ]
            )
            == 0
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]

    # greedy, with the chat template: generate on the rendered prompt, decoded up to the
    # end-of-document token
    assert (
        sample_cli.main(
            [w["run"], "--prompt", "why sky?", "--chat", "--max-new", "12", "--temperature", "0"]
        )
        == 0
    )
    got = capsys.readouterr().out
    tok = tokenizers.load(w["model_dir"])
    ids = tok.encode([chat.render(tok, [{"role": "user", "content": "why sky?"}], True)])[0]
    # the template's special token, not its characters
    assert ids[0] == tok.encode(["<|im_start|>"])[0][0]
    # the sampler's rules: its compile reused
    with (
        jax.set_mesh(trainer.setup.mesh),
        axis_rules({k: () for k in trainer.setup.rules}),
    ):  # the sampler's: its compile reused
        new = list(
            np.asarray(
                generate(
                    trainer.cfg.model,
                    trainer.state.params,
                    ids[None].astype(np.int32),
                    jax.random.key(0),
                    max_new=12,
                    temperature=0.0,
                )
            )[0]
        )
    new = new[: new.index(tok.eos_id)] if tok.eos_id in new else new
    assert got == tok.decode(new) + "\n"


def test_tokenizer_mismatch_is_refused_unless_allowed(world, capsys):
    w = world
    assert evaluate.main([w["run"], "--data", w["bytes"], "--eval-batches", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"error: eval: --data bytes={w['bytes']}: the checkpoint's tokenizer is hf:"
    ), err
    assert (
        "the data's is byte" in err
        and w["model_dir"] in err
        and "--data.allow_tokenizer_mismatch true" in err
    )
    assert (
        evaluate.main(
            [
                w["run"],
                "--data",
                w["bytes"],
                "--eval-batches",
                "1",
                "--json",
                "--data.allow_tokenizer_mismatch",
                "true",
            ]
        )
        == 0
    )
    assert math.isfinite(_json_out(capsys)["sets"]["bytes"]["loss"])

    # --init-from: checked against the opened pipeline before the compile; a user's
    # iterable has no tokenizer
    for source, allow, refused in (
        (w["bytes"], False, True),
        (w["bytes"], True, False),
        (w["text"], False, False),
    ):
        cfg = build(
            {
                **w["over"],
                "data.source": source,
                "checkpoint.init_from": w["run"],
                "data.allow_tokenizer_mismatch": allow,
            }
        )
        run = Trainer(cfg, mesh=w["trainer"].setup.mesh).setup
        data = make_pipeline(cfg.data, batch_size=8, seq_len=32, seed=0, vocab_size=VOCAB)
        if refused:
            with pytest.raises(
                UserError,
                match=f"--init-from {w['run']}: the checkpoint's tokenizer is hf:.*the"
                f" data's is byte",
            ):
                checkpoint_match.check_init_tokenizer(run, data)
        else:
            checkpoint_match.check_init_tokenizer(run, data)
    checkpoint_match.check_init_tokenizer(run, object())

    # an HF import records its directory's tokenizer.json as `prepare --tokenizer DIR` records it
    hf_dir = w["root"] / "hf"
    hf.save_pretrained(
        Model(w["trainer"].cfg.model, jax.device_get(w["trainer"].state.params)), str(hf_dir)
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(w["model_dir"], name), hf_dir / name)
    hf.import_checkpoint(str(hf_dir), str(w["root"] / "imported"))
    src, step = open_checkpoint(str(w["root"] / "imported"))
    index = json.load(open(os.path.join(w["text"], "index.json")))
    assert tokenizer_record(src.meta(step))["id"] == index["tokenizer"]["id"]
    with pytest.raises(UserError, match="the checkpoint's tokenizer is hf:"):
        checkpoint_match.check_tokenizer(
            src.meta(step), {"kind": "byte", "id": "byte"}, False, "--init-from"
        )


@pytest.mark.parametrize(
    "command, argv, words",
    [
        (evaluate.main, ["{root}/nope", "--data", "{chat}"], ["no such checkpoint directory"]),
        (
            evaluate.main,
            ["{run}", "--data", "a={chat}", "--data", "a={text}"],
            ["'a' is given twice"],
        ),
        (
            evaluate.main,
            ["{run}", "--data", "{root}"],
            ["is not a prepared dataset (no index.json)"],
        ),
        (evaluate.main, ["{run}"], ["no --data"]),
        (
            evaluate.main,
            ["{run}", "--data", "{chat}", "--split", "all", "--eval-batches", "-1"],
            ["--eval-batches -1"],
        ),
        (sample_cli.main, ["{root}/nope", "--prompt", "x"], ["no such checkpoint directory"]),
        (
            sample_cli.main,
            ["{run}", "--prompt", "x", "--chat", "--tokenizer", "byte"],
            ["--chat", "no chat template"],
        ),
        (sample_cli.main, ["{run}", "--prompt", "x", "--max-new", "300"], ["max_seq_len 256"]),
        (
            sample_cli.main,
            ["{root}/nope", "--prompt", "x", "--temperature", "nan"],
            ["--temperature nan"],
        ),
        (
            lambda argv: train_main(["eval", *argv]),
            ["{run}", "--data", "{root}/missing"],
            ["not a prepared dataset"],
        ),
    ],
)
def test_bad_input_is_one_line(world, capsys, command, argv, words):
    assert command([a.format(**world) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and all(word in err for word in words), err
