"""Per-layer attention patterns (models/layer_pattern.py) and the Gemma options on their own: the
presets' parameter counts against the published ones, soft-capped attention and its gradients
against a reference written here (the blockwise kernel's written-out backward included), decoding
through the ring caches of local layers equal to the forward (scanned and unrolled, dense and MoE),
the FLOPs of local layers, and the one-line refusals."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from errors import UserError
from models import context, flops, layer_pattern
from models import model as model_lib
from models.blockwise import blockwise_attention
from models.pieces import n_groups_and_tail
from models.presets import preset

# Gemma 3 Technical Report (arXiv:2503.19786), Table 1: embedding + non-embedding parameters of the
# language model (the 417M vision encoder is no part of a text-only model)
PUBLISHED = {"gemma3-4b": 675e6 + 3209e6, "gemma3-27b": 1416e6 + 25600e6}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_match_the_published_parameter_counts(name):
    cfg = preset(name).validate()
    count = flops.param_count(cfg)
    assert abs(count / PUBLISHED[name] - 1) < 0.01, (name, count)
    assert layer_pattern.layer_kinds(cfg)[:6] == list("LLLLLG")
    # 34 = 5 x 6 + 4 local layers after the groups; 62 = 10 x 6 + 2
    assert n_groups_and_tail(cfg) == {"gemma3-4b": (5, 4), "gemma3-27b": (10, 2)}[name]


def reference_attention(q, k, v, mask, cap):
    """[B,T,N,H] grouped-query attention with scores capped by cap * tanh(s / cap), from a
    [B,T,S] mask: the whole score matrix, as HF's eager attention."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    s = cap * jnp.tanh(s / cap)
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def test_softcapped_attention_and_its_gradients_match_a_reference():
    """Blockwise (several key blocks, its own backward) and dense from positions, with a window,
    against the reference: outputs and the gradients of q, k and v."""
    b, t, n, kv, h, cap, window = 2, 12, 4, 2, 8, 1.5, 5
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (b, t, heads, h)) * 2 for kk, heads in zip(keys, (n, kv, kv)))
    ct = jax.random.normal(keys[3], (b, t, n, h))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, :, None] - pos[:, None, :] < window)

    def loss(fn):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), argnums=(0, 1, 2))

    want = loss(lambda q, k, v: reference_attention(q, k, v, mask, cap))(q, k, v)
    cases = {
        "blockwise": lambda q, k, v: blockwise_attention(
            q, k, v, pos, pos, window=window, block_k=5, softcap=cap
        ),
        "dense": lambda q, k, v: context.local_attention(
            q, k, v, pos, pos, None, None, window=window, kind="dense", softcap=cap
        ),
    }
    for name, fn in cases.items():
        got = jax.jit(loss(fn))(q, k, v)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=name)
    uncapped = jax.jit(loss(lambda q, k, v: reference_attention(q, k, v, mask, 1e9)))(q, k, v)
    assert abs(float(uncapped[0] - want[0])) > 1e-2  # the cap matters at these scores


def decode_matches_forward(cfg, t=12, prefill=5):
    """Prefill, then one token at a time through the cache: each step's logits are the forward's;
    -> the final cache."""
    params = jax.jit(model_lib.init, static_argnums=0)(cfg, jax.random.key(0))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
    apply = jax.jit(model_lib.apply, static_argnums=0)
    whole = np.asarray(apply(cfg, params, toks)[0])
    cache = model_lib.init_cache(cfg, 2, t)
    pos = jnp.broadcast_to(jnp.arange(prefill), (2, prefill))
    out, cache = apply(cfg, params, toks[:, :prefill], pos, cache)
    np.testing.assert_allclose(np.asarray(out), whole[:, :prefill], atol=1e-5, rtol=1e-5)
    for i in range(prefill, t):
        out, cache = apply(cfg, params, toks[:, i : i + 1], jnp.full((2, 1), i, jnp.int32), cache)
        np.testing.assert_allclose(np.asarray(out)[:, 0], whole[:, i], atol=1e-5, rtol=1e-5)
    return cache


@pytest.mark.parametrize(
    "name,fields",
    [
        ("gemma-tiny", dict(dtype="float32")),
        ("gemma-tiny", dict(dtype="float32", scan_layers=False, layer_pattern="LLG")),
        # MoE: the pattern inside the group of moe_every layers (a dense local, an MoE global)
        ("moe-tiny", dict(dtype="float32", moe_every=2, layer_pattern="LG", sliding_window=3)),
        # Mistral: every layer local, the stacked cache a ring of the window
        ("tiny", dict(dtype="float32", sliding_window=3)),
    ],
)
def test_decoding_through_ring_caches_equals_the_forward(name, fields):
    cfg = dataclasses.replace(preset(name), **fields).validate()
    cache = decode_matches_forward(cfg)
    window = cfg.sliding_window
    if not cfg.layer_pattern:
        assert cache.k.shape[2] == window
        return
    groups, tail = n_groups_and_tail(cfg)
    kinds = layer_pattern.layer_kinds(cfg)
    lengths = [c.k.shape[2] for c in cache.groups] + [c.k.shape[1] for c in cache.tail]
    assert lengths == [window if k == "L" else 12 for k in kinds[: len(cache.groups)]] + [
        window if k == "L" else 12 for k in kinds[len(kinds) - tail :]
    ]


def test_flops_count_each_layers_window():
    """A local layer scores at most its window of keys, a global one the whole sequence."""
    base = dataclasses.replace(preset("tiny"), n_layers=4, attn_head_dim=16)
    patterned = dataclasses.replace(base, layer_pattern="LLLG", sliding_window=8)
    attn = 12 * base.n_heads * base.head_dim
    assert flops.flops_per_token(patterned, 128) - flops.flops_per_token(base, 128) == attn * (
        3 * 8 - 3 * 128
    )
    sandwich = dataclasses.replace(base, sandwich_norm=True)  # norms are no matmul
    assert flops.matmul_param_count(sandwich) == flops.matmul_param_count(base)


@pytest.mark.parametrize(
    "fields,words",
    [
        (dict(layer_pattern="LX", sliding_window=4), ["layer_pattern 'LX'", "'X'", "L = local"]),
        (dict(layer_pattern="LG"), ["local layers (L)", "sliding_window > 0"]),
        (dict(layer_pattern="LLLLLG", sliding_window=4), ["longer than n_layers=2"]),
        (
            dict(rope_linear_factor=8.0, rope_scaling_factor=8.0),
            ["rope_linear_factor=8.0", "two RoPE scalings"],
        ),
        (dict(mlp_activation="relu"), ["mlp_activation 'relu'", "gelu_tanh"]),
        (dict(attn_softcap=-1.0), ["--model.attn_softcap -1.0"]),
    ],
)
def test_bad_pattern_options_are_one_line(fields, words):
    with pytest.raises(UserError) as e:
        dataclasses.replace(preset("tiny"), **fields).validate()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_moe_pattern_and_cudnn_cap_refusals():
    moe = dataclasses.replace(preset("moe-tiny"), layer_pattern="LG", sliding_window=4)
    with pytest.raises(UserError, match="must divide moe_every=1"):
        moe.validate()
    capped = dataclasses.replace(preset("tiny"), attn_softcap=5.0, attention="cudnn")
    with pytest.raises(UserError, match="'cudnn' cannot soft-cap"):
        capped.attention_kind("gpu", 128)
    # on a GPU, auto picks what can cap: dense below the blockwise length
    assert dataclasses.replace(capped, attention="auto").attention_kind("gpu", 128) == "dense"
