"""Which HF tensor a slice of a Brigade layer stack is: the HF layer number of each stack's slices
(dense first layers, the groups' dense and MoE layers, a layer pattern's tail, the multi-token
prediction modules), the head width a row reshapes by, the tail layers' rows, and the tensors a
DeepSeek-V3 checkpoint stores twice. The tables themselves are models/hf.py's."""

from __future__ import annotations

from collections.abc import Callable

from models.config import ModelConfig
from models.hf import Row


def row_dim(row: Row, cfg: ModelConfig) -> int:
    return cfg.head_dim if row.dim is None else row.dim(cfg)


def hf_layer(cfg: ModelConfig, row: Row) -> Callable[[int], int]:
    """The HF layer number of slice j of the row's Brigade layer stack (the first part of its
    path). HF numbers layers 0..L-1 in order, the multi-token prediction modules after them (L,
    L+1 ..., DeepSeek-V3's layout); Brigade's dense first layers come first, then groups of
    moe_every layers, moe_every - 1 dense (`blocks`) and one MoE (`moe_blocks`); a tail stack's
    slice 0 is the row's `first_layer`."""
    stack = row.brigade.split("/")[0]
    first, per = cfg.first_dense_layers, (cfg.moe_every if cfg.n_experts else 1)
    if stack == "mtp":
        return lambda j: cfg.n_layers + j
    if stack == "moe_blocks":
        return lambda j: first + j * per + per - 1
    if stack == "blocks" and per > 1:
        return lambda j: first + j // (per - 1) * per + j % (per - 1)
    return lambda j: row.first_layer + j


def with_tail(rows: tuple[Row, ...], cfg: ModelConfig) -> list[Row]:
    """`rows` plus, for a model with tail layers (the layers past its layer pattern's last whole
    repeat: models/layer_pattern.py), each dense layer row again for the `tail_blocks` stack,
    whose index 0 is the HF layer after the groups'."""
    from models.pieces import layers_per_group, n_groups_and_tail

    n_groups, tail = n_groups_and_tail(cfg)
    if not tail:
        return list(rows)
    first = n_groups * layers_per_group(cfg)
    return list(rows) + [
        r._replace(brigade="tail_" + r.brigade, first_layer=first)
        for r in rows
        if r.brigade.startswith("blocks/")
    ]


def shared_copies(model_type: str, cfg: ModelConfig) -> dict[str, str]:
    """HF tensors that repeat another, {copy: original}: DeepSeek-V3's multi-token prediction
    modules store the model's embedding and LM head again (`embed_tokens`, `shared_head.head`),
    which they share. Import reads the originals only; export writes the copies too."""
    if model_type != "deepseek_v3":
        return {}
    out = {}
    for j in range(cfg.mtp_layers):
        layer = f"model.layers.{cfg.n_layers + j}."
        out[layer + "embed_tokens.weight"] = "model.embed_tokens.weight"
        if not cfg.tie_embeddings:
            out[layer + "shared_head.head.weight"] = "lm_head.weight"
    return out
