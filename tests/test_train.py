"""train/: a real (short) training run on the default corpus, its metrics and sinks; the data
pipeline (corpus split, window sampler, device placement, prefetch) and the optimizer."""

import collections
import glob
import json
import math
import os
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.build import make_mesh
from models import model as model_lib
from models.presets import PRESETS
from train.core import optim
from train.core.config import TrainConfig, build
from train.data import corpus, make_pipeline
from train.run.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from train.run.goodput import CATEGORIES as GOODPUT_CATEGORIES  # noqa: E402

STEP_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "step_time_s",
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "mfu",
    "data_wait_s",
    "skipped_steps",  # the keys + the NaN guard's count
    "steps_since_log",
    "goodput",
    "time",
    "restarts",
    "recomputed_steps",  # + goodput (train/run/goodput.py)
    *(f"time_{c}_s" for c in GOODPUT_CATEGORIES),
    "time_other_s",
    "time_total_s",
    "idle_between_attempts_s",  # between a clean end and a continuation: in no total
    "compute_s",
    "host_s",
    "step_time_max_over_median",
    "slowest_process",  # + the straggler check
    "host_rss_bytes",
    "mesh",  # + the mesh of each step (an elastic run changes it)
    "devices",
}  # + runtime memory (device counters too where the backend keeps them: not on CPU)
STEPS = 40


# ------------------------------------------------------------------ one real run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("train") / "run"
    run_dir.mkdir()
    (run_dir / "brigade-run.json").write_text("{}")  # an earlier run's directory ...
    # ... and its stale log: fit starts afresh
    (run_dir / "metrics.jsonl").write_text('{"step": 99, "loss": 1.0}\n')
    cfg = build(
        {
            "model.preset": "tiny",
            "train.steps": STEPS,
            "train.lr": 3e-3,
            "train.batch_size": 8,
            "train.seq_len": 64,
            "train.eval_every": 20,
            "train.sample_tokens": 24,
            "logging.log_every": 1,
            "logging.progress": False,
            "logging.tensorboard": True,
            "logging.run_dir": str(run_dir),
        }
    )
    tr = Trainer(cfg)
    summary = tr.fit()
    return tr, summary, run_dir


def _records(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_loss_falls(run):
    tr, summary, _ = run
    losses = [r["loss"] for r in tr.history]
    assert len(losses) == STEPS
    # measured on this CPU: 5.61 -> ~3.1 after 40 steps (eval ~3.3); require a 1-nat drop
    assert abs(losses[0] - math.log(264)) < 0.3  # starts near uniform
    assert losses[-1] < losses[0] - 1.0, losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    assert summary["first_loss"] == losses[0] and summary["final_loss"] == losses[-1]
    ev = [r["eval_loss"] for r in tr.eval_history]
    assert [r["step"] for r in tr.eval_history] == [20, 40]
    assert ev[1] < ev[0] < losses[0]


def test_metrics_jsonl(run):
    tr, _, run_dir = run
    recs = _records(run_dir)
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    assert len(steps) + len(evals) == len(recs)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert set(r) == STEP_KEYS, set(r) ^ STEP_KEYS
        assert (r["mesh"], r["devices"]) == ("data=8", 8), r
        assert 0.0 < r["mfu"] < 1.0, r
        assert r["step_time_s"] > 0 and r["tokens_per_sec"] > 0 and r["data_wait_s"] >= 0
        assert r["tokens_per_sec"] == pytest.approx(8 * 64 / r["step_time_s"], rel=1e-6)
        assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 8, rel=1e-6)
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        # the step's split adds up to its time; one process: no straggler
        assert r["compute_s"] + r["data_wait_s"] + r["host_s"] == pytest.approx(
            r["step_time_s"], rel=1e-6
        )
        assert (r["step_time_max_over_median"], r["slowest_process"]) == (1.0, 0) and r[
            "host_rss_bytes"
        ] > 0
        assert (
            "mem_peak_bytes" not in r
            if jax.devices()[0].memory_stats() is None
            else r["mem_peak_bytes"] >= r["mem_bytes_in_use"] > 0
        )
    assert steps == tr.history
    for r in steps:  # goodput: the categories add up to the total wall time
        parts = sum(r[f"time_{c}_s"] for c in (*GOODPUT_CATEGORIES, "other"))
        assert parts == pytest.approx(r["time_total_s"], rel=1e-3), r
        assert r["goodput"] == pytest.approx(r["time_productive_s"] / r["time_total_s"], rel=1e-3)
    last, summary = steps[-1], run[1]  # the final save and eval come after the last step's record
    assert (
        last["time_compile_s"] > 0 and last["time_eval_s"] > 0 and summary["time_checkpoint_s"] > 0
    )
    assert (
        0.0 < summary["goodput"] < 1.0
        and summary["time_other_s"] < 0.4 * summary["time_total_s"]
        and summary["restarts"] == 0
        and summary["recomputed_steps"] == 0
    )
    assert summary["time_total_s"] >= last["time_total_s"]
    assert [r["time_total_s"] for r in steps] == sorted(r["time_total_s"] for r in steps)
    for r in evals:
        assert set(r) == {"step", "eval_loss", "eval_ppl"}
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-6)
    # the logged lr is the schedule at the step being taken
    sched = optim.schedule(tr.cfg.train)
    for r in steps:
        assert r["lr"] == pytest.approx(float(sched(r["step"] - 1)), rel=1e-5, abs=1e-12)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["model"]["preset"] == "tiny" and cfg["train"]["steps"] == STEPS


def _tb_scalars(path):
    from tensorboardX.proto import event_pb2

    data, i, tags = open(path, "rb").read(), 0, collections.defaultdict(list)
    while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
        n = struct.unpack("<Q", data[i : i + 8])[0]
        ev = event_pb2.Event()
        ev.ParseFromString(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
        for v in ev.summary.value:
            tags[v.tag].append((ev.step, v.simple_value))
    return tags


def test_tensorboard_events(run):
    tr, _, run_dir = run
    files = glob.glob(str(run_dir / "tb" / "events.out.tfevents.*"))
    assert len(files) == 1 and os.path.getsize(files[0]) > 0
    tags = _tb_scalars(files[0])
    assert STEP_KEYS - {"step", "mesh"} <= set(tags)  # the mesh is text: no scalar
    assert [s for s, _ in tags["loss"]] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [v for _, v in tags["loss"]], [r["loss"] for r in tr.history], rtol=1e-6
    )
    assert [s for s, _ in tags["eval_loss"]] == [20, 40]


def test_summary_and_sample(run):
    _, summary, run_dir = run
    assert isinstance(summary["sample"], str) and summary["sample"].strip()
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["sample"] == summary["sample"] and on_disk["steps"] == STEPS
    assert on_disk["params"] == 132416 and on_disk["mesh"] == "data=8"
    assert 0 < summary["mfu"] < 1 and summary["tokens_per_sec"] > 0
    # memory: the compiled step's predicted peak per device beside the largest figures measured
    assert summary["predicted_peak_bytes"] > 0 and summary["host_rss_bytes"] > 0
    assert on_disk["predicted_peak_bytes"] == summary["predicted_peak_bytes"]


# ------------------------------------------------------------------ data: placement on the mesh


def _pipeline(seed, first_step=0, sharding=None):
    from train.core.config import DataConfig

    return make_pipeline(
        DataConfig(source="synthetic", prefetch=2),
        batch_size=8,
        seq_len=16,
        seed=seed,
        batch_sharding=sharding,
        start_step=first_step,
        vocab_size=264,
    )


@pytest.mark.parametrize("spec", [P(("data", "fsdp", "expert"), None), P("data", "model"), P()])
def test_device_batch_equals_global_batch(spec):
    mesh = make_mesh("data=2,fsdp=2,model=2")
    sh = NamedSharding(mesh, spec)
    pipe = _pipeline(1, sharding=sh)
    out, ref = pipe.device_batch(4), pipe.global_batch(4)
    for k in ("inputs", "targets", "weights"):
        assert out[k].shape == (8, 16) and out[k].sharding == sh
        np.testing.assert_array_equal(np.asarray(out[k]), ref[k])
        for shard in out[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), ref[k][shard.index])
    np.testing.assert_array_equal(ref["inputs"][:, 1:], ref["targets"][:, :-1])


def test_prefetch_and_eval_batches():
    sh = NamedSharding(make_mesh("data=8"), P(("data", "fsdp", "expert"), None))
    pipe = _pipeline(2, first_step=5, sharding=sh)
    try:
        for step in (5, 6, 7):  # batch s is a function of (seed, s) only: the prefetched ones too
            batch, waited = pipe.next()
            assert waited >= 0
            np.testing.assert_array_equal(
                np.asarray(batch["inputs"]), pipe.global_batch(step)["inputs"]
            )
    finally:
        pipe.close()
    e1, e2 = pipe.eval_batches(2), pipe.eval_batches(2)
    np.testing.assert_array_equal(np.asarray(e1[1]["inputs"]), np.asarray(e2[1]["inputs"]))
    assert not np.array_equal(np.asarray(e1[0]["inputs"]), pipe.global_batch(0)["inputs"])
    assert not np.array_equal(np.asarray(e1[0]["inputs"]), np.asarray(e1[1]["inputs"]))


# ------------------------------------------------------------------ data: corpora


def _docs(tokens):
    cuts = np.flatnonzero(tokens == corpus.EOS)
    assert len(cuts) and cuts[-1] == len(tokens) - 1  # every document ends with EOS
    return [tokens[a + 1 : b].tobytes() for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


@pytest.fixture(scope="module")
def default_corpus():
    return corpus.load("default", 0.02, 0)


def test_default_corpus_split(default_corpus):
    c = default_corpus
    # the split hashes document names: independent of the seed
    again = corpus.load("default", 0.02, 7)
    np.testing.assert_array_equal(c.train, again.train)
    np.testing.assert_array_equal(c.eval, again.eval)
    assert c.vocab_size == corpus.BYTE_VOCAB and c.train.dtype == np.uint16
    assert int(c.train.max()) < corpus.BYTE_VOCAB
    train_docs, eval_docs = _docs(c.train), _docs(c.eval)
    assert len(train_docs) > 100 and len(eval_docs) > 5
    assert 0.005 < len(eval_docs) / (len(train_docs) + len(eval_docs)) < 0.05
    # documents as read from disk: the split is a partition of them, and any content found on
    # both sides must be a file that exists twice (e.g. identical __init__.py) under different names
    import sysconfig

    named = corpus._read_tree(
        sysconfig.get_paths()["stdlib"], ".py", ("site-packages", "dist-packages", "__pycache__")
    )
    contents = collections.Counter(
        np.frombuffer(d, np.uint8).astype(np.uint16).tobytes() for _, d in named
    )
    assert collections.Counter(train_docs) + collections.Counter(eval_docs) == contents
    shared = set(train_docs) & set(eval_docs)
    assert all(contents[d] > 1 for d in shared)


def test_text_corpus_split_by_name(tmp_path):
    for i in range(300):
        (tmp_path / f"doc{i:03d}.txt").write_text(f"document number {i}\n")
    c = corpus.text_corpus(str(tmp_path), 0.1)
    tr, ev = set(_docs(c.train)), set(_docs(c.eval))
    assert not tr & ev and len(tr) + len(ev) == 300
    assert 10 < len(ev) < 60
    c2 = corpus.text_corpus(str(tmp_path), 0.1)
    np.testing.assert_array_equal(c.eval, c2.eval)
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("x" * 1000)
    c1 = corpus.text_corpus(str(one / "a.txt"), 0.1)  # a single document holds out its tail
    assert len(c1.train) == 900 + 1 and len(c1.eval) == 100 + 1
    with pytest.raises(UserError, match="not a file or directory"):
        corpus.load(str(tmp_path / "missing"), 0.1, 0)


def test_encode_decode():
    toks = corpus.encode("héllo")
    assert toks.dtype == np.uint16 and len(toks) == 6
    assert corpus.decode(list(toks) + [corpus.EOS, corpus.BOS]) == "héllo"


# ------------------------------------------------------------------ optimizer


def test_decay_mask_excludes_norms_and_embeddings():
    params = model_lib.abstract_params(PRESETS["tiny"])
    mask = optim.decay_mask(params, decay_embeddings=False)
    assert mask["embed_VD"] is False and mask["lm_head_DV"] is True
    assert mask["final_norm"]["scale"] is False
    assert (
        mask["blocks"]["attn_norm"]["scale"] is False
        and mask["blocks"]["mlp_norm"]["scale"] is False
    )
    for w in ("wq_DNH", "wk_DKH", "wv_DKH", "wo_NHD"):
        assert mask["blocks"]["attn"][w] is True
    for w in ("w_gate_DF", "w_up_DF", "w_down_FD"):
        assert mask["blocks"]["mlp"][w] is True
    assert optim.decay_mask(params, decay_embeddings=True)["embed_VD"] is True


def test_weight_decay_applies_only_to_masked_params():
    """With zero gradients the AdamW update is exactly -lr * wd * p on decayed params, 0
    elsewhere."""
    cfg = TrainConfig(lr=0.1, warmup_steps=0, steps=10, grad_clip=0.0, weight_decay=0.5)
    tx = optim.make(cfg)
    params = jax.tree.map(
        lambda s: jnp.full(s.shape, 2.0, s.dtype), model_lib.abstract_params(PRESETS["tiny"])
    )
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    mask = optim.decay_mask(params, False)
    for (path, u), m in zip(
        jax.tree_util.tree_flatten_with_path(updates)[0], jax.tree.leaves(mask)
    ):
        expect = -0.1 * 0.5 * 2.0 if m else 0.0
        np.testing.assert_allclose(
            np.asarray(u), expect, rtol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


def test_grad_clip():
    tx = optim.make(TrainConfig(lr=1.0, warmup_steps=0, steps=10, grad_clip=1.0, weight_decay=0.0))
    p = {"w_DF": jnp.ones((4, 4))}
    g = {"w_DF": jnp.full((4, 4), 100.0)}
    clipped = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0, rel=1e-5)
    state = tx.init(p)
    assert isinstance(state, optax.ApplyIfFiniteState)  # the NaN guard wraps the whole chain
    assert state.inner_state[0] == optax.EmptyState()  # clipping is the first link of the chain
    assert len(optim.make(TrainConfig(grad_clip=0.0)).init(p).inner_state) == 1  # 0 disables it


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(lr=1e-2, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    s = optim.schedule(cfg)
    v = np.array([float(s(i)) for i in range(0, 131)])
    # warm-up starts at lr / warmup_steps, not 0 (a first update at rate 0 would change nothing)
    assert v[0] == pytest.approx(1e-3, rel=1e-5)
    assert v[5] == pytest.approx(1e-3 + 9e-3 * 0.5, rel=1e-5)
    assert v[10] == pytest.approx(1e-2, rel=1e-5)
    assert np.all(np.diff(v[:11]) > 0)  # linear warm-up
    assert np.all(np.diff(v[10:111]) <= 1e-12)  # then decays
    assert v[60] == pytest.approx((1e-2 + 1e-3) / 2, rel=1e-4)  # cosine midpoint
    assert v[35] == pytest.approx(1e-3 + 0.9e-2 * 0.5 * (1 + math.cos(math.pi * 0.25)), rel=1e-4)
    assert v[110] == pytest.approx(1e-3, rel=1e-5)  # lr * min_lr_ratio at the end
    assert v[130] == pytest.approx(1e-3, rel=1e-5)
    # warm-up clipped to the run
    short = optim.schedule(TrainConfig(lr=1e-2, warmup_steps=30, steps=5))
    assert float(short(4)) == pytest.approx(1e-2, rel=1e-5)


# ------------------------------------------------------------------ NaN guard


def _nan_run(tmp_path, monkeypatch, nan_steps: str, **extra):
    monkeypatch.setenv("BRIGADE_INJECT_NAN_STEPS", nan_steps)
    cfg = build(
        {
            "model.preset": "tiny",
            "model.dtype": "float32",
            "train.steps": 10,
            "train.batch_size": 8,
            "train.seq_len": 32,
            "train.eval_every": 0,
            "train.sample_tokens": 0,
            "logging.log_every": 1,
            "logging.progress": False,
            "logging.tensorboard": False,
            "logging.run_dir": str(tmp_path),
            "checkpoint.every": 3,
            "train.max_bad_steps": 3,
            **extra,
        }
    )
    tr = Trainer(cfg)
    tr.fit()
    return tr


def test_nan_steps_are_skipped_not_applied(tmp_path, monkeypatch):
    tr = _nan_run(tmp_path, monkeypatch, "4,5")
    skipped = {r["step"]: r["skipped_steps"] for r in tr.history}
    assert skipped[3] == 0 and skipped[4] == 1 and skipped[5] == 2 and skipped[10] == 2
    assert not math.isfinite(tr.history[3]["loss"]) and math.isfinite(tr.history[5]["loss"])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tr.state.params))
    assert tr.history[-1]["loss"] < tr.history[0]["loss"]  # training went on past the skipped steps


def test_too_many_nan_steps_reload_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    tr = _nan_run(tmp_path, monkeypatch, "5,6,7")
    out = capsys.readouterr()
    assert (
        "recovery: 3 skipped steps in a row (non-finite or spikes) at step 7" in out.out + out.err
    )
    assert "weights of step 6" in out.out + out.err  # checkpoints every 3 steps: 3, 6
    steps = [r["step"] for r in tr.history]
    assert steps == list(range(1, 11))  # the step count goes on (data window 7 skipped)
    assert all(math.isfinite(r["loss"]) for r in tr.history[7:])
    assert int(tr.state.step) == 10


def test_nan_steps_without_checkpoint_exit_3(tmp_path):
    env = dict(os.environ, BRIGADE_INJECT_NAN_STEPS="1,2,3")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "--model",
            "tiny",
            "--steps",
            "6",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
            "--log-every",
            "1",
            "--eval-every",
            "0",
            "--train.sample_tokens",
            "0",
            "--logging.progress",
            "false",
            "--logging.tensorboard",
            "false",
            "--checkpoint.every",
            "0",
            "--train.max_bad_steps",
            "3",
            "--run-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 3, p.stderr[-2000:]
    assert (
        "Traceback" not in p.stderr
        and "no checkpoint to restore" in p.stderr.strip().splitlines()[-1]
    )
