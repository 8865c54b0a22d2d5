"""What the new families still refuse, through the command a user runs (`hf import`): a Gemma 3
checkpoint with its vision tower, a DeepSeek-V3 checkpoint stored in FP8 and Qwen3-MoE dense layers
between MoE ones each exit 2 with one line naming the key, and write nothing. Then the new model
fields' rules (latent attention, group-limited routing, dense first layers, a layer pattern beside
them): one line naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from checkpoint.__main__ import main as checkpoint_main
from errors import UserError
from models.presets import preset

TEXT = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
CASES = {
    "gemma3_vision": (
        dict(
            model_type="gemma3",
            architectures=["Gemma3ForConditionalGeneration"],
            text_config=dict(TEXT, model_type="gemma3_text"),
            vision_config={"hidden_size": 8, "model_type": "siglip_vision_model"},
        ),
        ["vision_config", "gemma3_text"],
    ),
    "deepseek_fp8": (
        dict(
            TEXT,
            **MOE,
            model_type="deepseek_v3",
            n_routed_experts=8,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            quantization_config={"quant_method": "fp8", "fmt": "e4m3"},
        ),
        ["quantization_config"],
    ),
    "qwen3_moe_mlp_only": (
        dict(TEXT, **MOE, model_type="qwen3_moe", num_experts=8, mlp_only_layers=[1]),
        ["mlp_only_layers=[1]"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_import_refuses_in_one_line_naming_the_key(tmp_path, capsys, case):
    config, words = CASES[case]
    src, out = tmp_path / "hf", tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors").write_bytes(b"")
    assert checkpoint_main(["hf", "import", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    assert all(w in err for w in words), err
    assert not out.exists()


@pytest.mark.parametrize(
    "name,fields,words",
    [
        ("deepseek-tiny", dict(qk_rope_head_dim=7), ["qk_rope_head_dim=7", "even"]),
        ("tiny", dict(q_lora_rank=16), ["q_lora_rank=16", "kv_lora_rank > 0"]),
        ("deepseek-tiny", dict(qk_norm=True), ["latent attention", "qk_norm"]),
        ("tiny", dict(first_dense_layers=1), ["first_dense_layers=1", "n_experts > 0"]),
        ("deepseek-tiny", dict(first_dense_layers=3), ["first_dense_layers=3", "n_layers=3"]),
        ("deepseek-tiny", dict(router_groups=3), ["router_groups=3", "valid: [1, 2, 4]"]),
        (
            "deepseek-tiny",
            dict(router_topk_groups=1, experts_per_token=3),
            ["router_topk_groups=1"],
        ),
        (
            "deepseek-tiny",
            dict(layer_pattern="LG", sliding_window=4, moe_every=2, n_layers=5),
            ["layer_pattern 'LG'", "first_dense_layers=1"],
        ),
    ],
)
def test_new_fields_rules_are_one_line(name, fields, words):
    with pytest.raises(UserError) as e:
        dataclasses.replace(preset(name), **fields).validate()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
