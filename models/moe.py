"""Mixture-of-Experts feed-forward layer: router, dropless and capacity dispatch, expert
parallelism.

Shape letters besides the model's: E experts, X experts held by one device (E / expert-axis size),
J experts chosen per token (top-k), U tokens of one device (B*T flattened), A = U*J (token, choice)
assignments, C capacity (slots per expert per device), R rows of a fixed-size dispatch buffer,
F expert width, G blocks of the padded grouped matmul.

The router runs on the global batch under GSPMD, so its statistics (and the balance losses) do
not depend on the mesh. The experts run inside `shard_map`: every device sorts its own tokens'
assignments by destination, exchanges them over the expert axis, computes only its X experts,
and sends the rows back. Dropless exchange (`ep_exchange`, see `exchange_for`): fixed-size
worst-case buffers with all_to_all (XLA:CPU has no ragged all-to-all), or lax.ragged_all_to_all
moving only the real rows (GPU/TPU; an exact emulation on CPU for tests).

Files: the router in models/moe_router.py, one device's dispatch and expert compute in
models/moe_dispatch.py, the grouped matmuls in models/moe_kernels.py; here the layer and the
shard_map that runs the experts on the mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.rules import logical_to_spec
from mesh.shard import entry_axes, spec_axes
from models.config import ModelConfig
from models.layers import MLP, param
from models.moe_comm import reduce_dtype
from models.moe_dispatch import dispatch_local, exchange_for
from models.moe_router import route

W_EDF = ("experts", "expert_embed", "expert_mlp")
W_EFD = ("experts", "expert_mlp", "expert_embed")
TOKENS_BT = ("batch", "seq", None)


def kernel_for(cfg: ModelConfig) -> str:
    """The dropless grouped matmul: ragged_dot where it is fast (GPU/TPU); on CPU ragged_dot costs
    about as much as every expert on every row (measured), so padded blocks, empty ones skipped."""
    if cfg.dropless_kernel != "auto":
        return cfg.dropless_kernel
    return "blocks" if jax.default_backend() == "cpu" else "ragged"


def experts(
    cfg: ModelConfig,
    x_BTD,
    idx_BTJ,
    gate_BTJ,
    wg_EDF,
    wu_EDF,
    wd_EFD,
    kernel: str | None = None,
    exchange: str | None = None,
):
    """The routed experts on whatever mesh is in context -> (y [B,T,D], dropped assignments).
    `kernel`, `exchange`: override `kernel_for` / `exchange_for` (tests: exchange="ragged" lowers
    the real ragged_all_to_all on any backend)."""
    local = functools.partial(
        dispatch_local,
        n_experts=cfg.n_experts,
        mode=cfg.dispatch,
        capacity_factor=cfg.capacity_factor,
        kernel=kernel or kernel_for(cfg),
        exchange=exchange or exchange_for(cfg),
    )
    mesh = jax.sharding.get_abstract_mesh()
    x_spec, w_spec, wd_spec = (logical_to_spec(n) for n in (TOKENS_BT, W_EDF, W_EFD))
    if mesh.empty:
        return local(x_BTD, idx_BTJ, gate_BTJ, wg_EDF, wu_EDF, wd_EFD)

    # size-1 axes stay automatic: collectives over them would still be emitted as copies
    def real(entry):
        return tuple(a for a in entry_axes(entry) if mesh.shape[a] > 1)

    specs = tuple(P(*(real(e) or None for e in s)) for s in (x_spec, w_spec, wd_spec))
    named = set().union(*map(spec_axes, specs))
    if not named:
        return local(x_BTD, idx_BTJ, gate_BTJ, wg_EDF, wu_EDF, wd_EFD)
    return _on_mesh(local, mesh, specs, named, x_BTD, idx_BTJ, gate_BTJ, wg_EDF, wu_EDF, wd_EFD)


def _on_mesh(local, mesh, specs, named, x_BTD, idx_BTJ, gate_BTJ, wg_EDF, wu_EDF, wd_EFD):
    """`local` (dispatch_local with the layer's settings) inside shard_map over the mesh's real
    axes; `specs`: the tokens', the gate/up weights' and the down weight's PartitionSpecs, which
    name the axes `named`."""
    x_spec, w_spec, wd_spec = specs
    # Real axes that no spec names are those a vmap with spmd_axis_name may add (data-parallel
    # micro-batches in train/core/step.py, which drop them from the batch rule). jax 0.10 adds them
    # to the specs but not to the manual set, so they are made manual here; and it batches scan/cond
    # bodies without their vma (batching._batch_jaxpr_axes), which the vma check rejects, so the
    # check is off then (the collectives here are all over named, varying axes: their transposes
    # stay exact, tests/test_moe.py checks the gradients).
    manual = {a for a, size in mesh.shape.items() if size > 1}
    check_vma = manual <= named
    local = functools.partial(local, vmapped=not check_vma)
    ep_axes, token_axes = entry_axes(w_spec[0]), entry_axes(x_spec[0])
    ep = math.prod(mesh.shape[a] for a in ep_axes)
    if not set(ep_axes) <= set(token_axes):
        raise UserError(
            f"--parallelism.rules: the experts dim is sharded over {ep_axes}, which must also shard"
            f" the batch (now {token_axes}) so that every expert device holds its own tokens"
        )
    body = functools.partial(
        local,
        ep_axes=ep_axes,
        ep=ep,
        embed_axes=entry_axes(w_spec[1]),
        tp_axes=entry_axes(w_spec[2]),
        token_axes=token_axes,
    )
    # on CPU every input enters in float32 and is cast to the compute dtype inside, so that the
    # sums of their gradients over the axes they are not split on run in float32 (reduce_dtype)
    body = functools.partial(body, dtype=x_BTD.dtype)
    x_BTD, gate_BTJ, wg_EDF, wu_EDF, wd_EFD = (
        a.astype(reduce_dtype(a.dtype)) for a in (x_BTD, gate_BTJ, wg_EDF, wu_EDF, wd_EFD)
    )
    return jax.shard_map(
        body,
        in_specs=(x_spec, x_spec, x_spec, w_spec, w_spec, wd_spec),
        out_specs=(x_spec, P()),
        axis_names=frozenset(manual),
        check_vma=check_vma,
    )(x_BTD, idx_BTJ, gate_BTJ, wg_EDF, wu_EDF, wd_EFD)


# ------------------------------------------------------------------ the layer


def has_router_bias(cfg: ModelConfig) -> bool:
    """Whether the MoE layers hold the aux-loss-free selection bias: trained (router_bias_rate) or
    kept as imported (router_bias)."""
    return cfg.router_bias or cfg.router_bias_rate > 0


class MoE(nnx.Module):
    """Routed experts (+ optional always-on shared experts). Returns (y [B,T,D], stats)."""

    def __init__(self, cfg: ModelConfig, dtype, param_dtype, *, rngs: nnx.Rngs):
        d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_width
        self.router_DE = param(
            rngs, (d, e), ("embed", "router_experts"), param_dtype, std=cfg.init_std
        )
        if has_router_bias(cfg):  # updated by the train step from the loads, never by gradients
            self.router_bias_E = param(rngs, (e,), ("router_experts",), jnp.float32, zeros=True)
        self.w_gate_EDF = param(rngs, (e, d, f), W_EDF, param_dtype, fan_in=d)
        self.w_up_EDF = param(rngs, (e, d, f), W_EDF, param_dtype, fan_in=d)
        self.w_down_EFD = param(rngs, (e, f, d), W_EFD, param_dtype, fan_in=f)
        if cfg.n_shared_experts:
            self.shared = MLP(
                d,
                cfg.n_shared_experts * f,
                dtype,
                param_dtype,
                rngs=rngs,
                fp8_matmuls=cfg.matmul_precision == "fp8",
            )
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x_BTD: jax.Array):
        bias = self.router_bias_E[...] if has_router_bias(self.cfg) else None
        idx_BTJ, gate_BTJ, stats = route(self.cfg, x_BTD, self.router_DE[...], bias)
        dt = self.dtype
        y_BTD, dropped = experts(
            self.cfg,
            x_BTD,
            idx_BTJ,
            gate_BTJ.astype(dt),
            *(w[...].astype(dt) for w in (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD)),
        )
        if self.cfg.n_shared_experts:
            y_BTD = y_BTD + self.shared(x_BTD)
        return y_BTD, {**stats, "dropped": dropped}
