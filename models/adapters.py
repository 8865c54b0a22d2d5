"""A LoRA-adapted weight as a layer multiplies by it: the frozen weight and its adapters kept apart,
so that each projection computes

    y = x W + s (x A) B                (Hu et al. 2021, "LoRA", arXiv:2106.09685, eq. 3)

with A [in..., r], B [r, out...] and s = alpha / r, instead of x (W + s A B).

Why factored: with the merged weight W_eff = W + s A B, autodiff forms dL/dW_eff = x^T dy at W's
full size in every layer, and the partitioner reduces that partial sum over the batch's mesh axes
(data, fsdp) where the dot makes it, before the chain rule contracts it onto A and B: a LoRA step
then moves a full fine-tune's gradient bytes (measured in BENCHMARKS.md: 12.75 MiB per device on the
default preset at fsdp=8, against 1.19 MiB of adapters). A custom_vjp on the merge cannot move that
reduction: the cotangent it receives is already the reduced dW_eff. Factored, the backward is
dA = s x^T (dy B^T) and dB = s (x A)^T dy, each formed from the activations and reduced at the
adapters' size; the frozen W gets no gradient at all (and the dW matmul, a third of a full
fine-tune's projection FLOPs, is gone).

`Adapted` is what models.quant.LoraWeight materialises into, one layer at a time, inside the layer
scan; the layers (models/layers.py MLP, models/attention.py, models/mla.py) multiply by
`frozen(w)` as by any weight and add `with_adapters(y, spec, x, w)`, which is `y` itself for a
plain weight.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Adapted:
    """One layer's frozen weight W (dequantised, for a quantised base) with its adapters A, B."""

    w: jax.Array
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = flax.struct.field(pytree_node=False, default=1.0)

    def __getitem__(self, index):
        """`w[...]` is `w` (how an nnx.Param hands out its value)."""
        if index is Ellipsis:
            return self
        raise TypeError("an Adapted weight is sliced through jax.tree.map over its arrays")


def frozen(w):
    """The weight a layer multiplies by: an Adapted's frozen W, any other weight itself."""
    return w.w if isinstance(w, Adapted) else w


def with_adapters(y, spec: str, x, w):
    """`y` = einsum(spec, x, W) plus, for an Adapted `w`, the adapters' s (x A) B, in x's dtype.
    `spec`: the projection's einsum, x's letters first ("btd,dnh->btnh"): W's letters that x
    shares are its input dims (A's leading dims), the rest its output dims (B's trailing ones)."""
    if not isinstance(w, Adapted):
        return y
    ins, out = spec.split("->")
    x_s, w_s = ins.split(",")
    r = next(c for c in "rzyxwvu" if c not in spec)  # the rank's letter
    in_s = "".join(c for c in w_s if c in x_s)
    out_s = "".join(c for c in w_s if c not in x_s)
    rest_s = "".join(c for c in x_s if c not in in_s)
    # both products with a batch dim of 1 (q): the remat policies that keep projection outputs
    # ("dots": dots without batch dims) then recompute these from x rather than keep the adapters'
    # term beside the projection's output in every layer (measured: +40% of a QLoRA step's temp)
    q = next(c for c in "qponml" if c not in spec + r)
    xa = jnp.einsum(
        f"{q}{x_s},{q}{in_s}{r}->{q}{rest_s}{r}", x[None], w.lora_a.astype(x.dtype)[None]
    )
    xa = xa * jnp.asarray(w.scale, xa.dtype)
    delta = jnp.einsum(
        f"{q}{rest_s}{r},{q}{r}{out_s}->{q}{out}", xa, w.lora_b.astype(x.dtype)[None]
    )
    return y + delta[0].astype(y.dtype)
