"""`prepare --format chat|prompt_completion` (train/data/chat.py): the chat template rendered as
transformers renders it, the loss mask of assistant turns / completions stored and checked with
the tokens, carried through packed windows into the batch weights and the loss; bad records,
templates and masks are one line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from errors import UserError
from train.core.config import DataConfig
from train.data import chat, prepare, tokenizers
from train.data.index import MASKED_FORMAT
from train.data.pipeline import make_pipeline
from train.data.sources import dataset_vocab

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

# ChatML, with transformers' {% generation %} marks around what the assistant writes (so its own
# assistant mask can be compared with ours) and raise_exception on a role it does not know
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["alpha", "beta", "gamma", "délta", "hello", "world", "why", "because", "sky", "blue"]


def conversation(i: int) -> list[dict]:
    say = lambda k, n: " ".join(WORDS[(i * 7 + k * 3 + j) % len(WORDS)] for j in range(n))  # noqa: E731
    turns = [{"role": "system", "content": f"system {i}"}] if i % 3 == 0 else []
    for k in range(1 + i % 3):
        turns += [
            {"role": "user", "content": f"user {i}.{k}: {say(k, 3 + i % 4)}?"},
            {"role": "assistant", "content": f"answer {i}.{k}: {say(k + 1, 4 + i % 5)}"},
        ]
    return turns


CHATS = [conversation(i) for i in range(40)]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A HuggingFace model directory, as transformers' save_pretrained writes it: a small BPE
    tokenizer.json, tokenizer_config.json with bos/eos, chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CHATS for m in c]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-chat"
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=TEMPLATE
    ).save_pretrained(str(path))
    assert (path / "chat_template.jinja").is_file() and (path / "tokenizer.json").is_file()
    return path


@pytest.fixture(scope="module")
def chat_ds(model_dir, tmp_path_factory):
    """The CHATS prepared through the command line's code, and the tokens and mask it wrote."""
    root = tmp_path_factory.mktemp("chat")
    assert (
        prepare.main(
            [
                _jsonl(
                    root / "chats.jsonl", [{"messages": c, "id": i} for i, c in enumerate(CHATS)]
                ),
                "--tokenizer",
                str(model_dir),
                "--format",
                "chat",
                "--out",
                str(root / "ds"),
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    index = json.load(open(root / "ds" / "index.json"))
    (sh,) = index["shards"]
    tokens = np.fromfile(root / "ds" / sh["tokens"], index["dtype"])
    mask = np.fromfile(root / "ds" / sh["mask"], np.uint8)
    return root / "ds", index, tokens, mask, np.load(root / "ds" / sh["offsets"])


def test_rendering_and_tokens_match_transformers(model_dir):
    tok, hf = (
        tokenizers.load(str(model_dir)),
        transformers.AutoTokenizer.from_pretrained(str(model_dir)),
    )
    assert tok.eos_id == hf.eos_token_id and tok.special["bos_token"] == "<s>"
    for messages in CHATS[:6]:
        for prompt in (False, True):
            assert chat.render(tok, messages, prompt) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
        ids, mask = chat.chat_tokens(tok, messages, "test")
        want = hf.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        np.testing.assert_array_equal(ids, want["input_ids"])
        # transformers' own {% generation %} mask
        np.testing.assert_array_equal(mask, want["assistant_masks"])
    # the older layout: the template and an AddedToken-style eos in tokenizer_config.json
    old = model_dir.parent / "old-layout"
    old.mkdir()
    shutil.copy(model_dir / "tokenizer.json", old)
    (old / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "chat_template": TEMPLATE,
                "eos_token": {"content": "</s>", "special": True},
            }
        )
    )
    again = tokenizers.load(f"hf:{old}")
    assert again.eos_id == tok.eos_id and chat.render(again, CHATS[3], True) == chat.render(
        tok, CHATS[3], True
    )


def test_chat_mask_is_the_assistant_turns(chat_ds, model_dir):
    ds, index, tokens, mask, offsets = chat_ds
    assert index["format"] == MASKED_FORMAT and index["input_format"] == "chat"
    assert index["tokenizer"]["model_dir"] == "tiny-chat" and index["n_documents"] == len(CHATS)
    assert index["tokenizer"]["sha256"] == tokenizers.file_sha256(model_dir / "tokenizer.json")
    tok = tokenizers.load(str(model_dir))
    for d, messages in enumerate(CHATS):
        ids, m = tokens[offsets[d] : offsets[d + 1]], mask[offsets[d] : offsets[d + 1]]
        assert ids[-1] == tok.eos_id and m[-1] == 0  # the document's end is not an assistant token
        assert tok.decode(ids[m == 1]) == "".join(
            t["content"] + "<|im_end|>\n" for t in messages if t["role"] == "assistant"
        )
        assert tok.decode(ids[:-1]) == chat.render(tok, messages, False)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"messages": CHATS}), ds.parent / "chats.parquet", row_group_size=16)
    # a Parquet column of messages: the same data
    rows = prepare.prepare(
        [str(ds.parent / "chats.parquet")],
        str(ds.parent / "pq"),
        str(model_dir),
        input_format="chat",
        progress=False,
    )
    assert rows["shards"][0]["sha256"] == index["shards"][0]["sha256"]
    # prompt_completion, any tokenizer: prompt 0, completion and EOS 1
    prompts = tokenizers.load("byte")
    records = [{"prompt": "Q: 2+2?", "completion": " 4"}, {"prompt": "", "completion": "é"}]
    ds2 = ds.parent / "pc"
    prepare.prepare(
        [_jsonl(ds.parent / "pc.jsonl", records)],
        str(ds2),
        input_format="prompt_completion",
        progress=False,
    )
    index2 = json.load(open(ds2 / "index.json"))
    pc_mask = np.fromfile(ds2 / index2["shards"][0]["mask"], np.uint8)
    assert pc_mask.tolist() == [0] * 7 + [1] * 3 + [1] * 3 and index2["eos_id"] == prompts.eos_id


def _expected_weights(tokens_mask, offsets, T: int, n: int) -> np.ndarray:
    """Window k (packed: tokens [kT, kT + T + 1)) -> the weight of each target, from the files:
    the target's mask, 0 where the target starts the next document (--data.packing_mask)."""
    v = np.arange(n)[:, None] * T + np.arange(T + 1)
    doc = np.searchsorted(offsets, v, side="right") - 1
    return (tokens_mask[v[:, 1:]] * (doc[:, 1:] == doc[:, :-1])).astype(np.float32)


def test_mask_through_packed_windows_and_the_loss(chat_ds):
    """The batch weights are the mask of each target, across window and document boundaries, and
    the loss of a batch is the mean cross-entropy of exactly the weight-1 (assistant) targets."""
    ds, index, tokens, mask, offsets = chat_ds
    T = 16
    p = make_pipeline(
        DataConfig(source=str(ds), eval_fraction=0.0, packing_mask=True),
        batch_size=8,
        seq_len=T,
        seed=0,
        vocab_size=320,
    )
    win = p.train[0]
    rows = win.rows(np.arange(win.n), packing_mask=True)
    want = _expected_weights(mask, offsets, T, win.n)
    np.testing.assert_array_equal(rows["weights"], want)
    np.testing.assert_array_equal(
        rows["targets"], tokens[np.arange(win.n)[:, None] * T + np.arange(1, T + 1)]
    )
    # an assistant turn across a window boundary: weight 1 on both sides
    starts = np.arange(1, win.n) * T
    across = starts[(mask[starts] == 1) & (mask[starts + 1] == 1)] // T
    assert (
        len(across)
        and (rows["weights"][across, 0] == 1).all()
        and (rows["weights"][across - 1, -1] == 1).all()
    )

    from models import model
    from models.presets import preset
    from train.core.batch_loss import loss_sums

    cfg = dataclasses.replace(preset("tiny"), vocab_size=320, dtype="float32")
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: rng.normal(0, 0.3, s.shape).astype(s.dtype), model.abstract_params(cfg)
    )
    batch = p.global_batch(0)
    assert 0 < batch["weights"].sum() < batch["weights"].size

    @jax.jit
    def loss_and_logits(params, batch):
        logits, _ = model.forward(
            cfg, params, batch["inputs"], batch["positions"], batch["segment_ids"]
        )
        return loss_sums(cfg, params, batch), logits

    (xent, n), logits = loss_and_logits(params, batch)
    logits = np.asarray(logits, np.float64)
    b, t = np.nonzero(batch["weights"])  # by hand: log-softmax of the weight-1 targets only
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    hand = np.mean(lse[b, t] - logits[b, t, batch["targets"][b, t]])
    assert int(n) == len(b)
    np.testing.assert_allclose(float(xent) / float(n), hand, rtol=1e-5)


def _fails(argv, capsys, *words) -> None:
    assert prepare.main([*argv, "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: prepare: ") and "\n" not in err and all(w in err for w in words)
    ), err


def test_bad_records_and_templates_are_one_line(tmp_path, model_dir, capsys):
    good = CHATS[1]
    bad_chats = {
        "no-messages": ({"text": "x"}, ["bad.jsonl:3", "no field 'messages'"]),
        "bad-role": (
            {"messages": [{"role": "robot", "content": "x"}]},
            ["bad.jsonl:3", "messages[0].role is 'robot'; valid: system, developer, user"],
        ),
        "no-content": ({"messages": [{"role": "user"}]}, ["messages[0] has no string 'content'"]),
        "no-assistant": ({"messages": good[:1]}, ["no assistant message"]),
        "template-raises": (
            {"messages": [{"role": "tool", "content": "x"}, *good]},
            ["the chat template fails on this conversation (unknown role tool)"],
        ),
    }
    for name, (record, words) in bad_chats.items():
        src = _jsonl(tmp_path / "bad.jsonl", [{"messages": good}] * 2 + [record])
        _fails(
            [src, "--tokenizer", str(model_dir), "--format", "chat", "--out", str(tmp_path / name)],
            capsys,
            *words,
        )
        assert not (tmp_path / name).exists()
    src = _jsonl(tmp_path / "ok.jsonl", [{"messages": good}])
    _fails(
        [
            _jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}]),
            "--format",
            "prompt_completion",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
        "pc.jsonl:2: no field 'completion'",
    )
    _fails(
        [src, "--format", "chat", "--out", str(tmp_path / "o")],
        capsys,
        "--format chat needs --tokenizer HF_MODEL_DIR",
    )
    _fails(
        [src, "--format", "chat", "--text-field", "body", "--out", str(tmp_path / "o")],
        capsys,
        "--text-field is for --format text",
    )
    bare = tmp_path / "no-template"
    bare.mkdir()
    shutil.copy(model_dir / "tokenizer.json", bare)
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    _fails(
        [src, "--tokenizer", str(bare), "--format", "chat", "--out", str(tmp_path / "o")],
        capsys,
        "has no chat template",
    )
    # marks the last message: a prefix renders its last turn otherwise
    rewriting = tmp_path / "rewriting"
    shutil.copytree(model_dir, rewriting)
    (rewriting / "chat_template.jinja").write_text(
        TEMPLATE.replace(
            "{{ '<|im_start|>'", "{{ ('LAST' if loop.last else '') + '<|im_start|>'", 1
        )
    )
    _fails(
        [src, "--tokenizer", str(rewriting), "--format", "chat", "--out", str(tmp_path / "o")],
        capsys,
        "ok.jsonl:1: the chat template renders messages[:1]",
        "assistant message 1 cannot be located",
    )
    (rewriting / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    _fails(
        [src, "--tokenizer", str(rewriting), "--format", "chat", "--out", str(tmp_path / "o")],
        capsys,
        "the chat template does not compile (line 1:",
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "damage, words",
    [
        ("flip", "shard-00000.mask.bin does not match the sha256"),
        ("truncate", "shard-00000.mask.bin holds"),
        ("drop-key", "missing key 'shards[0].mask'"),
        ("escape", "'shards[0].mask' is '../mask.bin'"),
    ],
)
def test_masks_are_checked_like_tokens(chat_ds, tmp_path, damage, words):
    ds = tmp_path / "ds"
    shutil.copytree(chat_ds[0], ds)
    mask_file, index_file = ds / "shard-00000.mask.bin", ds / "index.json"
    index = json.load(open(index_file))
    if damage == "flip":
        raw = bytearray(mask_file.read_bytes())
        raw[5] ^= 1
        mask_file.write_bytes(bytes(raw))
    elif damage == "truncate":
        mask_file.write_bytes(mask_file.read_bytes()[:-1])
    else:
        if damage == "drop-key":
            del index["shards"][0]["mask"]
        else:
            index["shards"][0]["mask"] = "../mask.bin"
        index_file.write_text(json.dumps(index))
    with pytest.raises(UserError) as e:
        make_pipeline(DataConfig(source=str(ds)), batch_size=2, seq_len=8, seed=0)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_text_datasets_carry_no_mask_and_mix_with_chat(chat_ds, model_dir, tmp_path):
    """The model directory as a plain tokenizer: no mask, the old format tag, every target weighs
    1; its tokenizer id is the tokenizer.json's, so it mixes with the chat dataset."""
    texts = [m["content"] for c in CHATS for m in c]
    index = prepare.prepare(
        [_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])],
        str(tmp_path / "text"),
        str(model_dir),
        progress=False,
    )
    assert index["format"] == "brigade-tokens/1" and "mask" not in index["shards"][0]
    assert not [f for f in os.listdir(tmp_path / "text") if "mask" in f]
    p = make_pipeline(
        DataConfig(source=f"{tmp_path / 'text'}:1,{chat_ds[0]}:1", eval_fraction=0.0),
        batch_size=8,
        seq_len=16,
        seed=0,
    )
    assert p.train[0].rows(np.arange(4), packing_mask=False)["weights"].min() == 1.0
    assert p.train[1].rows(np.arange(4), packing_mask=False)["weights"].min() == 0.0
    assert (
        dataset_vocab(f"{tmp_path / 'text'}:1,{chat_ds[0]}:1") == 320
        and dataset_vocab("default") is None
    )


def test_a_model_without_a_vocab_size_takes_the_datasets(chat_ds):
    """320 ids in the dataset, 264 in the tiny preset: the model grows to 320 padded to 128; a
    vocab_size the user sets is kept (a dataset beyond it is refused when the data opens)."""
    from train.core.config import build

    assert build({"data.source": str(chat_ds[0]), "model.preset": "tiny"}).model.vocab_size == 384
    assert (
        build(
            {"data.source": str(chat_ds[0]), "model.preset": "tiny", "model.vocab_size": 512}
        ).model.vocab_size
        == 512
    )
    assert build({"model.preset": "tiny"}).model.vocab_size == 264
