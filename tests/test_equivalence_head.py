"""The LM head's two layouts (mesh.rules.vocab_parallel): the vocab-parallel head, which gathers
the head's input instead of its weights, against one device and against the classic FSDP head,
per step after the warm-up in float32 (loss, gradient norm, every parameter) and through the raw
gradient leaf by leaf; the cross-entropy (gathered target logit, masked-select gradient) against
optax's; the `auto` choice."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from equivalence import (
    assert_runs_match,
    assert_trees_close,
    gradients,
    initial_params,
    make_trainer,
    run_steps,
    synthetic_batches,
    trainer_cache,
)

from errors import UserError
from mesh.rules import head_layout, make_rules
from models.loss import token_xent

VOCAB = 264  # the tiny preset's: divisible by 8 (fsdp=8) and by 4 (fsdp=2 x model=2)


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """(mesh, one_device, overrides) -> Trainer, each built once."""
    return trainer_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def runs(trainers):
    """(mesh, one_device, overrides) -> (trainer, run_steps result), each run once, all from the
    one device's initial parameters (the head's layout holds no parameters of its own)."""
    cache, batches = {}, synthetic_batches(VOCAB)

    def get(mesh: str, one_device: bool = False, **over):
        key = (mesh, one_device, tuple(sorted(over.items())))
        if key not in cache:
            tied = {k: v for k, v in over.items() if k == "model.tie_embeddings"}
            if ("params0", *tied.values()) not in cache:
                cache[("params0", *tied.values())] = initial_params(trainers("", True, **tied))
            tr = trainers(mesh, one_device, **over)
            cache[key] = tr, run_steps(tr, batches, cache[("params0", *tied.values())])
        return cache[key]

    return get


@pytest.mark.parametrize("mesh,tied", [("fsdp=8", False), ("data=2,fsdp=2,model=2", True)])
def test_vocab_parallel_step_matches_one_device(runs, mesh, tied):
    over = {"model.tie_embeddings": tied}
    tr, got = runs(mesh, **{**over, "parallelism.vocab_parallel": "on"})
    assert (
        tr.setup.rules["vocab_embed"] == () and "fsdp" in tr.setup.rules["vocab"]
    )  # the layout under test
    assert "fsdp" not in tr.setup.rules["logits_batch"]
    _, want = runs("", True, **over)
    assert_runs_match(got, want, f"vocab-parallel head on {mesh}")


def test_vocab_parallel_gradient_matches_classic_head(trainers):
    """The raw gradient (Adam would divide a constant factor out of the parameters' updates)."""
    batch = synthetic_batches(VOCAB, 1, seed=7)[0]
    vp = trainers("fsdp=8", **{"parallelism.vocab_parallel": "on"})
    classic = trainers("fsdp=8", **{"parallelism.vocab_parallel": "off"})
    assert classic.setup.rules["vocab_embed"] == ("fsdp", "context", "expert")
    params = initial_params(classic)
    loss_vp, g_vp = gradients(vp, params, batch)
    loss_c, g_c = gradients(classic, params, batch)
    assert loss_vp == pytest.approx(loss_c, rel=1e-6)
    assert_trees_close(g_vp, g_c, "vocab-parallel vs classic head gradient")
    assert float(np.abs(g_c["lm_head_DV"]).max()) > 0


def test_token_xent_matches_optax():
    logits = jax.random.normal(jax.random.key(0), (3, 5, 40), jnp.float32) * 4
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 40)
    np.testing.assert_allclose(
        token_xent(logits, targets),
        optax.softmax_cross_entropy_with_integer_labels(logits, targets),
        rtol=1e-6,
    )
    g = jax.grad(lambda z: token_xent(z, targets).sum())(logits)
    want = jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(z, targets).sum())(
        logits
    )
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)


SIZES = {"data": 1, "fsdp": 8, "context": 1, "model": 1, "expert": 1, "pipeline": 1}


def choose(rules=None, mode="auto", vocab=32000, tokens=1024, sizes=SIZES):
    return head_layout(
        rules or make_rules(),
        mode,
        sizes,
        vocab=vocab,
        batch_tokens=tokens,
        act_bytes=4,
        param_bytes=4,
    )


def test_auto_picks_the_layout_that_moves_fewer_bytes():
    # 1,024 tokens per FSDP group < 32,000 rows
    assert choose()["vocab"] == (
        "model",
        "fsdp",
        "context",
        "expert",
    )
    assert choose(tokens=1 << 20)["vocab"] == ("model",)  # a million tokens: gather the weights
    assert choose(vocab=32001)["vocab"] == ("model",)  # 8 does not divide the vocabulary
    # no FSDP: nothing to move
    assert choose(sizes={**SIZES, "fsdp": 1, "data": 8})["vocab"] == ("model",)
    written = make_rules("vocab_embed=fsdp+data")
    assert choose(written) == written  # auto keeps a head layout the user wrote
    assert choose(mode="on", tokens=1 << 20)["vocab"] == ("model", "fsdp", "context", "expert")
    assert choose(mode="off")["vocab"] == ("model",)


def test_bad_vocab_parallel_is_one_line(tmp_path):
    with pytest.raises(UserError, match="vocab_parallel 'sometimes'.*auto, on, off"):
        make_trainer("fsdp=8", tmp_path, **{"parallelism.vocab_parallel": "sometimes"})
    with pytest.raises(UserError, match="model.vocab_size"):
        make_trainer(
            "fsdp=8", tmp_path, **{"parallelism.vocab_parallel": "on", "model.vocab_size": 260}
        )
