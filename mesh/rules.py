"""THE logical-axis -> mesh-axis table.

Models name every array dimension with a logical axis; this table alone decides which mesh
axes shard it. Parameters and activations use different names for the model dimension
(`embed` vs `act_embed`) because FSDP shards the weights' embed dim but never the activations'.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Mapping

from jax.sharding import PartitionSpec as P

from mesh.spec import AXES
from errors import UserError

MeshAxes = tuple[str, ...]  # () = replicated

DEFAULT_RULES: dict[str, MeshAxes] = {
    # activations
    "batch": ("data", "fsdp", "expert"),  # the expert axis acts as data parallel outside MoE layers
    "seq": (),
    "act_embed": (),
    "act_mlp": ("model",),
    "act_heads": ("model",),
    "act_kv_heads": ("model",),
    "act_vocab": ("model",),
    # parameters
    "embed": ("fsdp",),
    "mlp": ("model",),
    "heads": ("model",),
    "kv_heads": ("model",),
    "head_dim": (),
    "vocab": ("model",),
    "norm": (),
    "layers": ("pipeline",),      # each pipeline device stores (and optimises) only its stage; no-op at pipeline=1
    "experts": ("expert",),       # expert parallelism: each device holds n_experts / expert of them
    "expert_mlp": ("model",),     # tensor parallelism inside each expert
    "router_experts": (),         # the router's expert dim: every device routes its own tokens to all experts
    "stages": ("pipeline",),
}

# The config option that sets each parameter dim's size, so that a divisibility error names what to change.
HINTS = {"heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "mlp": "model.d_ff", "embed": "model.d_model",
         "vocab": "model.vocab_size", "layers": "model.n_layers", "experts": "model.n_experts",
         "expert_mlp": "model.d_ff_expert", "router_experts": "model.n_experts"}

_RULES: contextvars.ContextVar[Mapping[str, MeshAxes]] = contextvars.ContextVar("rules", default=DEFAULT_RULES)


def parse_overrides(spec: str | Mapping | None) -> dict[str, MeshAxes]:
    """`'embed=fsdp+model,vocab=none'` or a YAML mapping -> {'embed': ('fsdp','model'), 'vocab': ()}."""
    if not spec:
        return {}
    if isinstance(spec, str):
        pairs = []
        for part in spec.split(","):
            if "=" not in part:
                raise UserError(f"--parallelism.rules: '{part}' is not name=axis[+axis]; example: embed=fsdp,vocab=none")
            name, _, value = part.partition("=")
            pairs.append((name.strip(), value.strip()))
    else:
        pairs = list(spec.items())
    out: dict[str, MeshAxes] = {}
    for name, value in pairs:
        if name not in DEFAULT_RULES:
            raise UserError(f"--parallelism.rules: unknown logical axis '{name}'; valid: {', '.join(DEFAULT_RULES)}")
        if value is None or value in ("", "none", "None", []):
            axes: MeshAxes = ()
        elif isinstance(value, str):
            axes = tuple(a.strip() for a in value.split("+"))
        else:
            axes = tuple(value)
        for a in axes:
            if a not in AXES:
                raise UserError(f"--parallelism.rules: '{name}' maps to unknown mesh axis '{a}'; valid: {', '.join(AXES)}")
        out[name] = axes
    return out


def make_rules(overrides: str | Mapping | None = None) -> dict[str, MeshAxes]:
    return {**DEFAULT_RULES, **parse_overrides(overrides)}


@contextlib.contextmanager
def axis_rules(rules: Mapping[str, MeshAxes]):
    """Make `rules` the table that `logical_to_spec` (and model constraints) read while tracing."""
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules() -> Mapping[str, MeshAxes]:
    return _RULES.get()


def logical_to_spec(names: tuple[str | None, ...], rules: Mapping[str, MeshAxes] | None = None) -> P:
    """('batch','seq','act_embed') -> P(('data','fsdp','expert'), None, None).

    A mesh axis is used at most once per array: a later dimension that maps to an axis already
    used by an earlier one stays replicated on it (so e.g. embed->fsdp and batch->fsdp can't clash).
    """
    rules = current_rules() if rules is None else rules
    used: set[str] = set()
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis '{name}' has no rule; known: {', '.join(rules)}")
        axes = tuple(a for a in rules[name] if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)
