"""Building blocks: parameters with logical axes, RMSNorm, rotary embeddings, SwiGLU MLP.

Shape letters: B batch, T sequence, D d_model, F d_ff, N heads, K kv heads, H head dim, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mesh.rules import logical_to_spec
from mesh.shard import axes_size, constrain
from models import fp8
from models.adapters import frozen, with_adapters


def param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    dtype,
    *,
    std: float | None = None,
    fan_in: int | None = None,
    ones: bool = False,
    zeros: bool = False,
) -> nnx.Param:
    """A Param carrying its logical axis names (read by the sharding rules)."""
    if ones or zeros:
        value = (jnp.ones if ones else jnp.zeros)(shape, dtype)
    else:
        scale = std if std is not None else fan_in**-0.5
        value = scale * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, dtype)
    return nnx.Param(value, out_sharding=axes)


class RMSNorm(nnx.Module):
    """`plus_one` (Gemma): the scale is 1 + w, w stored and initialised to 0, as HF stores it."""

    def __init__(self, d: int, eps: float, param_dtype, *, rngs: nnx.Rngs, plus_one: bool = False):
        self.scale = param(rngs, (d,), ("norm",), param_dtype, ones=not plus_one, zeros=plus_one)
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        # Statistics in float32 whatever the compute dtype; bf16 variance loses too much.
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x * (1.0 + scale if self.plus_one else scale)).astype(x_BTD.dtype)


def rope_frequencies(h: int, theta: float, scaling: tuple | None = None) -> jax.Array:
    """[H/2] inverse wavelengths. `scaling` = (factor, low_freq_factor, high_freq_factor,
    original_max_len): Llama 3.1's long-context scaling (wavelengths longer than original/low
    divided by factor, shorter than original/high kept, a linear ramp in between), as HF's
    "llama3"."""
    inv_freq = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    if scaling:
        factor, low, high, original = scaling
        ramp = jnp.clip((original * inv_freq / (2 * jnp.pi) - low) / (high - low), 0.0, 1.0)
        inv_freq = (1 - ramp) * inv_freq / factor + ramp * inv_freq
    return inv_freq


def rope(
    x_BTNH: jax.Array,
    positions_BT: jax.Array,
    theta: float,
    scaling: tuple | None = None,
    linear: float = 1.0,
) -> jax.Array:
    """Rotary embedding, split-halves layout (Llama/HF): pairs are (i, i + H/2). `linear`: HF's
    "linear" scaling, every wavelength stretched by that factor."""
    h = x_BTNH.shape[-1]
    inv_freq = rope_frequencies(h, theta, scaling)  # [H/2]
    if linear != 1.0:
        inv_freq = inv_freq / linear
    angle_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq  # [B,T,H/2]
    sin, cos = jnp.sin(angle_BTh)[:, :, None, :], jnp.cos(angle_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # HF gelu_pytorch_tanh
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def fused_mlp(mesh, rules=None) -> bool:
    """Whether gate and up come from one einsum over their stacked weights on `mesh` (empty: no
    mesh) under `rules` (default: the ones in context): where tensor parallelism splits d_ff.
    There each einsum's input gradient is a partial sum that the backward all-reduces, so one
    einsum costs one all-reduce of [B, T, D] a layer instead of two (XLA does not merge them).
    Elsewhere two einsums: the stack copies the gathered weights every step, 6-10% of the step on
    XLA:CPU over `fsdp=8` (BENCHMARKS.md, "The attention's and the MLP's layouts" and "The
    projections' weight gradients")."""
    if mesh.empty:
        return False
    (mlp,) = logical_to_spec(("mlp",), rules)
    return axes_size(mesh, mlp) > 1


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up)); GeGLU with `activation` gelu_tanh or gelu."""

    def __init__(
        self,
        d: int,
        f: int,
        dtype,
        param_dtype,
        *,
        rngs: nnx.Rngs,
        fp8_matmuls: bool = False,
        activation: str = "silu",
    ):
        self.w_gate_DF = param(rngs, (d, f), ("embed", "mlp"), param_dtype, fan_in=d)
        self.w_up_DF = param(rngs, (d, f), ("embed", "mlp"), param_dtype, fan_in=d)
        self.w_down_FD = param(rngs, (f, d), ("mlp", "embed"), param_dtype, fan_in=f)
        self.dtype, self.fp8, self.activation = dtype, fp8_matmuls, activation

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = self.dtype
        # (a LoRA-adapted weight adds its adapters' term to its projection: models/adapters.py)
        gate, up, down = self.w_gate_DF[...], self.w_up_DF[...], self.w_down_FD[...]
        if fused_mlp(jax.sharding.get_abstract_mesh()):
            # the stack next to d_ff: the output [B, T, 2, F] is one plain matmul's, each row's
            # gate then up (with the stack first, the gating read the output back transposed)
            w_DZF = jnp.stack([frozen(gate), frozen(up)], axis=1).astype(dt)
            y_BTZF = fp8.einsum("btd,dzf->btzf", x_BTD, w_DZF, self.fp8)
            gate_BTF, up_BTF = y_BTZF[:, :, 0], y_BTZF[:, :, 1]
        else:
            gate_BTF = fp8.einsum("btd,df->btf", x_BTD, frozen(gate).astype(dt), self.fp8)
            up_BTF = fp8.einsum("btd,df->btf", x_BTD, frozen(up).astype(dt), self.fp8)
        gate_BTF = with_adapters(gate_BTF, "btd,df->btf", x_BTD, gate)
        up_BTF = with_adapters(up_BTF, "btd,df->btf", x_BTD, up)
        act = ACTIVATIONS[self.activation]
        h_BTF = constrain(act(gate_BTF) * up_BTF, ("batch", "seq", "act_mlp"))
        out_BTD = fp8.einsum("btf,fd->btd", h_BTF, frozen(down).astype(dt), self.fp8)
        return with_adapters(out_BTD, "btf,fd->btd", h_BTF, down)


@jax.custom_vjp
def head_logits(x_BTD: jax.Array, head_DV: jax.Array) -> jax.Array:
    """The LM head: einsum("...d,dv->...v", x, head) [..., V] float32 (any leading dims).

    Autodiff's backward is the same, except for how it writes the weight gradient: it contracts
    (cotangent, x) into [V, D] and transposes, which XLA:CPU lowers by materialising the [tokens,
    V] cotangent a second time, transposed, and feeding it to a strided matmul. Contracting
    (x, cotangent) into [D, V] directly is one plain matmul on the cotangent as it lies (measured
    on the peer shape: the head's backward ~15-20% fewer CPU seconds).

    The float32 logits' gradient is cast to the compute dtype (x's) before the two backward
    matmuls, as the forward's operands are, accumulating in float32: with bf16 compute both are
    bf16 matmuls instead of float32 ones over [tokens, V] (MaxText's head does the same); in
    float32 nothing changes. Gradients are cast to each input's dtype."""
    return jnp.einsum("...d,dv->...v", x_BTD, head_DV, preferred_element_type=jnp.float32)


def _head_logits_fwd(x_BTD, head_DV):
    return head_logits(x_BTD, head_DV), (x_BTD, head_DV)


def _head_logits_bwd(res, g_BTV):
    x_BTD, head_DV = res
    lead = tuple(range(x_BTD.ndim - 1))
    g_BTV = g_BTV.astype(x_BTD.dtype)
    dx_BTD = jax.lax.dot_general(
        g_BTV, head_DV, (((x_BTD.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    dhead_DV = jax.lax.dot_general(
        x_BTD, g_BTV, ((lead, lead), ((), ())), preferred_element_type=jnp.float32
    )
    return dx_BTD.astype(x_BTD.dtype), dhead_DV.astype(head_DV.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)
