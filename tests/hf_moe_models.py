"""Tiny random DeepSeek-V3 and Qwen3-MoE checkpoints made with the installed transformers, for the
HF tests of those families (tests/test_hf_moe_families.py) and the MTP tests (tests/test_mtp.py).

transformers' DeepseekV3ForCausalLM saves no multi-token prediction layer (it ignores the published
checkpoints' `model.layers.61.*`), but its generic MtpModel builds one from the main model (an
MtpLayer: enorm, hnorm, eh_proj, the decoder layer, post_norm; the embedding and head shared). So
the tiny checkpoints get their MTP layers from a random MtpModel, written under the names the
published DeepSeek-V3 checkpoints use (the layer after the last: its decoder-layer tensors, enorm,
hnorm, eh_proj, shared_head.norm, and copies of embed_tokens and shared_head.head), and the same
MtpModel computes the reference MTP logits.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers.modeling_layers import MtpModel

DEEPSEEK = dict(  # every option that changes the math on, the MTP module included
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    rope_interleave=True,
    num_mtp_layers=1,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)
QWEN3_MOE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
)


def _randomise(model) -> None:
    """Norm weights and the routing bias random too, so that a dropped or swapped one shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)


def make_qwen3_moe(path, **overrides):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **overrides})
    ).eval()
    _randomise(model)
    model.save_pretrained(path)
    return model


def make_deepseek(path, **overrides):
    """-> (the DeepseekV3ForCausalLM, its MtpModel or None), saved to `path` with the MTP layers."""
    kw = {**DEEPSEEK, **overrides}
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).eval()
    _randomise(model)
    model.save_pretrained(path)
    if not kw["num_mtp_layers"]:
        return model, None
    mtp = MtpModel(model, kw["num_mtp_layers"]).eval()
    with torch.no_grad():  # MtpModel leaves some weights (the fused experts) uninitialised
        for name, p in mtp.named_parameters():
            if not name.startswith(("embed_tokens.", "shared_head.")):
                p.normal_(0.0, kw["initializer_range"])
    _randomise(mtp)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update(mtp_tensors(mtp, kw["num_hidden_layers"], kw["moe_intermediate_size"]))
    save_file(tensors, str(file), metadata={"format": "pt"})
    return model, mtp


def mtp_tensors(mtp, n_layers: int, expert_width: int) -> dict[str, np.ndarray]:
    """An MtpModel's weights under the published DeepSeek-V3 names (experts unfused)."""
    out = {}
    for name, t in mtp.state_dict().items():
        t = t.detach().numpy()
        if name.startswith(("embed_tokens.", "shared_head.")):
            continue  # the main model's own, stored again below
        k, rest = name.removeprefix("layers.").split(".", 1)
        base = f"model.layers.{n_layers + int(k)}."
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[base + f"mlp.experts.{e}.gate_proj.weight"] = t[e, :expert_width].copy()
                out[base + f"mlp.experts.{e}.up_proj.weight"] = t[e, expert_width:].copy()
        elif rest.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[base + f"mlp.experts.{e}.down_proj.weight"] = t[e].copy()
        else:
            out[base + rest] = t.copy()
    for k in range(mtp.num_mtp_layers):
        base = f"model.layers.{n_layers + k}."
        out[base + "embed_tokens.weight"] = mtp.embed_tokens.weight.detach().numpy().copy()
        out[base + "shared_head.head.weight"] = mtp.shared_head.weight.detach().numpy().copy()
    return out


def load_mtp(model, folder) -> MtpModel:
    """An MtpModel on `model` with the MTP weights of the checkpoint in `folder` (published
    names): what an export's MTP layers compute in transformers."""
    cfg = model.config
    mtp = MtpModel(model, cfg.num_mtp_layers).eval()
    tensors = load_file(str(folder / "model.safetensors"))
    state = {}
    width = cfg.moe_intermediate_size
    for k in range(cfg.num_mtp_layers):
        base, ours = f"model.layers.{cfg.num_hidden_layers + k}.", f"layers.{k}."
        for name in [n for n in tensors if n.startswith(base)]:
            rest = name[len(base) :]
            if rest.startswith(("embed_tokens.", "shared_head.head.", "mlp.experts.")):
                continue
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                state[ours + rest] = tensors[name]
            elif rest.startswith("shared_head.norm."):
                state[ours + "post_norm.weight"] = tensors[name]
            else:
                state[ours + "mtp_block." + rest] = tensors[name]
        n_exp = cfg.n_routed_experts
        state[ours + "mtp_block.mlp.experts.gate_up_proj"] = np.stack(
            [
                np.concatenate(
                    [
                        tensors[base + f"mlp.experts.{e}.gate_proj.weight"],
                        tensors[base + f"mlp.experts.{e}.up_proj.weight"],
                    ]
                )
                for e in range(n_exp)
            ]
        )
        state[ours + "mtp_block.mlp.experts.down_proj"] = np.stack(
            [tensors[base + f"mlp.experts.{e}.down_proj.weight"] for e in range(n_exp)]
        )
        assert state[ours + "mtp_block.mlp.experts.gate_up_proj"].shape[1] == 2 * width
    missing, unexpected = mtp.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}, (
        missing,
        unexpected,
    )
    mtp.tie_with_main_model(model)
    return mtp


def mtp_logits(model, mtp, toks: np.ndarray) -> list[np.ndarray]:
    """transformers' MTP logits, depth by depth, for every position whose tokens k ahead exist:
    depth k at position i reads the main model's final-normed state at i (k = 1) or depth k-1's
    state at i, and token i + k; [B, T - k, V] each."""
    ids = torch.from_numpy(toks.astype(np.int64))
    t = toks.shape[1]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1]
        logits = []
        for k in range(1, mtp.num_mtp_layers + 1):
            positions = torch.arange(k, t)[None].expand(toks.shape[0], -1)
            h = mtp.forward_layer(k - 1, h[:, : t - k], positions, None, input_ids=ids[:, k:])
            logits.append(mtp._project_to_logits(h).numpy())
    return logits
