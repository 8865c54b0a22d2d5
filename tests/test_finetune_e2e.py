"""The fine-tune story end to end, from the command line as a user runs it: a tiny HF Llama made by
transformers itself (random weights, a BPE tokenizer.json, a chat template) is imported, a chat set
is prepared with its tokenizer, a LoRA fine-tune on fsdp=4,model=2 lowers the held-out assistant
loss (`train eval` before and after) clearly, `hf export` writes the merged model, and transformers
loads it with the logits of Brigade's merged model and the greedy tokens of `train sample`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cpu_env import cpu_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ, BATCH = 320, 128, 8
WORDS = ["red", "green", "blue", "cyan", "amber", "violet", "black", "white", "olive", "coral"]
# The role's line ends before the content, so the prompt's last token (the newline) is the one the
# training text had there too (a trailing space would be a lone token the fine-tune never saw).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}"
)
EOS = "<|endoftext|>"
# The random base's weights' std (transformers' default is 0.02): LoRA leaves the final norm and the
# LM head frozen, and a head of std 0.02 on a 64-wide model caps a logit near 1.3, so no adapter
# could make a token likelier than ~1% (the loss stalled at 5.45 nats); at 0.1 the cap is far off.
INIT_STD = 0.1
# The held-out assistant tokens' loss must fall below this share of the base's. The random base
# costs about ln(VOCAB) = 5.8 nats a token (6.2 measured); the answers are a fixed frame around the
# two words the user names, and the 40 steps below took the loss to 0.82 nats (a factor of 7.5). A
# third (about 2 nats) leaves room for other CPUs' rounding, and a fine-tune that learnt nothing
# (the base's 6.2, or the 5.45 of the run that could not: see INIT_STD) stays far above it.
DROP = 1 / 3
TRAIN_FLAGS = [
    "--lora.rank",
    "8",
    "--lora.alpha",
    "16",
    "--lr",
    "1e-2",
    "--steps",
    "40",
    "--train.warmup_steps",
    "4",
    "--batch-size",
    str(BATCH),
    "--seq-len",
    str(SEQ),
    "--mesh",
    "fsdp=4,model=2",
    "--model.dtype",
    "float32",
    "--eval-every",
    "0",
    "--train.sample_tokens",
    "0",
    "--logging.progress",
    "none",
    "--data.eval_fraction",
    "0.1",
    "--data.packing_mask",
    "true",
]
EVAL_FLAGS = [
    "--batch-size",
    str(BATCH),
    "--seq-len",
    str(SEQ),
    "--data.eval_fraction",
    "0.1",
    "--data.packing_mask",
    "true",
    "--json",
]


def conversation(i: int) -> dict:
    a, b = WORDS[i % len(WORDS)], WORDS[(i * 3 + 1) % len(WORDS)]
    return {
        "messages": [
            {"role": "user", "content": f"name {a} then {b}"},
            {"role": "assistant", "content": f"sure: first {a}, then {b}. done"},
        ]
    }


def _hf_dir(path: Path) -> None:
    """A random tiny LlamaForCausalLM saved by transformers, a BPE tokenizer.json trained on the
    chats and a tokenizer_config.json with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [
        f"{m['role']}:\n{m['content']}\n" for i in range(50) for m in conversation(i)["messages"]
    ]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    assert tok.get_vocab_size() <= VOCAB
    eos_id = tok.token_to_id(EOS)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "chat_template": TEMPLATE})
    )


def _run(*args: str, cwd: Path) -> str:
    """`python -m ARGS` in `cwd` on 8 fake CPU devices -> its stdout; a failure shows its output."""
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=cpu_env(8, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"{' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def _eval_loss(ckpt: str, cwd: Path) -> float:
    out = json.loads(
        _run("train", "eval", ckpt, "--data", "chats=data/chats", *EVAL_FLAGS, cwd=cwd)
        .strip()
        .splitlines()[-1]
    )
    return float(out["sets"]["chats"]["loss"])


@pytest.mark.slow
def test_lora_finetune_import_train_export_generate(tmp_path):
    from checkpoint import hf
    from train.cli.sample import prompt_ids
    from train.data import tokenizers

    _hf_dir(tmp_path / "hf_model")
    (tmp_path / "chats.jsonl").write_text(
        "".join(json.dumps(conversation(i)) + "\n" for i in range(400))
    )
    _run("checkpoint", "hf", "import", "hf_model", "--out", "ckpt/hf", cwd=tmp_path)
    _run(
        "train.data",
        "prepare",
        "chats.jsonl",
        "--format",
        "chat",
        "--tokenizer",
        "hf_model",
        "--out",
        "data/chats",
        cwd=tmp_path,
    )
    before = _eval_loss("ckpt/hf", tmp_path)
    _run(
        "train",
        "--config",
        "ckpt/hf/model.yaml",
        "--init-from",
        "ckpt/hf",
        "--data",
        "data/chats",
        *TRAIN_FLAGS,
        "--run-dir",
        "runs/lora",
        cwd=tmp_path,
    )
    after = _eval_loss("runs/lora", tmp_path)
    assert after < DROP * before, (before, after)
    _run("checkpoint", "hf", "export", "runs/lora", "--out", "out/merged", cwd=tmp_path)

    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "merged", dtype=torch.float32
    )
    merged = hf.load_checkpoint(str(tmp_path / "runs" / "lora"))
    tok = tokenizers.load(str(tmp_path / "hf_model"))
    # a pair no conversation holds: (i, 3i + 1) mod 10 never gives (8, 9)
    prompt = "name olive then coral"
    ids = prompt_ids(tok, prompt, as_chat=True)
    # whole conversations (the prompt's pair among them), cut to a common length
    rows = [
        tok.encode(["".join(f"{m['role']}:\n{m['content']}\n" for m in c["messages"])])[0]
        for c in (
            conversation(0),
            conversation(1),
            {"messages": [{"role": "user", "content": prompt}]},
        )
    ]
    tokens = np.asarray([r[: min(map(len, rows))] for r in rows], np.int32)
    with torch.no_grad():
        hf_logits = exported(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(merged(tokens)), hf_logits, rtol=1e-4, atol=1e-4)

    new = 24
    printed = _run(
        "train",
        "sample",
        "runs/lora",
        "--chat",
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max-new",
        str(new),
        cwd=tmp_path,
    )
    with torch.no_grad():
        out = exported.generate(
            torch.from_numpy(ids[None].astype(np.int64)),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.eos_id,
        )
    hf_new = [int(i) for i in out[0, len(ids) :]]
    hf_new = hf_new[: hf_new.index(tok.eos_id)] if tok.eos_id in hf_new else hf_new
    assert printed.endswith("\n")  # print's own: the text may end in newlines the model wrote
    assert printed[:-1] == tok.decode(hf_new), (printed, tok.decode(hf_new))
    assert printed.startswith("sure"), printed  # the answer's frame, which the fine-tune learnt
