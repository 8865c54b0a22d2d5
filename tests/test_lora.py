"""LoRA fine-tuning (train/core/lora.py): the model at step 0 is the base, the adapters' gradient is
the chain rule through W + scale A B, a run on data=2,fsdp=2,model=2 matches one device and never
touches the base, the optimizer state and checkpoints hold the adapters only, a resume is exact and
refuses a changed base, and the HF export merges. Float32, the tiny preset, 8 fake CPU devices."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import (
    COMPARED,
    SEQ,
    WARMUP,
    assert_runs_match,
    assert_trees_close,
    make_trainer,
    synthetic_batches,
)

from checkpoint import hf
from checkpoint.layout import params_only_meta
from checkpoint.manager import Checkpointer, open_checkpoint
from errors import UserError
from mesh.rules import axis_rules
from models import model
from train.core import lora
from train.core.batch_loss import loss_sums
from train.core.config import build
from train.core.setup import compile_step, create_state
from train.core.state import TrainState
from train.core.step import grads_loss_stats

MESH = "data=2,fsdp=2,model=2"
TINY = {"model.preset": "tiny", "model.dtype": "float32"}
# a higher rate than the equivalence tests' default so that a few steps on one batch
# visibly lower the loss
LORA = {
    "model.preset": "tiny",
    "model.remat": "none",
    "lora.rank": 4,
    "lora.alpha": 8.0,
    "train.lr": 1e-2,
    "data.source": "synthetic",
    "checkpoint.every": 2,
    "checkpoint.async": False,
}


def _save_base(directory: str, params: dict) -> None:
    """A params-only checkpoint of tiny float32 `params` (what an HF import writes)."""
    ck = Checkpointer(directory, keep=0, async_save=False)
    ck.save(0, {"params": params}, params_only_meta(0, {"model": build(TINY).to_dict()["model"]}))
    ck.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(the base's checkpoint directory, its params on the host)."""
    directory = str(tmp_path_factory.mktemp("base"))
    params = jax.device_get(jax.jit(lambda k: model.init(build(TINY).model, k))(jax.random.key(7)))
    _save_base(directory, params)
    return directory, params


@pytest.fixture(scope="module")
def trainers(tmp_path_factory, base):
    """(mesh, one_device) -> a LoRA Trainer on the base, built once each."""
    cache = {}

    def get(mesh: str = MESH, one_device: bool = False):
        if (mesh, one_device) not in cache:
            cache[mesh, one_device] = make_trainer(
                mesh,
                tmp_path_factory.mktemp("run"),
                one_device,
                **LORA,
                **{"checkpoint.init_from": base[0]},
            )
        return cache[mesh, one_device]

    return get


def _run_steps(tr, batches, adapters0, base_params) -> dict:
    """tests/equivalence.py run_steps for a LoRA step, whose third argument is the frozen base."""
    state = jax.device_put(
        TrainState(
            step=np.zeros((), np.int32), params=adapters0, opt_state=tr.setup.tx.init(adapters0)
        ),
        tr.setup.state_shardings,
    )
    base_on_mesh = jax.device_put(base_params, tr.setup.base_shardings)
    out = {"params0": jax.device_get(state.params), "metrics": [], "params": []}
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        # compiled as fit() compiles it (the test process's LLVM level is COMPARISON_COMPILE's), so
        # that the fit() below finds this very program in the persistent compilation cache
        step = compile_step(tr.setup, state, jax.device_put(batches[0], tr.setup.batch_sharding))
        for b in batches:
            state, m = step(state, jax.device_put(b, tr.setup.batch_sharding), base_on_mesh)
            out["metrics"].append(jax.device_get(m))
            out["params"].append(jax.device_get(state.params))
    out["state"], out["base"] = state, jax.device_get(base_on_mesh)
    return out


def test_step0_is_the_base_and_the_gradient_is_the_chain_rule(trainers, base):
    tr = trainers("", one_device=True)
    cfg, base_params = tr.cfg, base[1]
    batch = synthetic_batches(cfg.model.vocab_size, n=1)[0]
    fresh = jax.device_get(create_state(tr.setup).params)
    factors = {
        jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(fresh)[0]
    }
    assert all(not np.any(x) for k, x in factors.items() if k.endswith("['lora_b']")), (
        "B starts at zero"
    )
    assert all(np.any(x) for k, x in factors.items() if k.endswith("['lora_a']"))
    merge = lambda base_p, adapters: lora.model_params(cfg, base_p, adapters)  # noqa: E731

    @jax.jit
    def check(base_p, adapters, batch):
        """(the step's loss, the base's loss, the step's adapter gradient, the gradient by hand)."""
        # the step's factored forward (x W + scale (x A) B), against the chain rule through the
        # merged weight W_eff = W + scale A B
        step_loss, step_grads, _ = grads_loss_stats(
            cfg.model, adapters, batch, 1, param_fn=lambda a: lora.step_params(cfg, base_p, a)
        )
        xent, n = loss_sums(cfg.model, base_p, batch)
        # dL/dW_eff
        g_eff = jax.grad(lambda p: loss_sums(cfg.model, p, batch)[0] / n)(merge(base_p, adapters))
        scale, by_hand = lora.scale(cfg.lora), {}
        for stack, modules in adapters.items():
            for module, weights in modules.items():
                for name, ab in weights.items():
                    a, b, g = ab["lora_a"], ab["lora_b"], g_eff[stack][module][name]
                    n_in = a.ndim - 2
                    in_dims, out_dims = tuple(range(1, 1 + n_in)), tuple(range(1 + n_in, g.ndim))
                    # W_eff = W + scale A B: dA = scale G B^T (summed over the output dims),
                    # dB = scale A^T G (summed over the input dims); 99: the rank's index
                    grad_a = scale * jnp.einsum(
                        g, [0, *in_dims, *out_dims], b, [0, 99, *out_dims], [0, *in_dims, 99]
                    )
                    grad_b = scale * jnp.einsum(
                        a, [0, *in_dims, 99], g, [0, *in_dims, *out_dims], [0, 99, *out_dims]
                    )
                    by_hand.setdefault(stack, {}).setdefault(module, {})[name] = {
                        "lora_a": grad_a,
                        "lora_b": grad_b,
                    }
        return step_loss, xent / n, step_grads, by_hand

    rng = np.random.default_rng(0)
    # then both factors nonzero, so that neither gradient is trivially zero
    moved = jax.tree.map(
        lambda x: (x + 0.05 * rng.standard_normal(x.shape)).astype(np.float32), fresh
    )
    with jax.set_mesh(tr.setup.mesh), axis_rules(tr.setup.rules):
        assert_trees_close(
            jax.device_get(jax.jit(merge)(base_params, fresh)),
            base_params,
            "step 0's weights",
            rtol=0,
            atol_frac=0,
        )
        for adapters in (fresh, moved):
            step_loss, base_loss, grads, want = jax.device_get(check(base_params, adapters, batch))
            if adapters is fresh:
                np.testing.assert_allclose(step_loss, base_loss, rtol=1e-6)
            assert max(float(np.abs(g).max()) for g in jax.tree.leaves(want)) > 1e-4
            # float32 sums in another order (x^T (dy B^T) against (x^T dy) B^T): an element near
            # zero may differ by ~1e-8 of a 1e-3 leaf
            assert_trees_close(grads, want, "adapter gradients", rtol=1e-5, atol_frac=1e-5)


def test_mesh_run_matches_one_device_and_keeps_the_base(trainers, base):
    """Five steps on one batch: the loss falls, data=2,fsdp=2,model=2 matches one device after the
    warm-up, the base comes back bit-identical, and the optimizer state is the adapters' alone."""
    batches = synthetic_batches(264, n=1) * (WARMUP + COMPARED)
    sharded, single = trainers(), trainers("", one_device=True)
    adapters0 = jax.device_get(create_state(single.setup).params)
    want = _run_steps(single, batches, adapters0, base[1])
    got = _run_steps(sharded, batches, adapters0, base[1])
    assert_runs_match(got, want, f"LoRA on {MESH}")
    losses = [float(m["loss"]) for m in got["metrics"]]
    assert losses[-1] < losses[0] - 0.05, losses
    for run in (got, want):
        assert_trees_close(run["base"], base[1], "the frozen base", rtol=0, atol_frac=0)
    adapters, opt = got["state"].params, got["state"].opt_state
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    shapes = {x.shape for x in jax.tree.leaves(adapters)}
    arrays = [x for x in jax.tree.leaves(opt) if x.ndim]
    assert {x.shape for x in arrays} == shapes, "optimizer state of other shapes than the adapters'"
    # AdamW: one mean and one second moment each
    assert sum(x.nbytes for x in arrays) == 2 * adapter_bytes
    assert adapter_bytes < 0.2 * sum(x.nbytes for x in jax.tree.leaves(base[1]))


def test_checkpoint_resume_and_export(trainers, base, tmp_path):
    """fit() saves the adapters and their optimizer state only; a resume from step 2 ends exactly
    where the uninterrupted run did; a changed base is refused; the HF export is the merged
    model."""
    tr = trainers()
    tr.fit()
    src, last = open_checkpoint(tr.cfg.logging.run_dir)
    names = [name for name, _, _ in src.arrays(last)]
    params = [n for n in names if n.startswith("params/")]
    assert params and all(n.endswith(("/lora_a", "/lora_b")) for n in params), params
    saved_bytes = sum(np.dtype(d).itemsize * int(np.prod(s)) for _, s, d in src.arrays(last))
    assert saved_bytes < 0.5 * sum(x.nbytes for x in jax.tree.leaves(base[1]))
    assert_trees_close(jax.device_get(tr.base), base[1], "the base after fit", rtol=0, atol_frac=0)

    again = make_trainer(MESH, tmp_path / "again", **LORA, **{"checkpoint.resume": src.step_dir(2)})
    again.fit()  # no --init-from: the base comes from the checkpoint's pointer
    assert_trees_close(
        jax.device_get(again.state.params),
        jax.device_get(tr.state.params),
        "resumed adapters",
        rtol=0,
        atol_frac=0,
    )

    other = str(tmp_path / "other_base")
    _save_base(other, jax.tree.map(lambda x: x + np.float32(1e-3), base[1]))
    changed = dataclasses.replace(
        tr.cfg, checkpoint=dataclasses.replace(tr.cfg.checkpoint, init_from=other)
    )
    with pytest.raises(UserError, match="fingerprint .* differs"):
        lora.load_base(
            changed, tr.setup.mesh, tr.setup.rules, tr.setup.base_shardings, src.meta(last)
        )

    exported = hf.load_checkpoint(tr.cfg.logging.run_dir)
    hf.save_pretrained(exported, str(tmp_path / "hf"))
    plain = hf.from_pretrained(str(tmp_path / "hf"), dtype="float32")
    tokens = synthetic_batches(264, n=1)[0]["inputs"][:2, :SEQ]
    logits = jax.jit(lambda p: model.apply(tr.cfg.model, p, tokens)[0])  # one compile for the three
    lora_logits = np.asarray(logits(jax.device_get(tr.model_params(tr.state))))
    np.testing.assert_allclose(np.asarray(logits(plain.params)), lora_logits, rtol=1e-5, atol=1e-5)
    base_logits = np.asarray(logits(base[1]))
    assert np.abs(lora_logits - base_logits).max() > 1e-3, (
        "the export must hold the adapters' change"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"lora.rank": -1}, "--lora.rank -1: must be an integer >= 0"),
        (
            {"lora.rank": 4, "lora.targets": "q,qkv"},
            "unknown target 'qkv'; valid: q, k, v, o, gate, up, down",
        ),
        ({"lora.rank": 4, "lora.targets": "q,experts"}, "does not adapt MoE experts"),
        (
            {"lora.rank": 4, "lora.base_dtype": "float16"},
            "--lora.base_dtype: 'float16' is not one of",
        ),
    ],
)
def test_bad_flags(flags, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        build({"model.preset": "tiny", **flags})


def test_bad_runs():
    cfg = build({"model.preset": "tiny", "lora.rank": 4})
    with pytest.raises(UserError, match="without --init-from.*--lora.allow_random_base true"):
        lora.check_start(cfg, resuming=False)
    lora.check_start(cfg, resuming=True)  # the base comes from the checkpoint's pointer
    lora.check_start(
        build({"model.preset": "tiny", "lora.rank": 4, "lora.allow_random_base": True}),
        resuming=False,
    )
    with pytest.raises(UserError, match="sync_every"):
        lora.check_run(build({"model.preset": "tiny", "lora.rank": 4, "comm.sync_every": 2}))
    with pytest.raises(
        UserError,
        match=r"--lora.rank 128 is larger than attn/wk_DKH's smaller dim \(64 in, 32 out\);"
        r" use a rank <= 32",
    ):
        lora.check_run(build({"model.preset": "tiny", "lora.rank": 128, "lora.targets": "k"}))
    moe = build({"model.preset": "moe-tiny", "lora.rank": 4, "lora.targets": "q,gate"})
    with pytest.raises(UserError, match="'gate' adapts mlp/w_gate_DF.*valid here: q, k, v, o"):
        lora.adapter_axes(moe.model, moe.lora)
