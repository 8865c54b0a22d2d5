"""The preference step on meshes (train/core/pair_loss.py through the real jitted step): after the
warm-up, loss, gradient norm and parameters equal the same step on one device, float32, on fsdp,
fsdp x model, data x fsdp with micro-batches, and with LoRA (whose reference is the base with the
adapters off); the frozen reference comes back bit-identical. Then fit() on a prepared dataset:
the metrics are logged, a resume from a checkpoint ends exactly where the uninterrupted run did, a
changed reference is refused, and the HF export is the trained policy. 8 fake CPU devices."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from equivalence import (
    BATCH,
    COMPARED,
    COMPARISON_COMPILE,
    SEQ,
    WARMUP,
    assert_runs_match,
    assert_trees_close,
    make_trainer,
)
from test_lora_meshes import _save_base

from checkpoint import hf
from checkpoint.manager import open_checkpoint
from errors import UserError
from mesh.rules import axis_rules
from models import model
from train.core import pair_loss
from train.core.setup import create_state, jit_step
from train.core.state import TrainState
from train.data import prepare
from train.run.sinks import step_line

# name -> (mesh, overrides); each against its one-device twin with the same overrides
CASES = {
    "fsdp": ("fsdp=8", {"post.objective": "ipo"}),
    "fsdp_model": ("fsdp=4,model=2", {"post.objective": "simpo"}),
    "fsdp_model_orpo": ("fsdp=4,model=2", {"post.objective": "orpo"}),
    "data_fsdp": ("data=2,fsdp=2", {"train.micro_batches": 2}),
    "lora": ("data=2,fsdp=2,model=2", {"lora.rank": 4, "lora.alpha": 8.0}),
}
BASE = {
    "model.preset": "tiny",
    "model.remat": "none",
    "post.objective": "dpo",
    "train.lr": 1e-2,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(the --init-from checkpoint: the tiny model at a random init, its params on the host)."""
    directory = str(tmp_path_factory.mktemp("sft"))
    return directory, _save_base(directory, "tiny", seed=3)


def pair_batches(vocab: int, n: int = WARMUP + COMPARED) -> list[dict]:
    """Pairs sharing a prompt of 4-11 tokens, responses ending at different lengths."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        prompt, batch = rng.integers(4, 12, BATCH), {}
        for prefix in ("", pair_loss.REJECTED):
            tok = rng.integers(0, min(vocab, 256), (BATCH, SEQ + 1)).astype(np.int32)
            if prefix:
                tok[:, :12] = batch["inputs"][:, :12]
            end, j = rng.integers(14, SEQ + 2, BATCH), np.arange(1, SEQ + 1)
            batch[prefix + "inputs"], batch[prefix + "targets"] = tok[:, :-1], tok[:, 1:]
            weights = (j >= prompt[:, None]) & (j < end[:, None])
            batch[prefix + "weights"] = weights.astype(np.float32)
        out.append(batch)
    return out


def run_pairs(tr, batches: list[dict], params0, frozen) -> dict:
    """tests/equivalence.py run_steps for the preference step, whose third argument is the frozen
    reference (or LoRA's base)."""
    s = tr.setup
    state = jax.device_put(
        TrainState(step=np.zeros((), np.int32), params=params0, opt_state=s.tx.init(params0)),
        s.state_shardings,
    )
    sh = s.base_shardings or s.ref_shardings
    frozen_on_mesh = () if sh is None else (jax.device_put(frozen, sh),)  # simpo, orpo: none
    out = {"params0": jax.device_get(state.params), "metrics": [], "params": []}
    with jax.set_mesh(s.mesh), axis_rules(s.rules):
        first = jax.device_put(batches[0], s.batch_sharding)
        step = jit_step(s).lower(state, first, *frozen_on_mesh).compile(COMPARISON_COMPILE)
        for b in batches:
            state, m = step(state, jax.device_put(b, s.batch_sharding), *frozen_on_mesh)
            out["metrics"].append(jax.device_get(m))
            out["params"].append(jax.device_get(state.params))
    out["state"], out["frozen"] = state, jax.device_get(frozen_on_mesh[0] if sh else frozen)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_preference_step_on_a_mesh_matches_one_device(case, base, tmp_path):
    mesh, over = CASES[case]
    over = {**BASE, **over, "checkpoint.init_from": base[0]}
    sharded = make_trainer(mesh, tmp_path / "mesh", **over)
    single = make_trainer("", tmp_path / "one", one_device=True, **over)
    lora_on = "lora.rank" in over
    params0 = jax.device_get(create_state(single.setup).params) if lora_on else base[1]
    # one batch, stepped on five times: the loss must fall
    batches = pair_batches(single.cfg.model.vocab_size, n=1) * (WARMUP + COMPARED)
    want = run_pairs(single, batches, params0, base[1])
    got = run_pairs(sharded, batches, params0, base[1])
    assert_runs_match(got, want, f"--objective {over['post.objective']} on {mesh}")
    losses = [float(m["loss"]) for m in got["metrics"]]
    assert losses[-1] < losses[0], losses
    for key in ("post/margin", "post/accuracy", "post/chosen_logp", "post/rejected_logp"):
        np.testing.assert_allclose(
            float(got["metrics"][-1][key]), float(want["metrics"][-1][key]), rtol=1e-4, atol=1e-5
        )
    if over["post.objective"] == "dpo":  # the policy starts as the reference: log 2 per pair
        np.testing.assert_allclose(losses[0], np.log(2), rtol=1e-6)
    for run in (got, want):
        assert_trees_close(run["frozen"], base[1], "the reference", rtol=0, atol_frac=0)


def _pairs_dataset(root) -> str:
    path = root / "pairs.jsonl"
    records = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + b % 3)}
        for a in range(30)
        for b in range(0, 30, 3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = str(root / "pairs")
    prepare.prepare([str(path)], out, input_format="preference", progress=False)
    return out


def test_fit_logs_resumes_exactly_and_exports(base, tmp_path):
    """fit() on prepared pairs: the post/ metrics in metrics.jsonl, a resume from step 2 equal to
    the uninterrupted run bit for bit, a reference with other weights refused, the export the
    policy."""
    over = {
        **BASE,
        "checkpoint.init_from": base[0],
        "data.source": _pairs_dataset(tmp_path),
        "train.steps": 4,
        "train.seq_len": 16,
        "checkpoint.every": 2,
        "checkpoint.async": False,
    }
    tr = make_trainer("fsdp=2,model=2", tmp_path / "run", **over)
    tr.fit()
    records = [json.loads(x) for x in open(os.path.join(tr.cfg.logging.run_dir, "metrics.jsonl"))]
    logged = [r for r in records if "loss" in r]
    assert {"post/margin", "post/accuracy", "post/chosen_logp"} <= set(logged[-1])
    assert " | margin " in step_line(logged[-1]) and " | acc " in step_line(logged[-1])
    src, last = open_checkpoint(tr.cfg.logging.run_dir)
    assert src.meta(last)["config"]["post"]["ref_fingerprint"]

    again = make_trainer(
        "fsdp=2,model=2", tmp_path / "again", **{**over, "checkpoint.resume": src.step_dir(2)}
    )
    again.fit()
    assert_trees_close(
        jax.device_get(again.state.params),
        jax.device_get(tr.state.params),
        "resumed policy",
        rtol=0,
        atol_frac=0,
    )
    assert [r["loss"] for r in again.history][-1] == [r["loss"] for r in tr.history][-1]

    other = str(tmp_path / "other")
    _save_base(other, "tiny", seed=4)
    cfg = again.cfg
    changed = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=other)
    )
    with pytest.raises(UserError, match="the reference .* has fingerprint .*, not the"):
        pair_loss.load_reference(changed, tr.setup.ref_shardings, src.meta(last))

    exported = hf.load_checkpoint(tr.cfg.logging.run_dir)
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12)
    logits = jax.jit(lambda p: model.apply(tr.cfg.model, p, tokens)[0])
    np.testing.assert_allclose(
        np.asarray(logits(exported.params)),
        np.asarray(logits(jax.device_get(tr.state.params))),
        rtol=1e-6,
        atol=1e-6,
    )


def test_plan_counts_the_reference(base, tmp_path):
    """plan of a dpo run: the reference copy is held as the parameters are (its bytes per device
    equal theirs) and is listed; with LoRA there is none (the base is the reference)."""
    from mesh.build import make_mesh
    from plan.render import render
    from plan.report import analyze
    from train.core.config import build
    from train.core.setup import setup

    over = {
        **BASE,
        "checkpoint.init_from": base[0],
        "parallelism.mesh": "fsdp=4,model=2",
        "train.batch_size": BATCH,
        "train.seq_len": SEQ,
        "logging.run_dir": str(tmp_path),
    }
    mesh = make_mesh("fsdp=4,model=2")
    got = analyze(setup(build(over), mesh))
    mem = got["memory"]
    assert mem["reference_bytes"] == mem["params_bytes"] > 0
    assert mem["argument_bytes"] >= mem["reference_bytes"] + mem["params_bytes"]
    assert "reference" in render(got, show_sharding=False)
    with_lora = analyze(setup(build({**over, "lora.rank": 4}), mesh))["memory"]
    assert with_lora["reference_bytes"] == 0 and with_lora["base_bytes"] == mem["params_bytes"]


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_dpo_on_a_quantised_lora_base(base, base_dtype, tmp_path):
    """QLoRA's base is the DPO reference too (the adapters off): the quantised codes are passed as
    they are, so the policy starts as the reference (log 2 per pair) and trains."""
    over = {
        **BASE,
        "checkpoint.init_from": base[0],
        "data.source": _pairs_dataset(tmp_path),
        "lora.rank": 4,
        "lora.alpha": 8.0,
        "lora.base_dtype": base_dtype,
        "lora.block_size": 32,
        "train.steps": 3,
        "train.seq_len": 16,
        "checkpoint.every": 0,
    }
    tr = make_trainer("fsdp=2", tmp_path / "run", **over)
    tr.fit()
    losses = [r["loss"] for r in tr.history]
    np.testing.assert_allclose(losses[0], np.log(2), rtol=1e-5)
    assert all(np.isfinite(losses)) and losses[-1] != losses[0], losses
