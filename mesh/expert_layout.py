"""Where the FSDP axes put the MoE experts' weights: sliced (each device keeps a 1/fsdp slice of
every expert its `expert` shard holds, gathered before each use, as every other weight) or whole
(the experts themselves split over the FSDP axes as well as `expert`, so each device keeps whole
experts and the tokens travel to them in the all-to-all that expert parallelism already makes).

Both keep 1/(expert x fsdp) of the expert weights and their optimizer state on a device; they
differ in what moves per layer:
- sliced: the local experts' weights are gathered over FSDP for the forward and again for the
  remat recompute, and their gradient is reduce-scattered; the tokens cross `expert` only;
- whole: no weight moves (and no gradient is reduced over FSDP: each expert lives on one device of
  its data-parallel group); the tokens cross expert x fsdp devices, in larger all-to-alls.
Whole experts over the devices that split the batch is GShard's layout (Lepikhin et al. 2020,
https://arxiv.org/abs/2006.16668: the experts dim sharded over the same devices as the tokens, which
reach them by all-to-all). `--parallelism.experts_over_fsdp auto` takes it where it moves fewer
bytes per device and step (few tokens per device against large experts) without holding more at
once (its receive buffer, which grows with the devices it spans, against the sliced layout's buffer
and gathered weights). A bytes count, like vocab_parallel's (mesh/rules.py head_layout); it does
not weigh links of different speeds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from errors import UserError
from mesh.rules import DEFAULT_RULES, MeshAxes

# the names the layout rewrites: a user override of either is kept as written under `auto`
EXPERT_NAMES = ("experts", "expert_embed")


def experts_over_fsdp(rules: Mapping[str, MeshAxes], sizes: Mapping[str, int]) -> dict:
    """`rules` with the experts dim also sharded over the axes that shard the experts' d_model dim
    and the batch (FSDP's; not `context`, whose devices split a sequence, not its tokens' routing),
    and that d_model dim then whole."""
    borrow = _borrowed(rules, sizes)
    return {
        **rules,
        "experts": (*rules["experts"], *borrow),
        "expert_embed": tuple(a for a in rules["expert_embed"] if a not in borrow),
    }


def _borrowed(rules: Mapping[str, MeshAxes], sizes: Mapping[str, int]) -> MeshAxes:
    return tuple(
        a
        for a in rules["expert_embed"]
        if a in rules["batch"] and a not in rules["experts"] and sizes.get(a, 1) > 1
    )


def moved_bytes(rules: Mapping[str, MeshAxes], sizes: Mapping[str, int], **moe) -> float:
    """Bytes one device sends or gathers per MoE layer and micro-batch under `rules`: the tokens'
    all-to-alls over the experts' axes (forward, remat, backward; both directions) and the expert
    weights' FSDP gathers (forward, remat) and gradient reduce-scatter. `moe`: n_experts, k,
    tokens (one device's, per micro-batch), d_model, d_ff, act_bytes, grad_bytes, exchange
    ("fixed": worst-case buffers, models/moe_dispatch.py; "ragged": the real rows; "capacity":
    the capacity-factor buffers), capacity_factor, remat."""
    ep, n_f, _, rows, weights = _layer(rules, sizes, **moe)
    passes = 3 if moe["remat"] else 2
    exchanged = 2 * passes * rows * moe["d_model"] * moe["act_bytes"] * (ep - 1) / ep
    per_weight = (passes - 1) * moe["act_bytes"] + moe["grad_bytes"]
    return exchanged + weights * per_weight * (n_f - 1) / n_f


def held_bytes(rules: Mapping[str, MeshAxes], sizes: Mapping[str, int], **moe) -> float:
    """Bytes one device holds for a moment per MoE layer under `rules`: the exchange's receive
    buffer (its worst case: the ragged exchange too keeps the fixed one's size) and the local
    experts' gathered weights. Whole experts over many devices grow the buffer (a token may send a
    row to each of min(k, experts per device) experts of every device)."""
    _, n_f, buffer, _, weights = _layer(rules, sizes, **moe)
    return (buffer * moe["d_model"] + (weights if n_f > 1 else 0)) * moe["act_bytes"]


def _layer(rules, sizes, *, n_experts, k, tokens, d_model, d_ff, exchange, capacity_factor, **_):
    """(expert-parallel devices, FSDP slices of an expert, receive-buffer rows, rows moved, the
    local experts' weights' elements) of one device under `rules`."""

    def size(axes) -> int:
        return math.prod(sizes.get(a, 1) for a in axes)

    ep, n_f = size(rules["experts"]), size(rules["expert_embed"])
    # a token sends at most min(k, experts per device) rows to one device
    buffer = ep * tokens * min(k, n_experts // ep)
    if exchange == "capacity":
        buffer = n_experts * max(1, math.ceil(capacity_factor * tokens * k / n_experts))
    rows = tokens * k if exchange == "ragged" else buffer
    weights = (n_experts // ep) * 3 * d_model * d_ff / size(rules["expert_mlp"])
    return ep, n_f, buffer, rows, weights


def expert_layout(
    rules: Mapping[str, MeshAxes], mode: str, sizes: Mapping[str, int], **moe
) -> dict:
    """`rules` with the experts' layout that --parallelism.experts_over_fsdp `mode` (auto|on|off)
    picks on a mesh of these axis sizes; `moe`: moved_bytes' keywords (n_experts 0: a dense model,
    unchanged). `auto` takes whole experts where they move fewer bytes without holding more (the
    receive buffer against the gathered weights), and the expert x FSDP devices divide the
    experts; it keeps a layout the user wrote (a rule of EXPERT_NAMES overridden)."""
    n_experts = moe["n_experts"]
    if mode == "off" or not n_experts or not _borrowed(rules, sizes):
        return dict(rules)
    whole = experts_over_fsdp(rules, sizes)
    devices = math.prod(sizes.get(a, 1) for a in whole["experts"])
    if n_experts % devices:
        if mode == "on":
            axes = " x ".join(f"{a}={sizes.get(a, 1)}" for a in whole["experts"])
            raise UserError(
                f"--parallelism.experts_over_fsdp on: model.n_experts={n_experts} is not divisible"
                f" by {axes} = {devices} devices; use a multiple of {devices} experts, or auto"
                " (which keeps the experts sliced over FSDP here) or off"
            )
        return dict(rules)
    if mode == "auto" and (
        any(rules[n] != DEFAULT_RULES[n] for n in EXPERT_NAMES)
        or moved_bytes(whole, sizes, **moe) >= moved_bytes(rules, sizes, **moe)
        or held_bytes(whole, sizes, **moe) > held_bytes(rules, sizes, **moe)
    ):
        return dict(rules)
    return whole


def describe(rules: Mapping[str, MeshAxes], mode: str, sizes: Mapping[str, int]) -> str:
    """The start line's words for the experts' layout under `rules`: `experts whole over
    expert=2 x fsdp=4 (experts_over_fsdp auto)` or `experts over expert=2, sliced over fsdp=4
    (...)`; "" when no FSDP axis shards them either way."""
    sliced = tuple(a for a in rules["expert_embed"] if sizes.get(a, 1) > 1)
    spread = tuple(a for a in rules["experts"] if sizes.get(a, 1) > 1)
    borrowed = [a for a in spread if a in DEFAULT_RULES["expert_embed"]]
    if not sliced and not borrowed:
        return ""

    def axes(names) -> str:
        return " x ".join(f"{a}={sizes[a]}" for a in names)

    if borrowed:
        how = f"whole over {axes(spread)}"
    else:
        how = (
            f"over {axes(spread)}, sliced over {axes(sliced)}"
            if spread
            else f"sliced over {axes(sliced)}"
        )
    return f"experts {how} (experts_over_fsdp {mode})"
