"""QLoRA (--lora.base_dtype int8|nf4): the frozen LoRA base quantised once at load, held sharded
as the weights it replaces, and dequantised one layer at a time inside the layer scan.

Which weights: the projections LoRA can adapt (train/core/lora.py TARGET_WEIGHTS: q, k, v, o,
gate, up, down) in every layer stack that has them, adapted or not, as QLoRA quantises every
linear layer of the base, and by default (--lora.quantize_embeddings) the embedding and LM head:
35% of the 1b preset's parameters, without which its NF4 base stays at 0.52 of the bfloat16 one;
bitsandbytes keeps them at 16 bits, but quantising them moved the eval loss of BENCHMARKS.md's
QLoRA quality benchmark by 0.1-0.2% (the head is dequantised once per step, each device its own
vocabulary shard under the vocab-parallel head). The norms, MoE experts and latent-attention
weights stay unquantised, held in the compute dtype.

NF4's blocks (`nf4_tile`): chosen from the weight's shape and logical axes alone, so the codes
are the same on every mesh (a resume on another mesh rebuilds the same base), and placed where
no FSDP shard boundary cuts them, so each block's scale lives on the device holding its values
and the scales shard with the codes (blocks along d_model, bitsandbytes' choice for q/k/v/gate/up,
straddle shards as soon as d_model / fsdp < block: the default preset's 256 over 8 devices, whose
scales were then held whole on every device). A projection's blocks run along its dims other
than d_model, which FSDP never shards: `block` consecutive values of heads x head_dim (within a
head where block <= head_dim, which no rule shards at all) or of d_ff (aligned under tensor
parallelism while `model` divides d_ff / block). The embedding and LM head have only d_model and
the vocabulary (128,256 = 8 x 16,032 on the 1b preset: no block of 64 aligns on the vocabulary
over 8 shards); their blocks run along d_model, of gcd(block, d_model / gcd(d_model, ALIGN))
values, aligned on up to ALIGN = 8 FSDP shards (and d_model is unsharded under the
vocab-parallel head). The double quantisation's groups (`dq_group`) are tiles of up to 256 scales
aligned the same way on any dim split up to 8 ways: 256 on the 1b and 70b projections, 32-96 on
the default preset's small layers (0.016 bits per value instead of 0.002). Where a mesh still cuts
a block (tensor parallelism beyond those splits), that dim of its scales is held whole
(`part_spec`): the same values, more bytes.

The step takes the base as before (its third argument), now a tree whose quantised weights are
models.quant.QuantizedWeight (codes sharded as the weight, scales on the matching axes); `attach`
pairs each adapted one with its adapters (models.quant.LoraWeight), and models/pieces.py
dequantises each layer's weights where the layer runs: inside the scan, so the full-precision
temporary is one layer's weights, never the [L, ...] stack's; the layer adds the adapters' term
factored, x W + scale (x A) B (models/adapters.py). The gradient reaches the adapters only: the
base is not an argument of the differentiated function.

Checkpoints hold the adapters and the pointer to the full-precision base, as for any LoRA run;
the quantised base is rebuilt from it at every start (quantisation is a deterministic function of
the weights) and the fingerprint checked is the full-precision base's.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.shard import axes_size, entry_axes
from models import model, quant
from models.config import ModelConfig
from train.core.config import LoraConfig

BLOCK_AXIS = "embed"  # a quantised projection has a d_model dim
# --lora.quantize_embeddings: the embedding [V, D] (a scale per row) and the LM head [D, V] (a
# scale per vocabulary column), blocked along their d_model dim
EMBEDDINGS = {"embed_VD": (1,), "lm_head_DV": (0,)}
# the dims FSDP shards (logical axes), which nf4's blocks avoid; the layer dim, which they never
# cross (each layer's weights are quantised on their own)
FSDP_AXES = ("embed", "vocab_embed")
LAYERS = ("layers",)
# the splits of a dim that blocks and double-quantisation groups along it are aligned with (a
# dim of n values split into k | gcd(n, ALIGN) shards): a node's 8 devices
ALIGN = 8
# the paper's second-level blocks: 256 first-level scales
GROUP = 256


@dataclasses.dataclass(frozen=True)
class Quantised:
    """One weight the base holds quantised: its path, logical axes, input dims (int8's scales
    reduce over them) and the leading dims that index layers."""

    path: tuple[str, ...]
    axes: tuple
    in_dims: tuple[int, ...]
    layers: int = 1


def nf4_tile(w: Quantised, shape: tuple[int, ...], block: int) -> tuple[int, ...] | None:
    """The values of one NF4 block per dim of `w` (see the module docstring), or None where
    `block` does not tile it. A projection's blocks are `block` consecutive values of its dims
    that FSDP never shards (heads x head_dim, or d_ff), innermost first: within a head where
    block <= head_dim, whole heads where it is a multiple of it. The embedding's and head's run
    along d_model in blocks of gcd(block, d_model / gcd(d_model, ALIGN)): aligned on up to ALIGN
    FSDP shards (64 on the 1b preset's 2,048, 32 on the default's 256)."""
    tile = [1] * len(shape)
    if "vocab_embed" in w.axes:
        d = w.axes.index("vocab_embed")
        n = shape[d]
        tile[d] = math.gcd(block, n // math.gcd(n, ALIGN))
        return tuple(tile)
    left = block
    for d in reversed(range(len(shape))):
        if left == 1 or w.axes[d] in FSDP_AXES or w.axes[d] in LAYERS:
            continue
        n = shape[d]
        if left <= n:
            if n % left:
                return None
            tile[d], left = left, 1
        elif left % n:
            return None
        else:
            tile[d], left = n, left // n
    return tuple(tile) if left == 1 else None


def dq_group(scales_shape: tuple[int, ...], layers: int) -> tuple[int, ...]:
    """The double quantisation's group per dim of the scales: up to GROUP scales, a tile of them
    innermost dim first, each dim's extent the largest divisor of n / gcd(n, ALIGN) that still
    fits, so that a group never straddles the shards of a dim split ALIGN ways or fewer (the
    steps then shard with the scales on any such mesh). A layer's scales are grouped on their
    own."""
    group, left = [1] * len(scales_shape), GROUP
    for d in reversed(range(layers, len(scales_shape))):
        n = scales_shape[d]
        m = n // math.gcd(n, ALIGN)
        group[d] = max(t for t in range(1, min(m, left) + 1) if m % t == 0)
        left //= group[d]
    return tuple(group)


def enabled(lora: LoraConfig | None) -> bool:
    return bool(lora is not None and lora.rank and lora.base_dtype in quant.FORMATS)


def weights(cfg: ModelConfig, table: dict, embeddings: bool = False) -> list[Quantised]:
    """The weights a quantised base holds quantised: `table` (lora.TARGET_WEIGHTS: name ->
    (module, weight, input dims)) in every top-level layer stack that has them, with a d_model
    dim; with `embeddings` (--lora.quantize_embeddings) the embedding and LM head too."""
    out = []
    for stack, node in model.param_axes(cfg).items():
        if not isinstance(node, dict):
            if embeddings and stack in EMBEDDINGS:
                out.append(Quantised((stack,), node, EMBEDDINGS[stack], layers=0))
            continue
        for module, weight, n_in in table.values():
            names = node.get(module, {}).get(weight) if isinstance(node.get(module), dict) else None
            if names is not None and BLOCK_AXIS in names:
                out.append(Quantised((stack, module, weight), names, tuple(range(1, 1 + n_in))))
    return out


def check(cfg, table: dict) -> None:
    """One line for a quantised base that cannot be: with FP8 matmuls (the weights would be
    rounded twice, to the base's codes and then to e4m3), an nf4 block size that does not tile a
    weight (`nf4_tile`), nf4 on a weight whose last dim is odd, a model with no weight to
    quantise."""
    lora, m = cfg.lora, cfg.model
    flag = f"--lora.base_dtype {lora.base_dtype}"
    if m.matmul_precision == "fp8":
        raise UserError(
            f"{flag}: not with --model.matmul_precision fp8 (the quantised base would be rounded"
            " again to e4m3 in every matmul); use --model.matmul_precision default, or"
            " --lora.base_dtype bfloat16"
        )
    found = weights(m, table, lora.quantize_embeddings)
    if not found:
        raise UserError(
            f"{flag}: this model has no projection with a d_model dim to quantise; use"
            " --lora.base_dtype bfloat16"
        )
    if lora.base_dtype != "nf4":
        return
    shapes = model.abstract_params(m)
    for w in found:
        shape = _at(shapes, w.path).shape
        if nf4_tile(w, shape, lora.block_size) is None:
            dims = " x ".join(
                f"{a}={n}"
                for a, n in zip(w.axes, shape, strict=True)
                if a not in FSDP_AXES + LAYERS
            )
            valid = [
                b
                for b in (16, 32, 64, 128, 256)
                if all(nf4_tile(v, _at(shapes, v.path).shape, b) for v in found)
            ]
            raise UserError(
                f"--lora.block_size {lora.block_size} does not tile {'/'.join(w.path)} (nf4 blocks"
                f" run along its {dims}, innermost first); valid: e.g."
                f" {', '.join(map(str, valid)) or 'none of 16-256: use --lora.base_dtype int8'}"
            )
        if shape[-1] % 2:  # two 4-bit codes a byte along the last dim (models/quant.py)
            also = " or --lora.quantize_embeddings false" if w.layers == 0 else ""
            raise UserError(
                f"--lora.base_dtype nf4: {'/'.join(w.path)}'s last dim is odd ({shape[-1]}); nf4"
                f" packs two codes a byte along it: use --lora.base_dtype int8{also}"
            )


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _replaced(tree: dict, items: dict) -> dict:
    """`tree` with the leaves at `items`' paths replaced (copies of the dicts on the way)."""
    out = dict(tree)
    for path, leaf in items.items():
        node = out
        for key in path[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        node[path[-1]] = leaf
    return out


def quantize_base(cfg, table: dict, params: dict) -> dict:
    """The base's params with its projections quantised (jittable) and the rest in the compute
    dtype."""
    lora, dtype = cfg.lora, model.compute_dtype(cfg.model)
    rest = jax.tree.map(lambda x: x.astype(dtype), params)
    items = {}
    for w in weights(cfg.model, table, lora.quantize_embeddings):
        weight = _at(params, w.path)
        tile = group = ()
        if lora.base_dtype == "nf4":
            tile = nf4_tile(w, weight.shape, lora.block_size)
            scales = tuple(n // t for n, t in zip(weight.shape, tile, strict=True))
            group = dq_group(scales, w.layers) if lora.double_quant else ()
        items[w.path] = quant.quantize(
            weight,
            lora.base_dtype,
            in_dims=w.in_dims,
            tile=tile,
            group=group,
            layers=w.layers,
            dtype=dtype,
        )
    return _replaced(rest, items)


def abstract_base(cfg, table: dict, full: dict) -> dict:
    """ShapeDtypeStructs of the quantised base (no sharding) from the full base's."""
    return jax.eval_shape(lambda p: quantize_base(cfg, table, p), full)


def part_spec(
    spec: P, shape: tuple[int, ...], weight_shape: tuple[int, ...], mesh, layers: int = 1
) -> P:
    """A codes', scales' or steps' spec from the weight's: a dim keeps the weight's mesh axes
    where its size still divides by them (a tile inside a shard: exactly there). The axes of a dim
    reduced to 1 (int8's input dims) move to the largest other dim they divide that no axis of
    size > 1 splits (not the first `layers` dims, which index layers), so that under FSDP those
    scales are split too (the dequantisation broadcasts them: one small all-gather). A dim
    reduced to more than 1 that no longer divides (nf4 blocks that a mesh cuts: tensor
    parallelism past d_ff / block shards) is held whole: moved elsewhere, the scales would be
    resharded against the codes' blocks in every layer."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    out, moved = [], []
    for e, n, wn in zip(entries, shape, weight_shape, strict=True):
        keep = n == wn or (e is not None and n % axes_size(mesh, e) == 0)
        out.append(e if keep else None)
        if not keep and e is not None and n == 1:
            moved.append(e)
    for e in moved:
        free = [
            d for d in range(layers, len(shape)) if out[d] is None or axes_size(mesh, out[d]) == 1
        ]
        fits = [d for d in free if shape[d] > 1 and shape[d] % axes_size(mesh, e) == 0]
        if fits:
            d = max(fits, key=lambda d: shape[d])
            out[d] = (*entry_axes(out[d]), *entry_axes(e))
    return P(*out)


def shardings(cfg, table: dict, full_shardings: dict, mesh) -> dict:
    """The quantised base's NamedShardings: the full base's, with each quantised weight's codes
    sharded as the weight and its scales on the matching axes (see `part_spec`)."""
    full = model.abstract_params(cfg.model)
    abstract = abstract_base(cfg, table, full)
    items = {}
    for w in weights(cfg.model, table, cfg.lora.quantize_embeddings):
        q, spec, shape = _at(abstract, w.path), _at(full_shardings, w.path).spec, _at(full, w.path)
        items[w.path] = jax.tree.map(
            lambda a, spec=spec, shape=shape.shape, w=w: NamedSharding(
                mesh, part_spec(spec, a.shape, shape, mesh, w.layers)
            ),
            q,
        )
    return _replaced(full_shardings, items)


def attach(base: dict, adapters: dict, scale: float) -> dict:
    """The model's params: the base (quantised or not) with each adapted weight paired with its
    adapters (models.quant.LoraWeight), which each layer multiplies by factored, x W + scale (x A) B
    (models/adapters.py), one layer at a time inside the forward."""

    def walk(node, adapter):
        if isinstance(adapter, dict) and set(adapter) == {"lora_a", "lora_b"}:
            return quant.LoraWeight(node, adapter["lora_a"], adapter["lora_b"], scale=scale)
        return {k: walk(v, adapter[k]) if k in adapter else v for k, v in node.items()}

    return walk(base, adapters)
