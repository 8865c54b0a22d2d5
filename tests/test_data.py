"""train/data: `prepare` (shards, index, workers, bad inputs), tokenizers, sources and mixtures, and
the step-indexed pipeline (exactly-once epochs across processes, exact resume, eval batches); the
rows themselves (packing masks): test_data_packing.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from data_files import TEXTS, jsonl_file, memory_source, prepared_docs, tiktoken_file
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.build import make_mesh
from train.core.config import DataConfig
from train.data import corpus, prepare, prepare_inputs, tokenizers
from train.data.order import mix, permute, proportions, round_keys
from train.data.pipeline import Pipeline, make_pipeline
from train.data.sources import load_prepared, parse_mixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ prepare


def test_prepare_cli_workers_shards_and_order(tmp_path):
    """Through `python -m train.data prepare` with 2 worker processes: several shards, documents in
    input order (JSONL split into byte ranges across tasks), checksums that match the files."""
    a = jsonl_file(tmp_path / "a.jsonl", TEXTS)
    (tmp_path / "txt").mkdir()
    for i in range(3):
        (tmp_path / "txt" / f"{i}.txt").write_text(f"plain text file {i}\n")
    out = tmp_path / "ds"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.data",
            "prepare",
            a,
            str(tmp_path / "txt"),
            "--out",
            str(out),
            "--workers",
            "2",
            "--shard-tokens",
            "4000",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert (
        len(prepare_inputs.make_tasks(prepare_inputs.expand_inputs([a, str(tmp_path / "txt")]), 2))
        > 1
    )  # the pool was used
    index = json.load(open(out / "index.json"))
    assert (
        index["dtype"] == "uint16"
        and index["vocab_size"] == corpus.BYTE_VOCAB
        and index["n_documents"] == 303
    )
    assert (
        len(index["shards"]) > 3
        and sum(s["n_tokens"] for s in index["shards"]) == index["n_tokens"]
    )
    for sh in index["shards"]:
        assert tokenizers.file_sha256(out / sh["tokens"]) == sh["sha256"]["tokens"]
        assert sh["max_token"] == np.fromfile(out / sh["tokens"], index["dtype"]).max()
    texts = [corpus.decode(d) for d in prepared_docs(out)]
    assert texts == TEXTS + [f"plain text file {i}\n" for i in range(3)]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_jsonl_split_into_tasks_keeps_every_line_once(tmp_path, monkeypatch):
    monkeypatch.setattr(
        prepare_inputs, "TASK_BYTES", 257
    )  # many byte ranges that cut lines anywhere
    monkeypatch.setattr(prepare_inputs, "MIN_TASK_BYTES", 1)
    a = jsonl_file(tmp_path / "a.jsonl", TEXTS)
    assert len(prepare_inputs.make_tasks([a])) > 20
    prepare.prepare([a], str(tmp_path / "ds"), progress=False)
    assert [corpus.decode(d) for d in prepared_docs(tmp_path / "ds")] == TEXTS


def test_token_dtype():
    assert prepare.token_dtype(259) == np.uint16 and prepare.token_dtype(65536) == np.uint16
    assert prepare.token_dtype(65537) == np.uint32 and prepare.token_dtype(200_019) == np.uint32


# ------------------------------------------------------------------ tokenizers


def _hf_file(tmp_path):
    hf_tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = hf_tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TEXTS * 3,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path = str(tmp_path / "tok.json")
    tok.save(path)
    return path


def _sp_file(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 3),
        model_prefix=prefix,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        minloglevel=2,
    )
    return prefix + ".model"


@pytest.mark.parametrize("kind", ["byte", "hf", "sentencepiece", "tiktoken"])
def test_tokenizer_round_trip_through_prepare(tmp_path, kind):
    spec = {
        "byte": lambda p: "byte",
        "hf": _hf_file,
        "sentencepiece": _sp_file,
        "tiktoken": tiktoken_file,
    }[kind](tmp_path)
    tok = tokenizers.load(spec)
    assert tok.kind == kind and 0 <= tok.eos_id < tok.vocab_size
    out = tmp_path / "ds"
    assert (
        prepare.main(
            [
                jsonl_file(tmp_path / "a.jsonl", TEXTS[:60]),
                "--tokenizer",
                spec,
                "--out",
                str(out),
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    index = json.load(open(out / "index.json"))
    assert index["tokenizer"]["kind"] == kind and index["vocab_size"] == tok.vocab_size
    assert index["tokenizer"]["id"] == (
        kind if kind == "byte" else f"{kind}:{tokenizers.file_sha256(spec)[:16]}"
    )
    docs = prepared_docs(out)
    assert [tok.decode(d) for d in docs] == TEXTS[:60]
    again = make_pipeline(DataConfig(source=str(out)), batch_size=2, seq_len=8, seed=0).tokenizer()
    # found again from the index, for samples
    assert again.kind == kind and again.decode(docs[3]) == TEXTS[3]
    if kind != "byte":  # a real subword vocabulary compresses
        assert sum(map(len, docs)) < 0.8 * sum(len(t.encode()) for t in TEXTS[:60])


# ----------------------------------------------------- bad input: one line, exit 2, nothing written


def _fails(tmp_path, capsys, argv, match):
    out = tmp_path / "out"
    assert prepare.main([*argv, "--out", str(out), "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and match in err, err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    return err


def test_bad_inputs_to_prepare(tmp_path, capsys, monkeypatch):
    good = jsonl_file(tmp_path / "good.jsonl", TEXTS[:5])
    (tmp_path / "empty").mkdir()
    _fails(tmp_path, capsys, [str(tmp_path / "empty")], "no input files")
    _fails(tmp_path, capsys, [str(tmp_path / "*.nothing")], "matches no file")
    _fails(tmp_path, capsys, [str(tmp_path / "missing.txt")], "is not a file, directory or glob")
    (tmp_path / "blank.txt").write_text("")
    _fails(tmp_path, capsys, [str(tmp_path / "blank.txt")], "no non-empty documents")
    # unreadable (the tests may run as root, who reads anything: make the check see a denied file)
    monkeypatch.setattr(prepare.os, "access", lambda p, mode: not str(p).endswith("good.jsonl"))
    _fails(tmp_path, capsys, [good], "cannot read input file")
    monkeypatch.undo()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    _fails(tmp_path, capsys, [good, str(tmp_path / "latin1.txt")], "latin1.txt is not UTF-8")
    assert (
        prepare.main(
            [
                good,
                str(tmp_path / "latin1.txt"),
                "--out",
                str(tmp_path / "skip"),
                "--on-bad-utf8",
                "skip",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "skipped 1 documents that are not UTF-8" in capsys.readouterr().err
    assert json.load(open(tmp_path / "skip" / "index.json"))["skipped_not_utf8"] == 1
    (tmp_path / "broken.json").write_text("{ not a tokenizer")
    _fails(
        tmp_path,
        capsys,
        [good, "--tokenizer", str(tmp_path / "broken.json")],
        "not a loadable hf tokenizer",
    )
    _fails(tmp_path, capsys, [good, "--tokenizer", str(tmp_path / "none.model")], "no such file")
    _fails(tmp_path, capsys, [good, "--tokenizer", "gpt9"], "unknown kind")
    _fails(tmp_path, capsys, [good, "--text-field", "body"], "no string field 'body'")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    _fails(tmp_path, capsys, [str(tmp_path / "bad.jsonl")], "not a JSON line")
    before = sorted(os.listdir(tmp_path / "skip"))
    assert prepare.main([good, "--out", str(tmp_path / "skip"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "already exists" in err and "--overwrite" in err
    assert sorted(os.listdir(tmp_path / "skip")) == before
    assert (
        prepare.main([good, "--out", str(tmp_path / "skip"), "--overwrite", "--no-progress"]) == 0
    )
    assert json.load(open(tmp_path / "skip" / "index.json"))["n_documents"] == 5


def test_bad_datasets_at_train_time(tmp_path):
    ds = tmp_path / "ds"
    prepare.prepare([jsonl_file(tmp_path / "a.jsonl", TEXTS)], str(ds), progress=False)
    cfg = DataConfig(source=str(ds), eval_fraction=0.0)
    with pytest.raises(UserError, match=r"needs vocab_size >= 259 but model.vocab_size=256"):
        make_pipeline(cfg, batch_size=4, seq_len=16, seed=0, vocab_size=256)
    longest = max(len(t.encode()) for t in TEXTS) + 1
    with pytest.raises(
        UserError, match=rf"--seq-len 400: longer than every document .*longest {longest} tokens"
    ):
        make_pipeline(DataConfig(source=str(ds), packing=False), batch_size=4, seq_len=400, seed=0)
    # packed: fine
    make_pipeline(DataConfig(source=str(ds), packing=True), batch_size=4, seq_len=400, seed=0)
    shard = ds / "shard-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="shard-00000.bin does not match the sha256 in index.json"):
        make_pipeline(cfg, batch_size=4, seq_len=16, seed=0)
    make_pipeline(DataConfig(source=str(ds), verify=False), batch_size=4, seq_len=16, seed=0)
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(UserError, match="truncated or modified"):
        make_pipeline(DataConfig(source=str(ds), verify=False), batch_size=4, seq_len=16, seed=0)
    for bad, match in [
        (f"{ds}:0.5,default", "needs a positive weight"),
        (f"{ds}:0,default:1", "positive weight"),
        (str(tmp_path / "nope"), "not a file or directory"),
    ]:
        with pytest.raises(UserError, match=match):
            make_pipeline(DataConfig(source=bad), batch_size=4, seq_len=16, seed=0)


def test_mixing_different_tokenizers_is_refused(tmp_path):
    spec = tiktoken_file(tmp_path)
    a = jsonl_file(tmp_path / "a.jsonl", TEXTS)
    prepare.prepare([a], str(tmp_path / "b"), progress=False)
    prepare.prepare([a], str(tmp_path / "t"), spec, progress=False)
    with pytest.raises(UserError, match="different tokenizers"):
        make_pipeline(
            DataConfig(source=f"{tmp_path / 'b'}:1,{tmp_path / 't'}:1"),
            batch_size=4,
            seq_len=16,
            seed=0,
        )


# ------------------------------------------------------------------ order


def test_permute_is_a_keyed_bijection():
    for n in (1, 2, 3, 7, 64, 1000, 4097):
        p = permute(np.arange(n), n, round_keys(1, 0, 0))
        np.testing.assert_array_equal(np.sort(p), np.arange(n))
    a, b = (
        permute(np.arange(1000), 1000, round_keys(1, 0, 0)),
        permute(np.arange(1000), 1000, round_keys(1, 0, 1)),
    )
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))
    assert abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.1  # no trace of the identity order


def test_mixture_matches_grain_and_its_weights():
    props = proportions([0.7, 0.2, 0.1])
    src, j = mix(np.arange(100_000), props)
    for k, w in enumerate((0.7, 0.2, 0.1)):
        assert abs(np.mean(src == k) - w) < 0.005
        # each source's rows in order
        np.testing.assert_array_equal(j[src == k], np.arange((src == k).sum()))
    grain = pytest.importorskip("grain")
    parents = [grain.MapDataset.range(10**9).map(lambda x, k=k: (k, x)) for k in range(3)]
    mixed = grain.MapDataset.mix(parents, [0.7, 0.2, 0.1])
    assert [mixed[i] for i in range(3000)] == list(zip(src[:3000].tolist(), j[:3000].tolist()))


def test_mixture_weights_in_batches(tmp_path):
    """Two prepared datasets of distinguishable bytes mixed 0.8/0.2: the share of rows from each."""
    for name, ch in (("a", "a"), ("b", "z")):
        prepare.prepare(
            [jsonl_file(tmp_path / f"{name}.jsonl", [ch * 500] * 20)],
            str(tmp_path / name),
            progress=False,
        )
    p = make_pipeline(
        DataConfig(source=f"{tmp_path / 'a'}:0.8,{tmp_path / 'b'}:0.2", eval_fraction=0.0),
        batch_size=16,
        seq_len=32,
        seed=5,
    )
    rows = np.concatenate([p.global_batch(s)["inputs"] for s in range(100)])
    from_b = np.mean((rows == ord("z")).any(axis=1))
    assert abs(from_b - 0.2) < 0.01
    assert not (
        (rows == ord("z")).any(axis=1) & (rows == ord("a")).any(axis=1)
    ).any()  # a row is one source
    assert "mixture a (byte) 80%, b (byte) 20%" in p.describe()
    mix_file = tmp_path / "mix.yaml"
    mix_file.write_text("- {source: a, weight: 4}\n- {source: b, weight: 1}\n")
    assert parse_mixture(str(mix_file)) == [(str(tmp_path / "a"), 4.0), (str(tmp_path / "b"), 1.0)]
    p2 = make_pipeline(
        DataConfig(source=str(mix_file), eval_fraction=0.0), batch_size=16, seq_len=32, seed=5
    )
    np.testing.assert_array_equal(p2.global_batch(7)["inputs"], p.global_batch(7)["inputs"])


def test_every_window_once_per_epoch_across_two_processes():
    """Simulated processes 0 and 1 each build only their half of every batch; together they see
    every window of the epoch exactly once, and the next epoch is a different order."""
    T, B = 8, 6
    n_windows = 125
    tokens = np.arange(n_windows * T + 1, dtype=np.uint32)
    p = Pipeline([(memory_source(tokens, [0]), 1.0)], batch_size=B, seq_len=T, seed=3)
    assert p.train[0].n == n_windows
    steps = -(-2 * n_windows // B)  # two epochs
    firsts = []
    for s in range(steps):
        halves = [p.host_rows(s, 0, B // 2), p.host_rows(s, B // 2, B)]
        firsts += [r for h in halves for r in h["inputs"][:, 0]]
        for h in halves:
            np.testing.assert_array_equal(h["targets"][:, :-1], h["inputs"][:, 1:])
            np.testing.assert_array_equal(
                h["inputs"] - h["inputs"][:, :1], np.arange(T)[None].repeat(len(h["inputs"]), 0)
            )
    windows = np.array(firsts) // T
    epoch0, epoch1 = windows[:n_windows], windows[n_windows : 2 * n_windows]
    np.testing.assert_array_equal(np.sort(epoch0), np.arange(n_windows))
    np.testing.assert_array_equal(np.sort(epoch1), np.arange(n_windows))
    assert not np.array_equal(epoch0, epoch1)
    st = p.state(steps)
    assert (
        st["sources"][0]["epoch"] == steps * B // n_windows
        and st["sources"][0]["offset"] == steps * B % n_windows
    )


def _batches(pipe, n):
    out = []
    for _ in range(n):
        batch, waited = pipe.next()
        assert waited >= 0
        out.append({k: np.asarray(v) for k, v in batch.items()})
    return out


def test_resume_from_saved_state_is_exact():
    """Save the loader state at a random step, rebuild (on another mesh), restore: the next 20
    batches are identical to the uninterrupted run's."""
    cfg = DataConfig(source="synthetic", packing_mask=True, prefetch=3)
    kw = dict(batch_size=16, seq_len=32, seed=11, vocab_size=512)
    mesh = make_mesh("data=8")
    full = make_pipeline(
        cfg, batch_sharding=NamedSharding(mesh, P(("data", "fsdp", "expert"), None)), **kw
    )
    step = int(np.random.default_rng().integers(1, 5_000))
    saved = json.loads(json.dumps(full.state(step)))
    try:
        before = _batches(full, 3)
    finally:
        full.close()
    mesh2 = make_mesh("data=2,fsdp=2,model=2")
    resumed = make_pipeline(
        cfg,
        batch_sharding=NamedSharding(mesh2, P(("data", "fsdp"), "model")),
        start_step=saved["next_step"],
        **kw,
    )
    assert resumed.check_state(saved) == []
    try:
        after = _batches(resumed, 20)
    finally:
        resumed.close()
    for i, b in enumerate(after):
        ref = full.global_batch(step + i)
        assert set(b) == set(ref) == {"inputs", "targets", "weights", "segment_ids", "positions"}
        for k in ref:
            np.testing.assert_array_equal(b[k], ref[k])
    np.testing.assert_array_equal(before[2]["inputs"], full.global_batch(2)["inputs"])
    assert not np.array_equal(after[0]["inputs"], after[1]["inputs"])
    other = make_pipeline(DataConfig(source="synthetic"), **{**kw, "seed": 12})
    diffs = other.check_state(saved)
    assert diffs[:2] == ["train.seed 11 -> 12", "data.packing_mask True -> False"]
    # synthetic tokens follow the seed
    assert len(diffs) == 3 and diffs[2].startswith("data source 'synthetic' fingerprint")
    diffs = make_pipeline(cfg, **{**kw, "seq_len": 64}).check_state(saved)
    assert "train.seq_len 32 -> 64" in diffs and any(
        d.startswith("data source 'synthetic' windows") for d in diffs
    )


def test_eval_batches_fixed_and_held_out(tmp_path):
    prepare.prepare([jsonl_file(tmp_path / "a.jsonl", TEXTS)], str(tmp_path / "ds"), progress=False)
    mesh = make_mesh("data=8")
    p = make_pipeline(
        DataConfig(source=str(tmp_path / "ds"), eval_fraction=0.1),
        batch_size=8,
        seq_len=16,
        seed=0,
        batch_sharding=NamedSharding(mesh, P("data", None)),
    )
    src = p.sources[0]
    assert 10 < src.eval.n_docs < 60 and src.train.n_docs + src.eval.n_docs == len(TEXTS)
    e1, e2 = p.eval_batches(2), p.eval_batches(2)
    np.testing.assert_array_equal(np.asarray(e1[1]["inputs"]), np.asarray(e2[1]["inputs"]))
    np.testing.assert_array_equal(np.asarray(e1[0]["targets"]), p.eval_rows(0)["targets"])
    held = {
        corpus.decode(src.eval.gather(np.arange(a, b - 1)))
        for a, b in zip(src.eval.doc_vstart[:-1], src.eval.doc_vstart[1:])
    }
    trained = {
        corpus.decode(src.train.gather(np.arange(a, b - 1)))
        for a, b in zip(src.train.doc_vstart[:-1], src.train.doc_vstart[1:])
    }
    assert held | trained == set(TEXTS) and not held & trained
    # same split again
    assert load_prepared(str(tmp_path / "ds"), 0.1, True).eval.n_tokens == src.eval.n_tokens
