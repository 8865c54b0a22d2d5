"""models/loss.py chunked_token_xent: the LM head's cross-entropy computed a chunk of tokens at a
time equals the one from the full [B,T,V] logits (per token and in gradients), with the sequence
padded to whole chunks, split into sequence shards, and on a mesh sharding batch, sequence and
vocabulary; and its backward's scratch memory is a fraction of the full logits'."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from models.loss import chunked_token_xent, token_xent
from train.core import batch_loss


def full_xent(x_BTD, head_DV, targets_BT):
    """The unchunked head, as models/pieces.py computes it (the head and its loss)."""
    logits_BTV = jnp.einsum(
        "btd,dv->btv", x_BTD, head_DV.astype(x_BTD.dtype), preferred_element_type=jnp.float32
    )
    return token_xent(logits_BTV, targets_BT)


def loss_and_grads(xent_fn):
    """(x, head, targets) -> (per-token losses, d sum / d x, d sum / d head), jitted."""

    def f(x_BTD, head_DV, targets_BT):
        xent_BT = xent_fn(x_BTD, head_DV, targets_BT)
        grads = jax.grad(lambda x, h: xent_fn(x, h, targets_BT).sum(), argnums=(0, 1))(
            x_BTD, head_DV
        )
        return xent_BT, *grads

    return jax.jit(f)


FULL = loss_and_grads(full_xent)  # one compile per input shape, shared by the tests


def inputs(b, t, d, v, seed=0):
    """Hidden states, head and targets (numpy: nothing to compile)."""
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((b, t, d), np.float32),
        rng.standard_normal((d, v), np.float32) * 0.5,
        rng.integers(0, v, (b, t), np.int32),
    )


def assert_close(got, want):
    """Per-token losses to 1e-6 relative; a gradient to 1e-6 of its largest entry (an entry that is
    a near-cancelling sum over tokens has no relative precision of its own)."""
    xent, *grads = got
    want_xent, *want_grads = want
    np.testing.assert_allclose(xent, want_xent, rtol=1e-6)
    for g, w in zip(grads, want_grads):
        assert g.shape == w.shape
        err = float(jnp.max(jnp.abs(g - w)))
        assert err <= 1e-6 * float(jnp.max(jnp.abs(w))), err


# odd block lengths (37; 38 in two shards of 19): chunk sizes that divide nothing (a padded last
# chunk), the whole block, and more than the block
@pytest.mark.parametrize("t,chunk,shards", [(37, 5, 1), (37, 64, 1), (38, 7, 2), (38, 19, 2)])
def test_equals_the_full_logits_loss(t, chunk, shards):
    args = inputs(2, t, 16, 50)
    got = loss_and_grads(
        lambda x, h, y: chunked_token_xent(x, h, y, chunk_tokens=chunk, seq_shards=shards)
    )(*args)
    assert_close(got, FULL(*args))


def test_compute_dtype_casts_the_head_like_the_model():
    x, head, targets = inputs(2, 24, 16, 50, seed=1)
    x = jnp.asarray(x, jnp.bfloat16)
    got = jax.jit(lambda *a: chunked_token_xent(*a, chunk_tokens=5, compute_dtype=jnp.bfloat16))(
        x, head, targets
    )
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, jax.jit(full_xent)(x, head, targets), rtol=1e-6)


def test_sharded_batch_sequence_and_vocabulary():
    """Batch over `data`, the sequence in two contiguous blocks over `seq`, the vocabulary over
    `model`: the single-device unchunked values, and the chunks stay inside each sequence shard
    (no all-gather, all-to-all or permute; with seq_shards=1 the compiler moves the sequence)."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "seq", "model"), axis_types=(AxisType.Auto,) * 3)
    x_sh, head_sh, tok_sh = (
        NamedSharding(mesh, P("data", "seq", None)),
        NamedSharding(mesh, P(None, "model")),
        NamedSharding(mesh, P("data", "seq")),
    )
    args = inputs(4, 38, 16, 64, seed=2)
    want = FULL(*args)
    fn = loss_and_grads(lambda x, h, y: chunked_token_xent(x, h, y, chunk_tokens=4, seq_shards=2))
    placed = [jax.device_put(a, s) for a, s in zip(args, (x_sh, head_sh, tok_sh))]
    compiled = fn.lower(*placed).compile()
    moved = re.findall(
        r"\b(all-gather|all-to-all|collective-permute)(?:-start)?\(", compiled.as_text()
    )
    assert not moved, moved
    got = compiled(*placed)
    assert got[0].sharding.spec == P("data", "seq")
    assert_close(got, want)


def test_backward_scratch_is_a_fraction_of_the_full_logits():
    """V=4096, T=2048: the full logits are 32 MiB of float32 and their backward several of them."""
    shapes = (
        jax.ShapeDtypeStruct((1, 2048, 64), jnp.float32),
        jax.ShapeDtypeStruct((64, 4096), jnp.float32),
        jax.ShapeDtypeStruct((1, 2048), jnp.int32),
    )

    def temp_bytes(xent_fn):
        grad_fn = jax.jit(jax.grad(lambda x, h, y: xent_fn(x, h, y).sum(), argnums=(0, 1)))
        return grad_fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    full = temp_bytes(full_xent)
    chunked = temp_bytes(lambda x, h, y: chunked_token_xent(x, h, y, chunk_tokens=256))
    assert full > 2048 * 4096 * 4  # the reference really holds [T,V] float32
    assert chunked < full / 3, (chunked, full)  # measured: 12.6 MiB against 96 MiB


def test_token_xent_still_reached_through_the_train_step():
    assert batch_loss.token_xent is token_xent


@pytest.mark.parametrize("chunk,shards", [(0, 1), (4, 0), (4, 3)])
def test_bad_chunking_is_refused(chunk, shards):
    x, head, targets = inputs(1, 8, 4, 10)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_xent(x, head, targets, chunk_tokens=chunk, seq_shards=shards)
