"""A registered model on a `context` axis (models/registry.py): the sequence reaches it in the
zig-zag order of models/context.py, so only a model registered with takes_positions=True (it masks
by the positions it is given) may train there, and then exactly as on one device; a model that
masks by index is refused in one line (it used to train, attending to later tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from equivalence import assert_trees_close, gradients, make_trainer, synthetic_batches

import models
from errors import UserError
from train.core.setup import abstract_batch, abstract_state, compile_step, create_state


def prefix_init(cfg, key):
    k_embed, k_out = jax.random.split(key)
    d, v = cfg.d_model, cfg.vocab_size
    return {
        "embed_VD": jax.random.normal(k_embed, (v, d), jnp.float32),
        "out_DV": 0.1 * jax.random.normal(k_out, (d, v), jnp.float32),
    }


def prefix_axes(cfg):
    return {"embed_VD": ("vocab", "embed"), "out_DV": ("embed", "vocab")}


def prefix_mean(params, tokens_BT, seen_BTS):
    """Each token's logits from the mean embedding of the tokens it sees (itself included)."""
    x_BTD = jnp.take(params["embed_VD"], tokens_BT, axis=0)
    mean_BTD = jnp.einsum("bts,bsd->btd", seen_BTS.astype(x_BTD.dtype), x_BTD)
    mean_BTD = mean_BTD / jnp.sum(seen_BTS, axis=-1, keepdims=True)
    return (mean_BTD @ params["out_DV"]).astype(jnp.float32)


def by_positions(cfg, params, tokens_BT, positions_BT=None, cache=None, segment_ids_BT=None):
    seen_BTS = positions_BT[:, None, :] <= positions_BT[:, :, None]
    if segment_ids_BT is not None:
        seen_BTS &= segment_ids_BT[:, None, :] == segment_ids_BT[:, :, None]
    return prefix_mean(params, tokens_BT, seen_BTS), cache


def by_index(cfg, params, tokens_BT, positions_BT=None, cache=None, segment_ids_BT=None):
    t = tokens_BT.shape[1]
    seen_BTS = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens_BT.shape[0], t, t))
    return prefix_mean(params, tokens_BT, seen_BTS), cache


def test_a_model_that_masks_by_index_is_refused_on_a_context_axis(tmp_path):
    models.register("prefix-by-index", prefix_init, by_index, prefix_axes)
    tr = make_trainer("context=2", tmp_path, **{"model.preset": "prefix-by-index"})
    with pytest.raises(
        UserError,
        match="model 'prefix-by-index' on a context axis of 2: .* register it with"
        " takes_positions=True",
    ):
        compile_step(tr.setup, abstract_state(tr.setup), abstract_batch(tr.setup))


@pytest.mark.parametrize("mesh", ["context=2", "context=4,fsdp=2"])
def test_a_model_that_takes_positions_trains_on_a_context_axis_as_on_one_device(tmp_path, mesh):
    models.register(
        "prefix-by-positions", prefix_init, by_positions, prefix_axes, takes_positions=True
    )
    over = {"model.preset": "prefix-by-positions"}
    one = make_trainer("", tmp_path / "one", one_device=True, **over)
    split = make_trainer(mesh, tmp_path / "split", **over)
    params = jax.device_get(create_state(one.setup).params)
    batch = synthetic_batches(one.setup.model_cfg.vocab_size, 1)[0]
    loss_one, grads_one = gradients(one, params, batch)
    loss_split, grads_split = gradients(split, params, batch)
    np.testing.assert_allclose(loss_split, loss_one, rtol=1e-6)
    assert_trees_close(grads_split, grads_one, f"gradients on {mesh}")
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_one)) > 1e-4
