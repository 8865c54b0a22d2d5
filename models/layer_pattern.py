"""Per-layer attention patterns: which layers attend locally (a sliding window, their own RoPE base)
and which globally, and how the decoder's repeating layer group carries them.

`model.layer_pattern` is a string of L (local) and G (global) repeated over the layers: Gemma 2 is
LG (layer 0 local, 1 global, ...), Gemma 3 LLLLLG. The pattern is the decoder's repeating layer
group (models/pieces.py): a group's layers are a Python loop in which layer j reads its own
`LayerSpec`, so the scan over the groups and every pipeline schedule (which split the stack by
groups) run the pattern without knowing of it, and no layer computes a branch it does not take.
Layers past the last whole repeat (Gemma 3 4B: 34 = 5 x 6 + 4) are the tail: a stack of their own,
run after the groups (as MaxText runs the remainder of its scanned Gemma 3 blocks); under a
pipeline on the last stage, with the head.

What varies from layer to layer is a `LayerSpec`, static at trace time; a new kind of layer (another
attention, ...) is a field there and a letter here. No JAX at import: models/config.py validates
with it while flags are parsed.
"""

from __future__ import annotations

from typing import NamedTuple

LOCAL, GLOBAL = "L", "G"
KINDS = {LOCAL: "local (sliding_window keys)", GLOBAL: "global (the whole causal prefix)"}


class LayerSpec(NamedTuple):
    """What one layer does differently from the others."""

    window: int  # keys a query sees, its own included; 0 = the whole causal prefix
    rope: tuple  # models.layers.rope's (theta, llama3 scaling or None, linear factor)


def period(cfg) -> int:
    """Layers in one repeat of the pattern (1 without a pattern)."""
    return len(cfg.layer_pattern) or 1


def spec(cfg, kind: str | None) -> LayerSpec:
    """The spec of a layer of `kind` (None: no pattern, every layer as the config says)."""
    if kind == LOCAL:
        return LayerSpec(cfg.sliding_window, (cfg.rope_local_theta or cfg.rope_theta, None, 1.0))
    window = 0 if kind == GLOBAL else cfg.sliding_window
    return LayerSpec(window, (cfg.rope_theta, cfg.rope_scaling, cfg.rope_linear_factor))


def layer_specs(cfg) -> tuple[LayerSpec, ...]:
    """One spec per layer, in order."""
    if not cfg.layer_pattern:
        return (spec(cfg, None),) * cfg.n_layers
    p = period(cfg)
    return tuple(spec(cfg, cfg.layer_pattern[i % p]) for i in range(cfg.n_layers))


def layer_kinds(cfg) -> list[str]:
    """The pattern spelled out over the layers (every layer GLOBAL-or-window-alike: '')."""
    p = period(cfg)
    return [cfg.layer_pattern[i % p] if cfg.layer_pattern else "" for i in range(cfg.n_layers)]


def shortest_period(kinds: list[str]) -> str:
    """The shortest string whose repeats begin `kinds` (a list of L/G) wholly: the pattern a layer
    list repeats ('LLLLLG' for Gemma 3's 34 layers); the whole list where nothing repeats."""
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return "".join(kinds[:p])
    return ""


def validate(cfg, need) -> None:
    """The pattern's rules (need(ok, message) raises the section's one-line error)."""
    pattern = cfg.layer_pattern
    bad = sorted(set(pattern) - set(KINDS))
    need(
        not bad,
        f"layer_pattern '{pattern}' has {', '.join(map(repr, bad))}; valid letters: "
        + ", ".join(f"{k} = {v}" for k, v in KINDS.items()),
    )
    need(
        len(pattern) <= cfg.n_layers,
        f"layer_pattern '{pattern}' is longer than n_layers={cfg.n_layers}",
    )
    need(
        LOCAL not in pattern or cfg.sliding_window > 0,
        f"layer_pattern '{pattern}' has local layers ({LOCAL}), which need sliding_window > 0",
    )
    need(
        not (cfg.rope_linear_factor != 1.0 and cfg.rope_scaling_factor != 1.0),
        f"rope_linear_factor={cfg.rope_linear_factor} and rope_scaling_factor="
        f"{cfg.rope_scaling_factor} are two RoPE scalings; set one of them to 1",
    )
    if cfg.n_experts and pattern:
        need(
            cfg.moe_every % period(cfg) == 0,
            f"layer_pattern '{pattern}' ({period(cfg)} layers) must divide moe_every="
            f"{cfg.moe_every} in an MoE model (the repeating group is moe_every layers)",
        )


class PatternCache(NamedTuple):
    """The decoding cache of a model with a layer pattern, whose layers keep caches of different
    lengths (a local layer a ring of its window: models/window_cache.py): `groups`, one
    models.attention.KVCache per position in the repeating group, each [G, B, S_j, K, H]; `tail`,
    one [B, S_i, K, H] per tail layer."""

    groups: tuple
    tail: tuple
