"""THE logical-axis -> mesh-axis table.

Models name every array dimension with a logical axis; this table alone decides which mesh
axes shard it. Parameters and activations use different names for the model dimension
(`embed` vs `act_embed`) because FSDP shards the weights' embed dim but never the activations'.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Mapping

from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.spec import AXES

MeshAxes = tuple[str, ...]  # () = replicated

DEFAULT_RULES: dict[str, MeshAxes] = {
    # activations
    # outside the MoE layers the expert axis acts as FSDP (see "embed")
    "batch": (
        "data",
        "fsdp",
        "expert",
    ),
    "seq": ("context",),  # context parallelism: every activation's sequence dim
    # the residual stream's sequence dim between blocks (+ model: sequence parallelism)
    "res_seq": ("context",),
    "act_embed": (),
    "act_mlp": ("model",),
    "act_heads": ("model",),
    "act_kv_heads": ("model",),
    "act_vocab": ("model",),
    "logits_batch": ("data", "fsdp", "expert"),  # the batch of the LM head's input and logits
    # parameters
    # the context and expert axes shard the weights as FSDP does: their devices hold distinct tokens
    # (outside the MoE layers the expert axis is one more FSDP axis, as in MaxText)
    "embed": ("fsdp", "context", "expert"),
    "mlp": ("model",),
    "heads": ("model",),
    "kv_heads": ("model",),
    "head_dim": (),
    "vocab": ("model",),
    # the d_model dim of the embedding table and the LM head (see vocab_parallel)
    "vocab_embed": (
        "fsdp",
        "context",
        "expert",
    ),
    "norm": (),
    # each pipeline device stores (and optimises) only its stage; no-op at pipeline=1
    "layers": ("pipeline",),
    # the layers after a layer pattern's last whole repeat (models/pieces.py): the last stage runs
    # them, each stage keeps them whole
    "tail_layers": (),
    "experts": ("expert",),  # expert parallelism: each device holds n_experts / expert of them
    "expert_mlp": ("model",),  # tensor parallelism inside each expert
    # the experts' d_model dim: `expert` already shards their `experts` dim
    "expert_embed": (
        "fsdp",
        "context",
    ),
    # the router's expert dim: every device routes its own tokens to all experts
    "router_experts": (),
    # latent attention's compressed dims (models/mla.py): sharded as FSDP shards `embed` where the
    # array's d_model dim does not already take those axes
    "latent": ("fsdp", "context", "expert"),
    # a layer stack outside the pipelined groups (the dense first layers, the multi-token
    # prediction modules): every pipeline stage holds it
    "outer_layers": (),
    "stages": ("pipeline",),
}

# The config option that sets each parameter dim's size, so that a divisibility error
# names what to change.
HINTS = {
    "heads": "model.n_heads",
    "kv_heads": "model.n_kv_heads",
    "mlp": "model.d_ff",
    "embed": "model.d_model",
    "vocab_embed": "model.d_model",
    "expert_embed": "model.d_model",
    "vocab": "model.vocab_size",
    "layers": "model.n_layers",
    "experts": "model.n_experts",
    "expert_mlp": "model.d_ff_expert",
    "router_experts": "model.n_experts",
    "latent": "model.kv_lora_rank and model.q_lora_rank",
}

_RULES: contextvars.ContextVar[Mapping[str, MeshAxes]] = contextvars.ContextVar(
    "rules", default=DEFAULT_RULES
)


def parse_overrides(spec: str | Mapping | None) -> dict[str, MeshAxes]:
    """`'embed=fsdp+model,vocab=none'` or a YAML mapping ->
    {'embed': ('fsdp','model'), 'vocab': ()}."""
    if not spec:
        return {}
    if isinstance(spec, str):
        pairs = []
        for part in spec.split(","):
            if "=" not in part:
                raise UserError(
                    f"--parallelism.rules: '{part}' is not name=axis[+axis];"
                    " example: embed=fsdp,vocab=none"
                )
            name, _, value = part.partition("=")
            pairs.append((name.strip(), value.strip()))
    else:
        pairs = list(spec.items())
    out: dict[str, MeshAxes] = {}
    for name, value in pairs:
        if name not in DEFAULT_RULES:
            raise UserError(
                f"--parallelism.rules: unknown logical axis '{name}';"
                f" valid: {', '.join(DEFAULT_RULES)}"
            )
        if value is None or value in ("", "none", "None", []):
            axes: MeshAxes = ()
        elif isinstance(value, str):
            axes = tuple(a.strip() for a in value.split("+"))
        else:
            axes = tuple(value)
        for a in axes:
            if a not in AXES:
                raise UserError(
                    f"--parallelism.rules: '{name}' maps to unknown mesh axis '{a}';"
                    f" valid: {', '.join(AXES)}"
                )
        out[name] = axes
    return out


def make_rules(overrides: str | Mapping | None = None) -> dict[str, MeshAxes]:
    return {**DEFAULT_RULES, **parse_overrides(overrides)}


def sequence_parallel(rules: Mapping[str, MeshAxes]) -> dict[str, MeshAxes]:
    """`rules` with the residual stream's sequence dim (`res_seq`) also split over `model`
    (Megatron's sequence parallelism: the tensor-parallel all-reduces become reduce-scatters and
    all-gathers, and residuals and norms take 1/model of the memory)."""
    res = tuple(rules["res_seq"])
    return {**rules, "res_seq": res if "model" in res else (*res, "model")}


# The names vocab_parallel rewrites: a user override of any of them is kept as written under `auto`.
VOCAB_NAMES = ("vocab", "vocab_embed", "act_vocab", "logits_batch")


def vocab_parallel(rules: Mapping[str, MeshAxes]) -> dict[str, MeshAxes]:
    """The embedding table and the LM head sharded on their vocabulary dim over the axes that
    shard their d_model dim in `rules` (FSDP's): the head's input and the logits' batch are then
    gathered over those axes, and the logits sharded on the vocabulary, as Megatron's
    vocab-parallel head does over tensor parallelism.

    Traffic per micro-batch, per device of an FSDP group of n: the classic layout all-gathers
    the head's weights [D, V] and reduce-scatters their gradient (2 (n-1)/n x V D parameter
    bytes); this one all-gathers the head's input, reduces its gradient and the embedding
    lookup ([tokens of the group, D] each) and three [tokens] float32 reductions of the loss.
    It wins while the group's tokens are fewer than the vocabulary (head_layout decides)."""
    moved = tuple(rules["vocab_embed"])

    def add(axes) -> tuple:
        return tuple(axes) + tuple(a for a in moved if a not in axes)

    return {
        **rules,
        "vocab": add(rules["vocab"]),
        "vocab_embed": (),
        "act_vocab": add(rules["act_vocab"]),
        "logits_batch": tuple(a for a in rules["logits_batch"] if a not in moved),
    }


def head_layout(
    rules: Mapping[str, MeshAxes],
    mode: str,
    sizes: Mapping[str, int],
    *,
    vocab: int,
    batch_tokens: int,
    act_bytes: int,
    param_bytes: int,
) -> dict:
    """`rules` with the LM head's layout that --parallelism.vocab_parallel `mode` (auto|on|off)
    picks on a mesh of these axis sizes. `batch_tokens`: tokens of one micro-batch of the global
    batch. `auto` takes vocab_parallel where it moves fewer bytes (~3 x the FSDP group's tokens x
    D activation bytes against ~2 x V x D parameter bytes per micro-batch), and keeps a head layout
    the user wrote (a rule of VOCAB_NAMES overridden) or a vocabulary the new axes would not
    divide."""

    def size(axes) -> int:
        return math.prod(sizes.get(a, 1) for a in axes)

    if mode == "off" or size(rules["vocab_embed"]) == 1:
        return dict(rules)
    vp = vocab_parallel(rules)
    if mode == "on" and vocab % size(vp["vocab"]):
        n, axes = size(vp["vocab"]), " x ".join(f"{a}={sizes.get(a, 1)}" for a in vp["vocab"])
        raise UserError(
            f"--parallelism.vocab_parallel on: model.vocab_size={vocab} is not divisible by"
            f" {axes} = {n} devices; pad the vocabulary to a multiple of {n}, or use auto (which"
            " keeps the gathered head here) or off"
        )
    if mode == "auto":
        group_tokens = batch_tokens // size(vp["logits_batch"])
        if (
            any(rules[n] != DEFAULT_RULES[n] for n in VOCAB_NAMES)
            or vocab % size(vp["vocab"])
            or 3 * group_tokens * act_bytes >= 2 * vocab * param_bytes
        ):
            return dict(rules)
    return vp


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


def logical_to_spec(
    names: tuple[str | None, ...], rules: Mapping[str, MeshAxes] | None = None
) -> P:
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
