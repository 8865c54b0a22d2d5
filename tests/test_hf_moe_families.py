"""DeepSeek-V3 and Qwen3-MoE against transformers: tiny random checkpoints (tests/hf_moe_models.py)
-> import -> logits within 1e-4 of transformers', every option that changes the math on (latent
attention with and without the query latent, interleaved rotary features, group-limited sigmoid
routing with the selection bias, renormalisation and scale, shared experts, dense first layers,
the MTP module's logits; Qwen3-MoE's renormalisation or not, mlp_only_layers and
decoder_sparse_step, a window); export -> re-import bit-exact, the files hold the source's
tensors, transformers loads the export to the same logits; decoding through the KV cache (the
latent one for DeepSeek-V3) gives the uncached forward's logits and greedy generation picks
transformers' tokens. Then the refusals, one line each."""

import dataclasses
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# the imports below wait for the skips above (E402): without transformers and torch nothing runs
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_moe_models import load_mtp, make_deepseek, make_qwen3_moe, mtp_logits  # noqa: E402
from test_hf import assert_export_is_exact, tokens, torch_logits  # noqa: E402
from test_hf_gemma import assert_cache_matches_forward  # noqa: E402

from checkpoint import hf  # noqa: E402
from errors import UserError  # noqa: E402
from models import hf_config  # noqa: E402
from models import model as model_lib  # noqa: E402
from models.hf import Model  # noqa: E402
from models.presets import preset  # noqa: E402

DEEPSEEK_CASES = {
    # all on: query latent, interleaved RoPE, 2 of 4 groups, renormalised and x2.5, a dense first
    # layer, one MTP module
    "full": {},
    # one query projection, split-halves RoPE, no group limit, no renormalisation, every layer MoE,
    # no MTP
    "plain": dict(
        q_lora_rank=None,
        rope_interleave=False,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=0,
        num_mtp_layers=0,
    ),
}


def brigade_mtp_logits(model: Model, toks: np.ndarray) -> list[np.ndarray]:
    """The MTP modules' logits [B, T - k, V] per depth k, through the decoder's pieces (a training
    objective only: nothing else computes them)."""
    from models import mtp

    cfg = model.cfg

    def run(params, toks_BT):
        pieces, outer, stack = model_lib.module(cfg, params).pieces()
        positions = jnp.broadcast_to(jnp.arange(toks_BT.shape[1]), toks_BT.shape)
        x = pieces.embed(outer, toks_BT, positions)
        x, _ = model_lib.pipeline_lib.stack_forward(pieces, stack, x, positions)
        h, head_DV = pieces.final(outer, x)
        batch = {"inputs": toks_BT, "positions": positions}
        return [
            jnp.einsum("btd,dv->btv", hk, head_DV)
            for _, hk in mtp.states(cfg, pieces.mtp_gdef, outer["mtp"], outer["embed_VD"], h, batch)
        ]

    out = jax.jit(run)(model.params, jnp.asarray(toks))
    return [np.asarray(o)[:, : toks.shape[1] - k] for k, o in enumerate(out, 1)]


def greedy(ref_model, toks, n=6):
    with torch.no_grad():
        return ref_model.generate(
            torch.from_numpy(toks[:1].astype(np.int64)),
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=n,
        ).numpy()[0, toks.shape[1] :]


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_deepseek_v3_matches_transformers(tmp_path, case):
    ref_model, ref_mtp = make_deepseek(tmp_path / "hf", **DEEPSEEK_CASES[case])
    toks = tokens()
    ref = torch_logits(ref_model, toks)
    model = hf.from_pretrained(str(tmp_path / "hf"))
    cfg = model.cfg
    assert model.model_type == "deepseek_v3" and cfg.latent_attention
    assert (cfg.q_lora_rank, cfg.rope_interleave, cfg.router_groups, cfg.mtp_layers) == (
        (24, True, 4, 1) if case == "full" else (0, False, 1, 0)
    )
    assert np.std(ref) > 0.3  # logits large enough that 1e-4 is a real test
    np.testing.assert_allclose(np.asarray(model(toks)), ref, atol=1e-4, rtol=1e-4)
    if case == "full":
        # the group limit and the interleaving change the logits: they are tested, not idle
        for field, value in (("router_groups", 1), ("rope_interleave", False)):
            other = Model(dataclasses.replace(cfg, **{field: value}), model.params)
            assert np.abs(np.asarray(other(toks)) - ref).max() > 1e-3, field
        ours, theirs = brigade_mtp_logits(model, toks), mtp_logits(ref_model, ref_mtp, toks)
        assert len(ours) == len(theirs) == 1
        for got, want in zip(ours, theirs):
            assert np.std(want) > 0.3
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    reloaded = assert_export_is_exact(model, tmp_path / "hf", tmp_path / "out")
    assert type(reloaded) is type(ref_model)
    np.testing.assert_allclose(torch_logits(reloaded, toks), ref, atol=1e-4, rtol=1e-4)
    if case == "full":  # transformers' MTP layer from the exported files computes the same
        for got, want in zip(
            mtp_logits(reloaded, load_mtp(reloaded, tmp_path / "out"), toks),
            mtp_logits(ref_model, ref_mtp, toks),
        ):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    # prefill, then a token at a time through the latent cache: the uncached forward's logits
    cache = assert_cache_matches_forward(model, toks)
    assert cache.latent.shape[-1] == cfg.kv_lora_rank
    # 11 prompt + 6 new tokens through the latent cache
    np.testing.assert_array_equal(
        np.asarray(model.generate(toks[:1], 6))[0], greedy(ref_model, toks)
    )


QWEN3_MOE_CASES = {
    # Qwen3-30B-A3B's routing (renormalised) with a dense first layer
    "renorm": ({}, dict(router_renorm=True, first_dense_layers=1, moe_every=1)),
    # every other layer MoE, the others dense, weights as the softmax gives them, a window of 5
    "sparse_step": (
        dict(
            num_hidden_layers=4,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            norm_topk_prob=False,
            use_sliding_window=True,
            sliding_window=5,
        ),
        dict(router_renorm=False, first_dense_layers=0, moe_every=2, sliding_window=5),
    ),
}


@pytest.mark.parametrize("case", list(QWEN3_MOE_CASES))
def test_qwen3_moe_matches_transformers(tmp_path, case):
    overrides, fields = QWEN3_MOE_CASES[case]
    ref_model = make_qwen3_moe(tmp_path / "hf", **overrides)
    toks = tokens()
    ref = torch_logits(ref_model, toks)
    model = hf.from_pretrained(str(tmp_path / "hf"))
    assert model.model_type == "qwen3_moe"
    assert {f: getattr(model.cfg, f) for f in fields} == fields
    assert model.cfg.qk_norm and model.cfg.attn_head_dim == 16 and not model.cfg.n_shared_experts
    assert np.std(ref) > 0.3
    np.testing.assert_allclose(np.asarray(model(toks)), ref, atol=1e-4, rtol=1e-4)
    # renormalising or not changes the logits
    other = Model(
        dataclasses.replace(model.cfg, router_renorm=not model.cfg.router_renorm), model.params
    )
    assert np.abs(np.asarray(other(toks)) - ref).max() > 1e-3

    reloaded = assert_export_is_exact(model, tmp_path / "hf", tmp_path / "out")
    assert type(reloaded) is type(ref_model)
    np.testing.assert_allclose(torch_logits(reloaded, toks), ref, atol=1e-4, rtol=1e-4)
    assert_cache_matches_forward(model, toks)  # the KV cache (a ring of the window with one)
    np.testing.assert_array_equal(
        np.asarray(model.generate(toks[:1], 6))[0], greedy(ref_model, toks)
    )


def _config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "family,changes,words",
    [
        ("qwen3_moe", dict(mlp_only_layers=[1]), ["mlp_only_layers=[1]", "the first k layers"]),
        ("qwen3_moe", dict(mlp_only_layers="0"), ["mlp_only_layers must be a list"]),
        ("deepseek_v3", dict(attention_bias=True), ["attention_bias=true", "false"]),
        (
            "deepseek_v3",
            dict(quantization_config={"quant_method": "fp8"}),
            ["quantization_config", "bfloat16"],
        ),
        ("deepseek_v3", dict(n_group=3), ["router_groups=3 must divide n_experts=8"]),
        ("deepseek_v3", dict(kv_lora_rank=None), ["kv_lora_rank is missing"]),
    ],
)
def test_refusals_are_one_line(tmp_path, family, changes, words):
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        model_type=family,
        num_experts=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=1,
    )
    with pytest.raises(UserError) as e:
        hf_config.config_from_hf({**base, **changes})
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_export_families_and_refusals():
    ds = preset("deepseek-tiny")
    assert hf_config.model_type_of(ds) == "deepseek_v3"
    qwen = dataclasses.replace(preset("moe-tiny"), qk_norm=True, first_dense_layers=1, n_layers=3)
    out = hf_config.config_to_hf(qwen)
    assert out["model_type"] == "qwen3_moe" and out["mlp_only_layers"] == [0]
    for cfg, words in (
        (dataclasses.replace(ds, router_bias=False, router_bias_rate=0.0), "model.router_bias"),
        (dataclasses.replace(ds, n_shared_experts=0), "model.n_shared_experts=0"),
        (dataclasses.replace(preset("tiny"), kv_lora_rank=16), "model.kv_lora_rank=16"),
        (dataclasses.replace(qwen, router="sigmoid"), "Qwen3-MoE equivalent"),
        (dataclasses.replace(preset("moe-tiny"), router_groups=2), "model.router_groups=2"),
    ):
        with pytest.raises(UserError, match=words):
            hf_config.config_to_hf(cfg)
