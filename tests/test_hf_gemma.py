"""The Gemma families against transformers: Gemma (1), Gemma 2 and Gemma 3 (text). Each: a tiny
random transformers model with every option that changes the math switched on (soft-capping, a
window shorter than the sequence, a local/global pattern that leaves tail layers after its last
whole repeat, query_pre_attn_scalar apart from head_dim, Gemma 3's local RoPE base and linear
scaling, random norm weights) -> import -> logits within 1e-4 of transformers'; each option shown
to matter; export -> re-import bit-exact, transformers loads the export to the same logits; greedy
generation with the KV cache (ring caches of the window on the local layers) picks HF's tokens, and
the cached logits equal the uncached forward. Then the refusals, one line each."""

import dataclasses

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# the imports below wait for the skips above (E402): without transformers and torch nothing runs
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from test_hf import assert_export_is_exact, tokens, torch_logits  # noqa: E402

from checkpoint import hf  # noqa: E402
from errors import UserError  # noqa: E402
from models import hf_config  # noqa: E402
from models import model as model_lib  # noqa: E402
from models.hf import Model  # noqa: E402
from models.layer_pattern import PatternCache  # noqa: E402

CLASSES = {
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
# 5 layers: Gemma 2's LG pattern leaves one tail layer, Gemma 3's LLG two; window 4 < 11 tokens
CASES = {  # family -> (config overrides, the ModelConfig fields the import must set)
    "gemma": ({}, dict(embed_scale=True, norm_plus_one=True, mlp_activation="gelu_tanh")),
    "gemma2": (
        dict(
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=12,
        ),
        dict(
            layer_pattern="LG",
            sliding_window=4,
            sandwich_norm=True,
            attn_softcap=2.0,
            final_softcap=3.0,
            query_pre_attn_scalar=12.0,
        ),
    ),
    "gemma3_text": (
        dict(
            sliding_window=4,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        dict(
            layer_pattern="LLG",
            qk_norm=True,
            rope_theta=1e5,
            rope_local_theta=100.0,
            rope_linear_factor=2.0,
            final_softcap=3.0,
        ),
    ),
}
# options switched off one at a time: each must change the logits
MATTERS = {
    "gemma": dict(embed_scale=False, norm_plus_one=False, mlp_activation="silu"),
    "gemma2": dict(
        sliding_window=64, attn_softcap=0.0, final_softcap=0.0, query_pre_attn_scalar=16.0
    ),
    "gemma3_text": dict(
        sliding_window=64,
        rope_local_theta=1e5,
        rope_linear_factor=1.0,
        final_softcap=0.0,
        query_pre_attn_scalar=16.0,
    ),
}


def make_gemma(path, family, **overrides):
    """A random tiny model of `family` saved to `path`; norm weights random too (HF's are w in
    1 + w, initialised 0), so a dropped, swapped or mis-offset norm shows in the logits."""
    kw = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )
    kw.update(overrides)
    if family == "gemma3_text" and "layer_types" in kw:
        kw["layer_types"] = kw["layer_types"][: kw["num_hidden_layers"]]
    config_cls, model_cls = CLASSES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return model


def assert_cache_matches_forward(model: Model, toks, prefill: int = 5):
    """Prefill, then one token at a time through the KV cache: every step's logits are the
    uncached forward's at that position."""
    cfg, b, t = model.cfg, *toks.shape
    step = jax.jit(lambda p, x, pos, c: model_lib.apply(cfg, p, x, pos, c))
    whole = np.asarray(model(toks))
    cache = model_lib.init_cache(cfg, b, t)
    pos = jnp.broadcast_to(jnp.arange(prefill), (b, prefill))
    out, cache = step(model.params, toks[:, :prefill], pos, cache)
    np.testing.assert_allclose(np.asarray(out), whole[:, :prefill], atol=1e-5, rtol=1e-5)
    for i in range(prefill, t):
        pos = jnp.full((b, 1), i, jnp.int32)
        out, cache = step(model.params, toks[:, i : i + 1], pos, cache)
        np.testing.assert_allclose(np.asarray(out)[:, 0], whole[:, i], atol=1e-5, rtol=1e-5)
    return cache


@pytest.mark.parametrize("family", list(CASES))
def test_import_export_generate_match_transformers(tmp_path, family):
    overrides, fields = CASES[family]
    ref_model = make_gemma(tmp_path / "hf", family, **overrides)
    toks = tokens()
    ref = torch_logits(ref_model, toks)
    model = hf.from_pretrained(str(tmp_path / "hf"))
    assert model.model_type == family
    assert {f: getattr(model.cfg, f) for f in fields} == fields
    assert np.std(ref) > 0.3  # logits large enough that 1e-4 is a real test
    np.testing.assert_allclose(np.asarray(model(toks)), ref, atol=1e-4, rtol=1e-4)
    for field, value in MATTERS[family].items():
        changed = Model(dataclasses.replace(model.cfg, **{field: value}), model.params)
        assert np.abs(np.asarray(changed(toks)) - ref).max() > 1e-2, field

    reloaded = assert_export_is_exact(model, tmp_path / "hf", tmp_path / "out")
    assert type(reloaded) is type(ref_model)
    np.testing.assert_allclose(torch_logits(reloaded, toks), ref, atol=1e-4, rtol=1e-4)

    cache = assert_cache_matches_forward(model, toks)
    if model.cfg.layer_pattern:  # the local layers keep a ring of the window, the global all
        assert isinstance(cache, PatternCache) and len(cache.tail) == 5 % len(
            fields["layer_pattern"]
        )
        lengths = [c.k.shape[2] for c in cache.groups] + [c.k.shape[1] for c in cache.tail]
        kinds = (fields["layer_pattern"] * 5)[: len(lengths)]
        assert lengths == [4 if k == "L" else toks.shape[1] for k in kinds], lengths
    with torch.no_grad():  # 11 prompt + 6 new tokens: past the window, through the KV cache
        want = ref_model.generate(
            torch.from_numpy(toks[:1].astype(np.int64)),
            max_new_tokens=6,
            do_sample=False,
            min_new_tokens=6,
        ).numpy()[0, toks.shape[1] :]
    np.testing.assert_array_equal(np.asarray(model.generate(toks[:1], 6))[0], want)


BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_layer_types_become_the_shortest_repeating_pattern():
    """Gemma 3's default (every sliding_window_pattern-th layer global) and a layer list that
    repeats nothing (the whole list is the group); all global is no pattern at all."""
    g3 = dict(BASE, model_type="gemma3_text", sliding_window=4, num_hidden_layers=8)
    assert hf_config.config_from_hf(g3)[1].layer_pattern == "LLLLLG"
    three = dict(g3, sliding_window_pattern=3)
    assert hf_config.config_from_hf(three)[1].layer_pattern == "LLG"
    odd = ["full_attention"] + ["sliding_attention"] * 7
    assert hf_config.config_from_hf(dict(g3, layer_types=odd))[1].layer_pattern == "GLLLLLLL"
    full = dict(g3, layer_types=["full_attention"] * 8)
    cfg = hf_config.config_from_hf(full)[1]
    assert (cfg.layer_pattern, cfg.sliding_window) == ("", 0)


@pytest.mark.parametrize(
    "config,words",
    [
        (
            dict(model_type="gemma3", vision_config={"hidden_size": 8}, text_config={}),
            ['model_type="gemma3"', "vision_config", "gemma3_text"],
        ),
        (
            dict(model_type="gemma2", hidden_activation="relu"),
            ['hidden_activation="relu"', "gelu_pytorch_tanh"],
        ),
        (
            dict(model_type="gemma3_text", use_bidirectional_attention=True),
            ["use_bidirectional_attention=true", "causal"],
        ),
        (
            dict(model_type="gemma2", layer_types=["full_attention", "chunked_attention"] * 2),
            ["layer_types=", "sliding_attention, full_attention"],
        ),
        (
            dict(
                model_type="gemma3_text",
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                },
            ),
            ['rope_parameters.sliding_attention.rope_type="linear"', "default"],
        ),
        (dict(model_type="gemma2", attn_logit_softcapping="50"), ["attn_logit_softcapping"]),
    ],
)
def test_unsupported_gemma_config_is_one_line(config, words):
    with pytest.raises(UserError) as e:
        hf_config.config_from_hf(dict(BASE, **config))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize(
    "fields,words",
    [
        (dict(layer_pattern="LG", sliding_window=4), ["layer_pattern='LG'", "embed_scale"]),
        (
            dict(embed_scale=True, norm_plus_one=True, qk_norm=True, attn_softcap=5.0),
            ["Gemma 3", "sandwich_norm"],
        ),
        (
            dict(embed_scale=True, norm_plus_one=True, sandwich_norm=True, rope_local_theta=10.0),
            ["Gemma 2", "rope_local_theta"],
        ),
    ],
)
def test_export_refuses_what_no_gemma_expresses(fields, words):
    from models.presets import preset

    with pytest.raises(UserError) as e:
        hf_config.config_to_hf(dataclasses.replace(preset("tiny"), **fields))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
