"""models/: the Llama decoder on one device (no mesh), float32.

Forward shape/dtype, scan vs unrolled layers, remat policies, KV-cache decoding, rotary layout,
grouped-query attention, causality, greedy generation, config validation and FLOP counting."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from errors import UserError
from models import model as model_lib
from models.flops import flops_per_token, matmul_param_count, param_count
from models.layers import rope
from models.presets import PRESETS, preset
from models.sample import generate
from train.core.batch_loss import loss_sums

CFG = dataclasses.replace(PRESETS["tiny"], dtype="float32")
B, T = 2, 16


@functools.cache
def fwd(cfg):
    return jax.jit(lambda p, t: model_lib.apply(cfg, p, t)[0])


@pytest.fixture(scope="module")
def params():
    return model_lib.init(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (B, T), 0, 256, dtype=jnp.int32)


@pytest.fixture(scope="module")
def logits(params, tokens):
    return fwd(CFG)(params, tokens)


def test_logits_shape_dtype(logits):
    assert logits.shape == (B, T, CFG.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    # different positions/rows really differ (not a constant output)
    assert float(jnp.std(logits[:, 1:] - logits[:, :1])) > 1e-4


def test_params_layout(params):
    assert params["embed_VD"].shape == (CFG.vocab_size, CFG.d_model)
    assert params["lm_head_DV"].shape == (CFG.d_model, CFG.vocab_size)
    assert params["blocks"]["attn"]["wq_DNH"].shape == (
        CFG.n_layers,
        CFG.d_model,
        CFG.n_heads,
        CFG.head_dim,
    )
    assert params["blocks"]["attn"]["wk_DKH"].shape == (
        CFG.n_layers,
        CFG.d_model,
        CFG.n_kv_heads,
        CFG.head_dim,
    )
    assert params["blocks"]["mlp"]["w_down_FD"].shape == (CFG.n_layers, CFG.d_ff, CFG.d_model)
    axes = model_lib.param_axes(CFG)
    assert axes["blocks"]["mlp"]["w_gate_DF"] == ("layers", "embed", "mlp")
    assert axes["embed_VD"] == ("vocab", "vocab_embed") and axes["final_norm"]["scale"] == ("norm",)
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(
        params
    )
    # the abstract params match the real ones without allocating
    abstract = model_lib.abstract_params(CFG)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(
        lambda a: (a.shape, a.dtype), params
    )
    # different layers got different weights (per-layer rng split)
    wq = params["blocks"]["attn"]["wq_DNH"]
    assert not np.allclose(wq[0], wq[1])


def test_init_deterministic_in_key():
    a = model_lib.init(CFG, jax.random.key(0))["blocks"]["mlp"]["w_up_DF"]
    b = model_lib.init(CFG, jax.random.key(0))["blocks"]["mlp"]["w_up_DF"]
    c = model_lib.init(CFG, jax.random.key(1))["blocks"]["mlp"]["w_up_DF"]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_scan_vs_unrolled_identical(params, tokens, logits):
    unrolled = fwd(dataclasses.replace(CFG, scan_layers=False))(params, tokens)
    np.testing.assert_allclose(unrolled, logits, rtol=1e-5, atol=1e-5)


def _loss_and_grads(cfg, params, tokens):
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def mean_loss(p):
        s, n = loss_sums(cfg, p, batch)
        return s / n

    return jax.jit(jax.value_and_grad(mean_loss))(params)


@pytest.fixture(scope="module")
def no_remat_loss_and_grads(params, tokens):
    return _loss_and_grads(dataclasses.replace(CFG, remat="none"), params, tokens)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_same_loss_and_grads(params, tokens, remat, no_remat_loss_and_grads):
    ref_loss, ref_g = no_remat_loss_and_grads
    loss, g = _loss_and_grads(dataclasses.replace(CFG, remat=remat), params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert abs(float(ref_loss) - math.log(CFG.vocab_size)) < 0.5  # sane loss at init
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        assert float(jnp.max(jnp.abs(b))) > 0  # every parameter gets a gradient
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_remat_really_changes_the_program(params, tokens):
    """The policies must reach the compiled program: full remat recomputes the forward matmuls."""

    def n_dots(remat):
        cfg = dataclasses.replace(CFG, remat=remat)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_sums(cfg, p, batch)[0]))(params)
        return str(jaxpr).count("dot_general"), "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)

    none_dots, none_ck = n_dots("none")
    full_dots, full_ck = n_dots("full")
    assert not none_ck and full_ck
    assert full_dots > none_dots


def test_kv_cache_decoding_matches_full_forward(params, tokens, logits):
    step = jax.jit(lambda p, t, pos, c: model_lib.apply(CFG, p, t, pos, c))
    cache = model_lib.init_cache(CFG, B, T)
    assert cache.k.shape == (CFG.n_layers, B, T, CFG.n_kv_heads, CFG.head_dim)
    # prefill 5 tokens at once, then one token at a time
    t0 = 5
    out, cache = step(params, tokens[:, :t0], jnp.broadcast_to(jnp.arange(t0), (B, t0)), cache)
    np.testing.assert_allclose(out, logits[:, :t0], atol=1e-4)
    assert np.asarray(cache.index).tolist() == [t0] * CFG.n_layers
    for i in range(t0, T):
        out, cache = step(params, tokens[:, i : i + 1], jnp.full((B, 1), i, jnp.int32), cache)
        np.testing.assert_allclose(out[:, 0], logits[:, i], atol=1e-4, err_msg=f"position {i}")
    assert np.asarray(cache.index).tolist() == [T] * CFG.n_layers


def test_kv_cache_unrolled_layers(params, tokens, logits):
    cfg = dataclasses.replace(CFG, scan_layers=False)
    cache = model_lib.init_cache(cfg, B, T)
    out, cache = jax.jit(lambda p, t, pos, c: model_lib.apply(cfg, p, t, pos, c))(
        params, tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), cache
    )
    np.testing.assert_allclose(out, logits, atol=1e-4)
    assert np.asarray(cache.index).tolist() == [T] * cfg.n_layers


def _rope_reference(x, positions, theta):
    """HF Llama: q * cos + rotate_half(q) * sin with cos/sin = cat(freqs, freqs)."""
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    freqs = positions[..., None].astype(np.float64) * inv_freq  # [B,T,H/2]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B,T,1,H]

    def rotate_half(v):
        v1, v2 = v[..., : h // 2], v[..., h // 2 :]
        return np.concatenate([-v2, v1], axis=-1)

    return x * np.cos(emb) + rotate_half(x) * np.sin(emb)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_matches_hf_rotate_half(theta):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 3, 16)).astype(np.float32)
    positions = np.array([np.arange(7), np.arange(100, 107)])
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(positions), theta))
    np.testing.assert_allclose(got, _rope_reference(x, positions, theta), atol=2e-5)
    # position 0 is the identity; the rotation preserves each pair's norm
    np.testing.assert_allclose(got[0, 0], x[0, 0], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_is_relative():
    """q.k after rotary depends only on the position difference."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 32)), jnp.float32)

    def dot(pq, pk):
        return float(jnp.sum(rope(q, jnp.array([[pq]]), 1e4) * rope(k, jnp.array([[pk]]), 1e4)))

    assert dot(3, 1) == pytest.approx(dot(12, 10), rel=1e-4)
    assert dot(3, 1) != pytest.approx(dot(4, 1), rel=1e-3)


def test_gqa_kv1_equals_mha_with_shared_kv(tokens):
    """n_kv_heads=1 works, and equals n_kv_heads=n_heads with K/V weights copied to every head."""
    cfg1 = dataclasses.replace(CFG, n_kv_heads=1)
    cfgn = dataclasses.replace(CFG, n_kv_heads=CFG.n_heads)
    p1 = model_lib.init(cfg1, jax.random.key(3))
    assert p1["blocks"]["attn"]["wk_DKH"].shape == (CFG.n_layers, CFG.d_model, 1, CFG.head_dim)
    pn = jax.tree.map(lambda x: x, p1)
    for w in ("wk_DKH", "wv_DKH"):
        pn["blocks"]["attn"][w] = jnp.repeat(p1["blocks"]["attn"][w], CFG.n_heads, axis=2)
    assert jax.tree.map(jnp.shape, pn) == jax.tree.map(jnp.shape, model_lib.abstract_params(cfgn))
    l1, ln = fwd(cfg1)(p1, tokens), fwd(cfgn)(pn, tokens)
    assert l1.shape == ln.shape == (B, T, CFG.vocab_size)
    np.testing.assert_allclose(l1, ln, atol=1e-5)


def test_causality(params, tokens, logits):
    k = 9
    changed = tokens.at[:, k].set((tokens[:, k] + 7) % 256)
    out = fwd(CFG)(params, changed)
    np.testing.assert_allclose(out[:, :k], logits[:, :k], atol=1e-6)
    assert float(jnp.max(jnp.abs(out[:, k:] - logits[:, k:]))) > 1e-4


def _sharp(params):
    """Scale the LM head so greedy choices have clear margins (random init logits are near-ties)."""
    p = jax.tree.map(lambda x: x, params)
    p["lm_head_DV"] = p["lm_head_DV"] * 100.0
    return p


def test_generate_greedy_matches_full_forward(params):
    p = _sharp(params)
    prompt = jnp.array([[100, 101, 32, 40], [65, 66, 67, 10]], jnp.int32)
    n = 6
    g1 = generate(CFG, p, prompt, jax.random.key(0), max_new=n, temperature=0.0)
    g2 = generate(CFG, p, prompt, jax.random.key(123), max_new=n, temperature=0.0)
    assert g1.shape == (2, n) and g1.dtype == jnp.int32
    np.testing.assert_array_equal(g1, g2)  # greedy ignores the key
    # argmax-by-argmax with the full forward (no cache). Causal, so a fixed-length buffer with
    # zeros after the current position gives the same logits and one compile serves every step.
    t0 = prompt.shape[1]
    buf = jnp.zeros((2, T), jnp.int32).at[:, :t0].set(prompt)
    for i in range(n):
        nxt = jnp.argmax(fwd(CFG)(p, buf)[:, t0 + i - 1], axis=-1).astype(jnp.int32)
        buf = buf.at[:, t0 + i].set(nxt)
    np.testing.assert_array_equal(g1, buf[:, t0 : t0 + n])
    assert len(np.unique(np.asarray(g1))) > 1  # not a degenerate constant sequence
    # with temperature > 0 the key matters
    s1 = generate(CFG, params, prompt, jax.random.key(0), max_new=n, temperature=1.0, top_k=0)
    s2 = generate(CFG, params, prompt, jax.random.key(1), max_new=n, temperature=1.0, top_k=0)
    assert not np.array_equal(s1, s2)
    np.testing.assert_array_equal(
        s1, generate(CFG, params, prompt, jax.random.key(0), max_new=n, temperature=1.0, top_k=0)
    )


# ------------------------------------------------------------------ config validation


@pytest.mark.parametrize(
    "change,needles",
    [
        (dict(d_model=66), ["d_model=66", "n_heads=4"]),
        (dict(n_kv_heads=3), ["n_heads=4", "n_kv_heads=3", "[1, 2, 4]"]),
        (dict(remat="some"), ["remat", "'some'", "none, full, dots"]),
        (dict(dtype="float8"), ["dtype", "'float8'", "bfloat16"]),
        (dict(n_layers=0), ["--model.n_layers 0", "an integer >= 1"]),
        (dict(d_model=72, n_heads=8, n_kv_heads=8), ["head_dim", "9", "even"]),
    ],
)
def test_validate_bad_inputs(change, needles):
    cfg = dataclasses.replace(PRESETS["tiny"], **change)
    with pytest.raises(UserError) as ei:
        cfg.validate()
    msg = str(ei.value)
    assert msg.startswith(("model: ", "--model.")), msg
    for n in needles:
        assert n in msg, (n, msg)


def test_validate_accepts_presets():
    for name, cfg in PRESETS.items():
        assert cfg.validate() is cfg, name
    with pytest.raises(UserError, match="unknown preset 'huge'.*tiny, default"):
        preset("huge")


# ------------------------------------------------------------------ params and FLOPs


def test_param_count_equals_sum_of_sizes(params):
    n = sum(x.size for x in jax.tree.leaves(params))
    assert param_count(CFG) == n
    # by hand for tiny: per layer attn 64*16*(4+2+2+4), mlp 3*64*192, 2 norms; +
    # embed, head, final norm
    per_layer = 64 * 16 * 12 + 3 * 64 * 192 + 2 * 64
    assert n == 2 * per_layer + 2 * 264 * 64 + 64 == 132416
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    assert param_count(tied) == n - 264 * 64


def test_flops_per_token_by_hand():
    n_matmul = 132416 - 64 * (2 * 2 + 1) - 264 * 64  # minus norms and the input embedding lookup
    assert matmul_param_count(CFG) == n_matmul == 115200
    for t in (32, 256):
        assert flops_per_token(CFG, t) == 6 * 115200 + 12 * 2 * 4 * 16 * t
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    assert matmul_param_count(tied) == 115200  # the tied head is a matmul, the lookup is not


# ------------------------------------------------------------------ packed sequences


def test_packed_row_equals_separate_rows(params):
    a = jax.random.randint(jax.random.key(5), (1, 10), 0, 256, dtype=jnp.int32)
    b = jax.random.randint(jax.random.key(6), (1, 6), 0, 256, dtype=jnp.int32)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 10 + [2] * 6], jnp.int32)
    pos = jnp.array([list(range(10)) + list(range(6))], jnp.int32)

    @jax.jit
    def packed_run(p, t, pos, s):
        out = model_lib.apply(CFG, p, t, pos, segment_ids_BT=s)[0]
        default_pos = model_lib.apply(CFG, p, t, segment_ids_BT=s)[
            0
        ]  # positions restart at each segment
        # the training loss reads positions and segment ids from the batch
        xent, n = loss_sums(CFG, p, {"inputs": t, "targets": t, "positions": pos, "segment_ids": s})
        return out, default_pos, xent, n

    out, default_pos, xent, n = packed_run(params, packed, pos, seg)
    sep = [fwd(CFG)(params, t) for t in (a, b)]
    np.testing.assert_allclose(out[:, :10], sep[0], atol=1e-5)
    np.testing.assert_allclose(out[:, 10:], sep[1], atol=1e-5)
    np.testing.assert_allclose(default_pos, out, atol=1e-6)
    ref = sum(
        float(jnp.sum(jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, t[..., None], -1)[..., 0]))
        for lg, t in zip(sep, (a, b))
    )
    np.testing.assert_allclose(float(xent), ref, rtol=1e-5)
    assert float(n) == 16


@pytest.mark.parametrize("kv_rule", ["model", ""], ids=["one-einsum", "q-apart"])
def test_fused_qkv_equals_separate_projections(kv_rule):
    """q, k, v from one einsum (KV heads cut like the query heads) or q apart and k/v stacked
    (KV heads replicated while query heads are cut): the same arrays as three plain einsums."""
    from flax import nnx

    from mesh.build import make_mesh
    from mesh.rules import axis_rules, make_rules
    from models.attention import Attention, fused_qkv

    cfg = dataclasses.replace(preset("tiny"), dtype="float32", n_heads=4, n_kv_heads=2)
    attn = Attention(cfg, jnp.float32, jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, cfg.d_model)), jnp.float32)
    want = [jnp.einsum("btd,dnh->btnh", x, w[...]) for w in (attn.wq_DNH, attn.wk_DKH, attn.wv_DKH)]
    with jax.set_mesh(make_mesh("data=4,model=2")), axis_rules(make_rules(f"kv_heads={kv_rule}")):
        # which path runs
        assert fused_qkv(cfg.n_kv_heads, jax.sharding.get_abstract_mesh()) == bool(kv_rule)
        got = jax.jit(attn._qkv)(x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_config_first_seen_under_a_mesh_builds():
    """The module graph of a config that is new (or was evicted from the cache) is built inside a
    traced step under its mesh: the logical axis names must not be taken for mesh axes there."""
    from mesh.build import make_mesh
    from mesh.rules import axis_rules, make_rules

    cfg = dataclasses.replace(preset("tiny"), n_layers=3)  # no other test builds this shape
    tok = jnp.zeros((8, 16), jnp.int32)
    with jax.set_mesh(make_mesh("data=8")), axis_rules(make_rules()):
        params = jax.jit(lambda k: model_lib.init(cfg, k))(jax.random.key(0))
        logits, _ = jax.jit(lambda p, t: model_lib.forward(cfg, p, t))(params, tok)
    assert logits.shape == (8, 16, cfg.vocab_size)
