"""The pipeline's rows: packing masks (segments, positions, loss weights), unpacked rows that stay
in one document, the default stdlib source end to end, and injected NaN batches."""

from __future__ import annotations

import jax
import numpy as np
from data_files import memory_source
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh.build import make_mesh
from train.core.config import DataConfig
from train.data import corpus
from train.data.pipeline import Pipeline, abstract_batch, make_pipeline

# ------------------------------------------------------------------ packing


def test_packing_mask_segments_positions_weights():
    lengths = [5, 3, 12, 4]  # documents (EOS included), end to end
    tokens = np.arange(sum(lengths), dtype=np.uint32) + 1000
    starts = np.cumsum([0] + lengths[:-1])
    p = Pipeline(
        [(memory_source(tokens, starts), 1.0)], batch_size=3, seq_len=6, seed=0, packing_mask=True
    )
    rows = p.train[0].rows(np.array([0, 1, 2]), packing_mask=True)
    # window 0 = virtual 0..6: doc0 (0-4), doc1 (5-7): inputs 0..5, targets 1..6
    np.testing.assert_array_equal(rows["segment_ids"][0], [1, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(rows["positions"][0], [0, 1, 2, 3, 4, 0])
    # input 4 (doc0's EOS) -> doc1's first
    np.testing.assert_array_equal(rows["weights"][0], [1, 1, 1, 1, 0, 1])
    # window 1 = virtual 6..12: doc1 (6, 7), doc2 (8..): a row that starts mid-document
    # starts at position 0
    np.testing.assert_array_equal(rows["segment_ids"][1], [1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(rows["positions"][1], [0, 1, 0, 1, 2, 3])
    np.testing.assert_array_equal(rows["weights"][1], [1, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(rows["inputs"][1], tokens[6:12])
    plain = (
        Pipeline([(memory_source(tokens, starts), 1.0)], batch_size=3, seq_len=6, seed=0)
        .train[0]
        .rows(np.array([0]), False)
    )
    assert set(plain) == {"inputs", "targets", "weights"} and plain["weights"].min() == 1.0


def test_unpacked_rows_stay_in_one_document_and_pad():
    lengths = [5, 3, 12, 4]
    tokens = np.arange(sum(lengths), dtype=np.uint32) + 1000
    p = Pipeline(
        [(memory_source(tokens, np.cumsum([0] + lengths[:-1])), 1.0)],
        batch_size=4,
        seq_len=6,
        seed=0,
        packing=False,
        packing_mask=True,
    )
    win = p.train[0]
    assert win.n == 1 + 1 + 2 + 1  # ceil((len - 1) / 6) chunks per document
    rows = win.rows(np.arange(win.n), packing_mask=True)
    # doc0: 4 targets, then padding
    np.testing.assert_array_equal(rows["inputs"][0, :4], tokens[:4])
    np.testing.assert_array_equal(rows["weights"][0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows["segment_ids"][0], [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(rows["inputs"][3], tokens[14:20])  # doc2's second chunk
    np.testing.assert_array_equal(rows["weights"][3], [1, 1, 1, 1, 1, 0])
    assert (rows["segment_ids"] <= 1).all()
    batch = p.global_batch(0)  # 4 of the 5 chunks, each once
    match = [[np.array_equal(r, c) for c in rows["inputs"]] for r in batch["inputs"]]
    assert (
        np.array(match).sum(axis=1).tolist() == [1] * 4 and np.array(match).sum(axis=0).max() == 1
    )


def test_default_source_through_the_pipeline():
    """The stdlib corpus is one more source: same tokens and split as corpus.py."""
    p = make_pipeline(DataConfig(), batch_size=8, seq_len=64, seed=0, vocab_size=264)
    c = corpus.load("default", 0.02, 0)
    assert p.sources[0].train.n_tokens == len(c.train) and p.sources[0].eval.n_tokens == len(c.eval)
    b = p.global_batch(3)
    assert (
        b["inputs"].dtype == np.int32
        and b["inputs"].shape == (8, 64)
        and b["inputs"].max() < corpus.BYTE_VOCAB
    )
    # packed: window w = tokens[64w:][:65]
    windows = c.train[: p.train[0].n * 64].reshape(-1, 64).astype(np.int32)
    for row in b["inputs"]:
        assert (windows == row).all(axis=1).any()
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert "stdlib" in p.describe() and "M train tokens" in p.describe()
    spec = abstract_batch(DataConfig(packing_mask=True), 8, 64, None)
    assert set(spec) == {"inputs", "targets", "weights", "segment_ids", "positions"}
    assert spec["weights"].dtype == np.float32 and spec["positions"].shape == (8, 64)
    assert jax.device_count() == 8


def test_injected_nan_steps_poison_the_weights(monkeypatch):
    """BRIGADE_INJECT_NAN_STEPS=3: the batch that produces step 3 (index 2) has NaN loss weights."""
    monkeypatch.setenv("BRIGADE_INJECT_NAN_STEPS", "3")
    p = make_pipeline(
        DataConfig(source="synthetic"),
        batch_size=8,
        seq_len=16,
        seed=0,
        batch_sharding=NamedSharding(make_mesh("data=8"), P("data", None)),
    )
    assert np.isnan(np.asarray(p.device_batch(2)["weights"])).all()
    assert not np.isnan(np.asarray(p.device_batch(3)["weights"])).any()
