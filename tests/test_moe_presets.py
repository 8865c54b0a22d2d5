"""The MoE family presets' parameter counts against the published ones: Qwen3-30B-A3B (its model
card: 30.5B in all) and DeepSeek-V3 (DeepSeek-V3 Technical Report, arXiv:2412.19437: 671B in the
main model, 685B in the checkpoint with the MTP module, which stores the embedding and the LM head
again where Brigade's module shares them)."""

import pytest

from models import flops
from models.presets import preset


@pytest.mark.parametrize(
    "name, main_published, stored_published",
    [("qwen3-30b-a3b", 30.5e9, 30.5e9), ("deepseek-v3", 671e9, 685e9)],
)
def test_moe_presets_match_the_published_parameter_counts(name, main_published, stored_published):
    cfg = preset(name).validate()
    total, mtp = flops.param_count(cfg), flops.mtp_param_count(cfg)
    assert abs((total - mtp) / main_published - 1) < 0.01, (name, total - mtp)
    copies = 2 * cfg.vocab_size * cfg.d_model * cfg.mtp_layers
    assert abs((total + copies) / stored_published - 1) < 0.01, (name, total + copies)
