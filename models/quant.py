"""A frozen weight held quantised (QLoRA's base, --lora.base_dtype int8|nf4) and dequantised one
layer at a time, where the layer runs.

Formats (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314):

- int8, per output channel: s_o = max_i |W_io| / 127 over the input dims i, codes
  q_io = round(W_io / s_o) in [-127, 127], W ~ q s (error <= s_o / 2).
- nf4, per block: a tile of the weight holding `block` values (`tile[d]` consecutive values along
  each dim d, the caller's choice: train/core/qlora.py picks dims no FSDP shard boundary cuts);
  s_b = max |W| over the block (absmax), q = the nearest of NormalFloat4's 16 values v_k (the
  paper's Appendix E, quantiles of N(0, 1) scaled to [-1, 1] with an exact zero) to W / s_b,
  stored as a 4-bit index, two to a byte along the weight's last dim (`pack`); W ~ v_q s_b (error
  <= s_b x the largest half gap, (1 - 0.696) / 2).
  Double quantisation (the paper's section 3: 8-bit scales, a float32 constant per 256 of them)
  quantises the float32 block scales once more: minus their midrange per layer (one float32), to
  int8 absmax with one float32 step per group, a tile of up to 256 scales (`group`); 8 bits per
  block plus 32 / 256 per block, 8 / 64 + 32 / (64 x 256) = 0.127 bits per value at blocks of 64,
  against 0.5 for float32 scales. Everything is max, min and elementwise: the same codes, scales
  and steps whatever the sharding.

The codes keep the weight's dims (nf4's last one halved), so its logical axes and sharding; the
scales have the weight's rank, with the quantised-over dims reduced (int8: the input dims to 1;
nf4: each dim by its tile), the steps the scales' dims reduced by the group, and each is sharded
on a dim wherever the reduced size still divides: where a tile lies inside a shard, that is
exactly where its scales are the shard's own.

The int8 quantise and dequantise are qwix's (google/qwix: `qwix.quantize` with channelwise axes,
`qwix.dequantize` of its QArray): it installs from PyPI and runs on the jax this project supports.
NF4 is our own both ways: the encoder (`nf4_encode`: qwix's argmin over the 16 values keeps an
[N, 16] temporary, 8x the weights, where this one fuses), the decoder (`nf4_decode`: qwix's table
lookup flattens the codes, which the SPMD partitioner gathers whole) and double quantisation,
which qwix does not have. AQT (`aqtp` 0.9.0)
installs and imports here too, but quantises a dot_general's operands for training and has no
NF4, where qwix ships NF4 and a LoRA/QLoRA provider of its own (`qwix.LoraProvider`).
qwix's model-level QLoRA (intercepting Flax modules' dot_generals) is not used: this project's
layers are stacked [L, ...] and scanned, and the dequantisation has to happen inside that scan,
per layer, which `materialise` does where models/pieces.py merges one layer's params.

`QuantizedWeight` and `LoraWeight` are pytrees whose arrays all lead with the layer dim (a
quantised embedding's with the vocabulary dim, `take_rows`), so the stack's slicing, reshaping
and pipelining treat them as any weight; `materialise` turns a layer's
slice of them into the weight the layer multiplies by.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import qwix

from models.adapters import Adapted

FORMATS = ("int8", "nf4")
CODE_BITS = {"int8": 8, "nf4": 4}
# qwix's symmetric int8 range is [-127.5, 127.5] (its top code is hit by rounding 127.5 up, which
# relies on the float -> int8 conversion saturating); scaling the absmax by 127.5 / 127 gives the
# usual absmax / 127 step, codes in [-127, 127] without relying on saturation
_INT8_ABSMAX = f"absmax,{127.5 / 127}"


@flax.struct.dataclass
class QuantizedWeight:
    """A weight [L, ...] as codes and scales (see the module docstring); `dtype`: what
    `materialise` returns. With double quantisation `scales` are int8 codes of the centred scales,
    `scale_scales` their float32 step per group, `scale_offset` the midrange that was subtracted
    (one per layer)."""

    codes: jax.Array
    scales: jax.Array
    scale_scales: jax.Array | None = None
    scale_offset: jax.Array | None = None
    fmt: str = flax.struct.field(pytree_node=False, default="int8")
    dtype: str = flax.struct.field(pytree_node=False, default="float32")

    def __getitem__(self, index):
        """`w[...]` is `w` (how an nnx.Param hands out its value)."""
        if index is Ellipsis:
            return self
        raise TypeError("a QuantizedWeight is sliced through jax.tree.map over its arrays")

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (nf4's codes hold two values a byte along the last dim)."""
        *lead, last = self.codes.shape
        return (*lead, last * 2) if self.fmt == "nf4" else tuple(self.codes.shape)

    def block_scales(self) -> jax.Array:
        """The float32 scales (double quantisation undone)."""
        if self.scale_scales is None:
            return self.scales
        step = per_tile(self.scales.astype(jnp.float32), self.scale_scales, jnp.multiply)
        return step + self.scale_offset

    def dequantize(self) -> jax.Array:
        """float32 W ~ codes x scales."""
        if self.fmt == "nf4":
            return per_tile(nf4_decode(unpack(self.codes)), self.block_scales(), jnp.multiply)
        return qwix.dequantize(qwix.QArray(self.codes, self.block_scales(), None, jnp.int8))

    def materialise(self) -> jax.Array:
        return self.dequantize().astype(self.dtype)


@flax.struct.dataclass
class LoraWeight:
    """A frozen weight [L, ...] (quantised, or a plain array) with its LoRA adapters
    A [L, in..., r], B [L, r, out...] (train/core/lora.py), paired for the layer scan; a layer's
    slice materialises into a models.adapters.Adapted, which the layer multiplies by factored:
    x W + scale (x A) B."""

    base: QuantizedWeight | jax.Array
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = flax.struct.field(pytree_node=False, default=1.0)

    def materialise(self) -> Adapted:
        w = self.base.materialise() if isinstance(self.base, QuantizedWeight) else self.base
        # frozen: an explicit pipeline's vjp over a stage's params then forms no dW
        return Adapted(jax.lax.stop_gradient(w), self.lora_a, self.lora_b, scale=self.scale)


# NormalFloat4's 16 values (the QLoRA paper's Appendix E, as bitsandbytes and qwix ship them)
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def tiles(x: jax.Array, tile: tuple[int, ...]) -> jax.Array:
    """`x` with each dim n split into (n / t, t) for its tile t: [..., n / t, t, ...]."""
    split = [part for n, t in zip(x.shape, tile, strict=True) for part in (n // t, t)]
    return x.reshape(split)


def tile_max(x: jax.Array, tile: tuple[int, ...]) -> jax.Array:
    """max over each tile of `x`: shape x.shape / tile (elementwise per dim)."""
    return jnp.max(tiles(x, tile), axis=tuple(range(1, 2 * x.ndim, 2)))


def per_tile(x: jax.Array, small: jax.Array, op) -> jax.Array:
    """op(x, small) with `small` (a value per tile of x: each dim of x a multiple of small's)
    broadcast over its tiles, by reshapes alone (as qwix's generic broadcast): no repeated copy
    of `small`, and nothing the SPMD partitioner has to reshard."""
    split_x, split_s = [], []
    for n, m in zip(x.shape, small.shape, strict=True):
        split_x += [m, n // m]
        split_s += [m, 1]
    return op(x.reshape(split_x), small.reshape(split_s)).reshape(x.shape)


def nf4_decode(codes: jax.Array) -> jax.Array:
    """4-bit codes [...] -> their NF4 values, float32 [...]: a lookup in the 16-value table
    indexed by the codes as they are shaped. Not qwix's dequantise, which flattens the codes to
    [N, 1] first: the SPMD partitioner cannot keep that reshape of a sharded array split, and
    gathered the whole of the 1b preset's vocabulary-parallel LM head for it (a 1 GB float32
    temporary per device on fsdp=8); nor a chain of 15 selects, which XLA:CPU materialised
    (compiled temp of the 1b NF4 step 746 MiB against 470 for this lookup)."""
    table = jnp.asarray(NF4_VALUES, jnp.float32)
    return jnp.take(table, codes, axis=0, mode="clip")  # codes are 0..15: clip is exact


def nf4_encode(w: jax.Array, tile: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """-> (codes uint8 [w's shape], absmax scales float32 [w's shape / tile]): the index of the
    NF4 value nearest to w / absmax of its block (a tile of w: `tile[d]` consecutive values along
    each dim d), counted as how many of the 15 midpoints between neighbouring values it lies above
    (ties go to the lower value, as an argmin's first hit does). Our own rather than
    qwix.quantize's "nf4": that takes an argmin over the 16 values of each element, which XLA
    keeps as a [N, 16] float32 temporary (5.8 GB per device quantising the 1b preset on fsdp=8, 8x
    its float32 weights); this one is elementwise and fuses, no temporary."""
    absmax = tile_max(jnp.abs(w), tile)
    safe = jnp.where(absmax > 0, absmax, 1.0)  # an all-zero block: codes of 0.0, any scale
    x = per_tile(w, safe, jnp.divide)
    codes = jnp.zeros(w.shape, jnp.uint8)
    for lo, hi in zip(NF4_VALUES[:-1], NF4_VALUES[1:], strict=True):
        codes = codes + (x > (lo + hi) / 2).astype(jnp.uint8)
    return codes, safe


def pack(codes: jax.Array) -> jax.Array:
    """4-bit codes [..., n] -> uint8 [..., n / 2]: value 2i in the low nibble, 2i + 1 in the high
    one. Packed by hand rather than held as jnp.uint4: XLA:CPU lays a uint4 jit output out one
    code per byte and a compiled argument two per byte, so they do not pass between programs."""
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack(packed: jax.Array) -> jax.Array:
    """The inverse of `pack`: uint8 [..., n / 2] -> codes uint8 [..., n]."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def is_lazy(x) -> bool:
    return isinstance(x, (QuantizedWeight, LoraWeight))


def materialise(tree):
    """`tree` (one layer's params, or any) with every quantised weight dequantised, and every weight
    paired with adapters a models.adapters.Adapted: what the layer multiplies by. Plain arrays pass
    through."""
    return jax.tree.map(lambda x: x.materialise() if is_lazy(x) else x, tree, is_leaf=is_lazy)


def take_rows(table_VD, ids):
    """`table_VD[ids]` (an embedding lookup); of a quantised table only the rows looked up are
    dequantised: each of its arrays leads with the vocabulary dim or a tiling of it (the double
    quantisation's steps, one per group of rows; its offset, one for the table), row v of the
    table in that array's row v / (V / rows)."""
    if not is_lazy(table_VD):
        return jnp.take(table_VD, ids, axis=0)
    vocab = table_VD.codes.shape[0]
    return materialise(
        jax.tree.map(lambda a: jnp.take(a, ids // (vocab // a.shape[0]), axis=0), table_VD)
    )


def has_quantised(tree) -> bool:
    """Whether `tree` holds a quantised weight (alone or paired with adapters)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) for x in leaves)


def remat_policy(policy, params):
    """The remat policy of layers whose `params` may hold quantised weights: with none set, keep
    the projection outputs only (as --model.remat dots), so the backward recomputes each layer's
    dequantised weights rather than keeping them for every layer ([L, ...] at full precision);
    the policies that keep less already do."""
    if policy is None and has_quantised(params):
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return policy


def quantize(
    w: jax.Array,
    fmt: str,
    *,
    in_dims: tuple[int, ...],
    tile: tuple[int, ...] = (),
    group: tuple[int, ...] = (),
    layers: int = 1,
    dtype: str = "float32",
) -> QuantizedWeight:
    """Quantise `w` (jittable; see the module docstring). `in_dims`: its input dims (int8's scales
    reduce over them: a stacked projection [L, in..., out...]'s 1..n_in, the LM head [D, V]'s 0,
    the embedding [V, D]'s 1, a scale per row); `tile`: nf4's block, values per dim; `group`:
    nf4's double quantisation, the block scales per group, per dim of the scales (empty: none);
    `layers`: the leading dims that index separate layers (the double quantisation's offset is
    one per layer)."""
    w = jnp.asarray(w, jnp.float32)
    dims = range(w.ndim)
    if fmt == "int8":
        out = tuple(d for d in dims if d not in in_dims)
        q = qwix.quantize(w, jnp.int8, channelwise_axes=out, calibration_method=_INT8_ABSMAX)
        return QuantizedWeight(q.qvalue, q.scale.astype(jnp.float32), fmt=fmt, dtype=dtype)
    if fmt != "nf4":
        raise ValueError(f"unknown quantised format {fmt!r}; one of {FORMATS}")
    unpacked, scales = nf4_encode(w, tile)
    codes = pack(unpacked)
    if not group:
        return QuantizedWeight(codes, scales, fmt=fmt, dtype=dtype)
    # the scales minus their per-layer midrange, to int8 with one float32 step per group. The
    # midrange, (max + min) / 2, not bitsandbytes' mean: max and min are exact in any order, so
    # the codes do not depend on the sharding (a sum's rounding does), and centring on it gives
    # the smallest absmax
    rest = tuple(range(layers, w.ndim))
    offset = (jnp.max(scales, rest, keepdims=True) + jnp.min(scales, rest, keepdims=True)) / 2
    centred = scales - offset
    step = tile_max(jnp.abs(centred), group) / 127
    step = jnp.where(step > 0, step, 1.0)  # a group of equal scales: codes 0, any step
    q2 = jnp.clip(jnp.round(per_tile(centred, step, jnp.divide)), -127, 127).astype(jnp.int8)
    return QuantizedWeight(codes, q2, step, offset, fmt=fmt, dtype=dtype)
