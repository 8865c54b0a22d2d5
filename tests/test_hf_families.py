"""The HuggingFace families beyond Llama/Mixtral: Qwen2/2.5 (q/k/v biases), Qwen3 (per-head q/k
RMSNorm, a head_dim apart from hidden/heads) and Mistral (sliding-window attention). Each: a tiny
random transformers model saved locally -> import -> logits within 1e-4 of transformers'; export
-> re-import bit-exact, transformers loads the export to the same logits, greedy generation with the
KV cache picks HF's tokens. Then the options themselves: the window in packed documents, training
sharded with all three on, and the refusals, one line each."""

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
from models import flops, hf_config  # noqa: E402
from models import model as model_lib  # noqa: E402
from models.hf import ROWS, Model  # noqa: E402
from models.presets import preset  # noqa: E402

CLASSES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}
CASES = {  # family -> (config overrides, the ModelConfig fields the import must set)
    # Qwen2.5-0.5B's shape of things: tied embeddings, GQA; every layer sliding
    # (max_window_layers 0)
    "qwen2": (
        dict(
            tie_word_embeddings=True, use_sliding_window=True, sliding_window=5, max_window_layers=0
        ),
        dict(qkv_bias=True, sliding_window=5, tie_embeddings=True),
    ),
    # Qwen3-0.6B's: head_dim 16 where hidden/heads is 8
    "qwen3": (dict(head_dim=16), dict(qk_norm=True, attn_head_dim=16)),
    "mistral": (dict(sliding_window=4), dict(sliding_window=4)),
}


def make_family(path, family, **overrides):
    """A random tiny model of `family` saved to `path`; biases and norm weights random too, so a
    dropped or swapped one shows in the logits."""
    kw = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )
    kw.update(overrides)
    config_cls, model_cls = CLASSES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", list(CASES))
def test_import_export_generate_match_transformers(tmp_path, family):
    overrides, fields = CASES[family]
    ref_model = make_family(tmp_path / "hf", family, **overrides)
    toks = tokens()
    ref = torch_logits(ref_model, toks)
    model = hf.from_pretrained(str(tmp_path / "hf"))
    assert model.model_type == family
    assert {f: getattr(model.cfg, f) for f in fields} == fields
    assert np.std(ref) > 0.3  # logits large enough that 1e-4 is a real test
    np.testing.assert_allclose(np.asarray(model(toks)), ref, atol=1e-4, rtol=1e-4)
    if model.cfg.sliding_window:  # the window is shorter than the 11 tokens: it must matter
        full = Model(dataclasses.replace(model.cfg, sliding_window=0), model.params)
        assert np.abs(np.asarray(full(toks)) - ref).max() > 1e-2

    reloaded = assert_export_is_exact(model, tmp_path / "hf", tmp_path / "out")
    assert type(reloaded) is type(ref_model)
    np.testing.assert_allclose(torch_logits(reloaded, toks), ref, atol=1e-4, rtol=1e-4)

    with torch.no_grad():  # 11 prompt + 6 new tokens: past the window, through the KV cache
        want = ref_model.generate(
            torch.from_numpy(toks[:1].astype(np.int64)),
            max_new_tokens=6,
            do_sample=False,
            min_new_tokens=6,
        ).numpy()[0, toks.shape[1] :]
    np.testing.assert_array_equal(np.asarray(model.generate(toks[:1], 6))[0], want)


def test_sliding_window_in_packed_documents():
    """Packed documents with a window: each document's logits are its logits alone (the window
    counts positions inside the document), and the window changes them."""
    cfg = dataclasses.replace(
        preset("tiny"), dtype="float32", sliding_window=3, qkv_bias=True, qk_norm=True
    ).validate()
    apply = jax.jit(model_lib.apply, static_argnums=0)
    params = jax.jit(model_lib.init, static_argnums=0)(cfg, jax.random.key(0))
    toks_BT = jnp.asarray(tokens(vocab=cfg.vocab_size, shape=(1, 16)))
    packed = apply(cfg, params, toks_BT, None, None, jnp.asarray([[0] * 8 + [1] * 8]))[0]
    alone = apply(cfg, params, toks_BT.reshape(2, 8))[0]  # the two documents as a batch of two
    np.testing.assert_allclose(
        np.asarray(packed), np.asarray(alone).reshape(1, 16, -1), atol=1e-5, rtol=1e-5
    )
    unwindowed = apply(dataclasses.replace(cfg, sliding_window=0), params, toks_BT.reshape(2, 8))[0]
    assert np.abs(np.asarray(unwindowed - alone)).max() > 1e-3


def test_training_sharded_with_bias_norm_and_window(tmp_path):
    """A few steps on data=2,fsdp=2,model=2 with all three options: the loss is finite, the new
    parameters learn, and they are sharded as the projections' head dims (model) or replicated."""
    from equivalence import initial_params, make_trainer, run_steps, synthetic_batches

    tr = make_trainer(
        "data=2,fsdp=2,model=2",
        tmp_path,
        **{
            "model.preset": "tiny",
            "model.qkv_bias": True,
            "model.qk_norm": True,
            "model.sliding_window": 8,
        },
    )
    out = run_steps(tr, synthetic_batches(tr.setup.model_cfg.vocab_size, n=3), initial_params(tr))
    assert all(np.isfinite(m["loss"]) for m in out["metrics"])
    attn = out["state"].params["blocks"]["attn"]
    for name, shard in (("bq_NH", (2, 2, 16)), ("bk_KH", (2, 1, 16)), ("bv_KH", (2, 1, 16))):
        assert tuple(attn[name].sharding.spec)[1:] == ("model", None), name
        assert attn[name].sharding.shard_shape(attn[name].shape) == shard, name
        # zeros at init, trained
        assert np.abs(np.asarray(jax.device_get(attn[name]))).max() > 0, name
    for name in ("q_norm", "k_norm"):
        scale = attn[name]["scale"]
        assert scale.shape == (2, 16) and scale.sharding.is_fully_replicated
        assert np.abs(np.asarray(jax.device_get(scale)) - 1).max() > 0, name


def test_every_family_has_tables_and_a_config_mapping():
    """models/hf.py's tensor tables and models/hf_config.py's config.json families name the same
    architectures: one added to only one would import a config whose tensors nothing converts."""
    assert set(ROWS) == set(hf_config.ARCHITECTURES)


def test_export_families_and_flops():
    tiny = preset("tiny")
    for fields, family in (
        (dict(), "llama"),
        (dict(sliding_window=8), "mistral"),
        (dict(attn_head_dim=32), "mistral"),
        (dict(qkv_bias=True, sliding_window=8), "qwen2"),
        (dict(qk_norm=True), "qwen3"),
    ):
        assert hf_config.model_type_of(dataclasses.replace(tiny, **fields)) == family, fields
    qwen2 = hf_config.config_to_hf(dataclasses.replace(tiny, qkv_bias=True, sliding_window=8))
    assert qwen2["use_sliding_window"] and qwen2["layer_types"] == ["sliding_attention"] * 2
    # biases and q/k norms are additions, not matmuls; a window bounds the keys each query scores
    assert flops.matmul_param_count(
        dataclasses.replace(tiny, qkv_bias=True, qk_norm=True)
    ) == flops.matmul_param_count(tiny)
    assert flops.flops_per_token(
        dataclasses.replace(tiny, sliding_window=32), 128
    ) == flops.flops_per_token(tiny, 32)
    assert flops.flops_per_token(
        dataclasses.replace(tiny, sliding_window=256), 128
    ) == flops.flops_per_token(tiny, 128)


BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_hf_window_semantics():
    """A window Qwen turns off (use_sliding_window false) is no window, as in transformers;
    Mistral and Mixtral read sliding_window alone."""
    off = dict(
        BASE, model_type="qwen2", use_sliding_window=False, sliding_window=4, max_window_layers=0
    )
    assert hf_config.config_from_hf(off)[1].sliding_window == 0
    assert hf_config.config_from_hf(dict(off, use_sliding_window=True))[1].sliding_window == 4
    assert (
        hf_config.config_from_hf(dict(BASE, model_type="mistral", sliding_window=4))[
            1
        ].sliding_window
        == 4
    )
    mixtral = dict(
        BASE, model_type="mixtral", sliding_window=4, num_local_experts=4, num_experts_per_tok=2
    )
    assert hf_config.config_from_hf(mixtral)[1].sliding_window == 4


@pytest.mark.parametrize(
    "config,words",
    [
        (
            dict(model_type="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            ['rope_scaling.rope_type="yarn"', "default"],
        ),
        (
            dict(
                model_type="mistral",
                rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
            ),
            ['rope_parameters.rope_type="linear"'],
        ),
        (
            dict(
                model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1
            ),
            ["max_window_layers=1", "all sliding_attention"],
        ),
        (
            dict(
                model_type="qwen3",
                use_sliding_window=True,
                sliding_window=4,
                layer_types=["full_attention", "sliding_attention"],
            ),
            ["layer_types=", "all full_attention"],
        ),
        (dict(model_type="qwen3", attention_bias=True), ["attention_bias=true", "false"]),
        (dict(model_type="llama", sliding_window=4), ["sliding_window=4", "null"]),
        (
            dict(model_type="qwen2", max_window_layers=-1),
            ["max_window_layers", "a non-negative integer"],
        ),
    ],
)
def test_unsupported_config_is_one_line(config, words):
    with pytest.raises(UserError) as e:
        hf_config.config_from_hf(dict(BASE, **config))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_bad_options_are_one_line():
    from train.core.config import build

    with pytest.raises(UserError, match=r"^--model.sliding_window -1: must be an integer >= 0$"):
        build({"model.preset": "tiny", "model.sliding_window": -1})
    with pytest.raises(
        UserError, match="model.qkv_bias=True with model.qk_norm=True has no HuggingFace"
    ):
        hf_config.config_to_hf(dataclasses.replace(preset("tiny"), qkv_bias=True, qk_norm=True))
    # an MoE model with q/k norms is Qwen3-MoE (tests/test_hf_moe_families.py); with q/k/v biases,
    # no family
    with pytest.raises(
        UserError, match="model.qkv_bias=True has no HuggingFace Mixtral equivalent"
    ):
        hf_config.config_to_hf(dataclasses.replace(preset("moe-tiny"), qkv_bias=True))


def test_qkv_biases_and_qk_norms_get_no_weight_decay():
    from train.core import optim

    cfg = dataclasses.replace(preset("tiny"), qkv_bias=True)
    attn = optim.decay_mask(model_lib.abstract_params(cfg), decay_embeddings=False)["blocks"][
        "attn"
    ]
    assert attn["wq_DNH"] is True and not any(attn[b] for b in ("bq_NH", "bk_KH", "bv_KH"))
    normed = optim.decay_mask(
        model_lib.abstract_params(dataclasses.replace(preset("tiny"), qk_norm=True)), False
    )
    assert (
        normed["blocks"]["attn"]["q_norm"]["scale"] is False
        and normed["blocks"]["attn"]["k_norm"]["scale"] is False
    )
