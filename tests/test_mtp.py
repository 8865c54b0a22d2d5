"""Multi-token prediction (models/mtp.py) and the latent KV cache (models/mla.py).

transformers computes the MTP modules' logits (its MtpModel, tests/hf_moe_models.py) but has no
training loss for them (MtpModel.forward's loss path starts from None), so the loss is checked
against a plain numpy reference written from the DeepSeek-V3 report (section 2.2: module k's
cross-entropy of token i + k + 1 at position i, over the positions where it exists, weighted
lambda / D) on transformers' logits. Then: the loss is in the gradient and not in the value, packed
documents predict only inside themselves, the zigzag layout's "k ahead", and generation through
the latent cache equals the uncached forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import context, mtp
from models import model as model_lib
from models.pipeline import engine
from models.presets import preset


def _states(cfg, params, batch):
    """(pieces, outer, the decoder's final-normed states, the head) for the objective's `batch`."""
    pieces, outer, stack = model_lib.module(cfg, params).pieces()
    x = pieces.embed(outer, batch["inputs"], batch["positions"], batch.get("segment_ids"))
    x, _ = engine.stack_forward(pieces, stack, x, batch["positions"], batch.get("segment_ids"))
    h, head_DV = pieces.final(outer, x)
    return pieces, outer, h, head_DV


def mtp_loss(cfg, params, batch):
    pieces, outer, h, head_DV = _states(cfg, params, batch)
    return mtp.loss_sum(cfg, pieces.mtp_gdef, outer["mtp"], outer["embed_VD"], h, head_DV, batch)


def _batch(tokens_BT1, segment_ids=None):
    inputs, targets = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    positions = model_lib.default_positions(segment_ids, inputs.shape)
    out = {"inputs": inputs, "targets": targets, "positions": positions}
    return out if segment_ids is None else {**out, "segment_ids": segment_ids}


def _xent(logits_BTV, targets_BT):
    z = logits_BTV - logits_BTV.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1))
    return lse - np.take_along_axis(z, targets_BT[..., None], -1)[..., 0]


def test_mtp_loss_matches_a_reference_on_transformers_logits(tmp_path):
    pytest.importorskip("torch")
    from hf_moe_models import make_deepseek, mtp_logits

    from checkpoint import hf

    ref_model, ref_mtp = make_deepseek(tmp_path / "hf")
    model = hf.from_pretrained(str(tmp_path / "hf"))
    cfg = dataclasses.replace(model.cfg, mtp_loss_weight=0.3)
    seq = np.random.default_rng(1).integers(0, 96, (2, 12)).astype(np.int32)
    batch = _batch(jnp.asarray(seq))
    weights = np.random.default_rng(2).uniform(0.0, 2.0, (2, 11)).astype(np.float32)
    batch["weights"] = jnp.asarray(weights)
    # the report: L_k = CE of t_{i+k+1} under module k's distribution at i, for i + k + 1 <= T;
    # lambda / D x the sum over modules (here D = 1), each target weighted by its token's weight
    (logits,) = mtp_logits(ref_model, ref_mtp, seq[:, :-1])  # [B, T - 1, V]
    want = 0.3 * np.sum(_xent(logits.astype(np.float64), seq[:, 2:]) * weights[:, 1:])
    got = float(jax.jit(mtp_loss, static_argnums=0)(cfg, model.params, batch))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    cfg = dataclasses.replace(preset("deepseek-tiny"), dtype="float32", mtp_layers=2).validate()
    return cfg, jax.jit(model_lib.init, static_argnums=0)(cfg, jax.random.key(0))


def test_mtp_is_in_the_gradient_not_in_the_loss(tiny):
    """The objective's value and reported loss are the next-token loss's (MTP on or off); its
    gradient is that of next-token loss + the MTP loss, written out without the trick."""
    cfg, params = tiny
    seq = jnp.asarray(np.random.default_rng(0).integers(0, 264, (2, 17)), jnp.int32)
    batch = _batch(seq)
    off = dataclasses.replace(cfg, mtp_loss_weight=0.0)

    def objective(c, p):
        return model_lib.objective(c, p, batch)[0]

    def written_out(p):
        return model_lib.objective(off, p, batch)[0] + mtp_loss(cfg, p, batch)

    (v_on, g_on), (v_off, g_off) = (
        jax.jit(jax.value_and_grad(objective, argnums=1), static_argnums=0)(c, params)
        for c in (cfg, off)
    )
    assert float(v_on) == float(v_off)
    assert float(model_lib.objective(cfg, params, batch)[1]) == float(v_off)
    g_ref = jax.jit(jax.grad(written_out))(params)
    assert float(jnp.abs(g_off["mtp"]["w_eh_ED"]).max()) == 0.0  # weight 0: the modules idle
    assert float(jnp.abs(g_on["mtp"]["w_eh_ED"]).max()) > 0.0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_on), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(
            a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()), err_msg=jax.tree_util.keystr(path)
        )


def test_mtp_predicts_only_inside_each_packed_document(tiny):
    """Two documents packed in one row: the MTP loss is theirs as a batch of two rows (module k
    sees no token of the next document, and predicts none)."""
    cfg, params = tiny
    seq = np.random.default_rng(3).integers(0, 264, (2, 9)).astype(np.int32)
    segment_ids = jnp.asarray([[0] * 8 + [1] * 8])
    packed = {
        "inputs": jnp.asarray(seq[:, :-1].reshape(1, 16)),
        "targets": jnp.asarray(seq[:, 1:].reshape(1, 16)),
        "positions": model_lib.default_positions(segment_ids, (1, 16)),
        "segment_ids": segment_ids,
    }
    alone = _batch(jnp.asarray(seq))
    loss = jax.jit(mtp_loss, static_argnums=0)
    np.testing.assert_allclose(
        float(loss(cfg, params, packed)), float(loss(cfg, params, alone)), rtol=1e-5
    )


@pytest.mark.parametrize("n", [2, 4])
def test_ahead_in_the_zigzag_layout(n):
    """k positions ahead in the zigzag order of n sequence shards is the zigzag order of k ahead."""
    t, k = 16, 3
    a = jnp.arange(2 * t).reshape(2, t)
    order = context.zigzag(t, n)
    got, exists = mtp.ahead(a[:, order], k, n)
    want, want_exists = mtp.ahead(a, k, 1)
    np.testing.assert_array_equal(exists, want_exists[order])
    np.testing.assert_array_equal(np.asarray(got)[:, exists], np.asarray(want)[:, order][:, exists])


def test_latent_cache_decoding_equals_the_uncached_forward(tiny):
    """Prefill 7 tokens, then one token at a time through the latent cache (the absorbed path): the
    logits of every position equal the whole sequence's forward; the cache holds C + R numbers
    per token and layer."""
    cfg, params = tiny
    toks = jnp.asarray(np.random.default_rng(4).integers(0, 264, (2, 11)), jnp.int32)
    apply = jax.jit(model_lib.apply, static_argnums=0)
    want = np.asarray(apply(cfg, params, toks)[0])
    cache = model_lib.init_cache(cfg, 2, 16)
    assert cache.latent.shape == (cfg.n_layers, 2, 16, cfg.kv_lora_rank)
    assert cache.k_rope.shape == (cfg.n_layers, 2, 16, cfg.qk_rope_head_dim)
    got, cache = apply(cfg, params, toks[:, :7], jnp.broadcast_to(jnp.arange(7), (2, 7)), cache)
    steps = [np.asarray(got)]
    for i in range(7, 11):
        out, cache = apply(cfg, params, toks[:, i : i + 1], jnp.full((2, 1), i), cache)
        steps.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), want, atol=2e-5, rtol=1e-5)
