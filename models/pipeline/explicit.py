"""The explicit engine: schedules whose backward is written out tick by tick (1f1b,
interleaved_1f1b, zb_h1), so that every stage alternates the forward of one micro-batch with the
backward of another and keeps the inputs of a bounded number of micro-batches (at most 2(P-1) for
1F1B, whatever M) instead of all M as autodiff of a forward scan does (gpipe.py).

Autodiff of a forward scan cannot start a micro-batch's backward before the whole forward ends,
so the backward is a program of ticks (`lax.scan`s over runs of ticks with the same slots: the
timetable's `slots`, timetables.py), sharded over the stage dim exactly like the forward scan's
buffer, in which each tick every stage may
  - F: run the forward of the micro-batch its timetable names and save its stage input in a ring
    of K slots; stage 0 embeds the tokens itself, the last stage applies the head and loss at once
    (H) and gets the cotangent that starts the micro-batch's backward in the same tick;
  - B: run `jax.vjp` of its stage on a saved input (the stage's forward is recomputed inside:
    full-stage remat, which is what bounds memory) and add the weight gradients into the carry;
    where the timetable defers them (zb_h1), B is the input gradient alone (split_backward.py);
  - W: the deferred weight gradients, from what B saved for them.
Activations roll one stage forward and activation gradients one stage back per tick (one
collective-permute each). For 1F1B the ticks come in three scans: P-1 warm-up ticks (F only), M
steady ticks (F and B), P-1 cool-down ticks (B only), so the program computes (M+P-1)(F+B) per
device, GPipe's cost and bubble (P-1)/(M+P-1).

Why 2(P-1) and not Megatron's P-s: all stages run the same program each tick (one F slot and one B
slot), so an activation needs P-1-s ticks out to the last stage and as many back: stage s holds
2(P-1-s) micro-batches. Megatron's per-stage timetables, where stage s runs a backward while s+1
runs a forward, would compute both F and B on every stage every half tick in this SPMD form (1.5x
the compute) for P-s in flight.

`loss` wraps the schedule in a `jax.custom_vjp` whose forward runs it and keeps the gradients as
residuals, so callers differentiate the objective with `jax.value_and_grad` as for any function.
The pieces are program.py (what a stage runs on one piece) and ticks.py (the tick body).

Letters as in models/pipeline/__init__.py.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from errors import UserError
from mesh import xla
from mesh.rules import axis_rules
from models.pipeline.checks import validate
from models.pipeline.layout import batch_axes, inner_rules, mesh_size, replica_axes_of
from models.pipeline.program import Program
from models.pipeline.ticks import Run
from models.pipeline.timetables import FORWARD_SCAN, TIMETABLES, timetable

FULL_REMAT = jax.checkpoint_policies.nothing_saveable


def loss(
    embed_fn: Callable,
    layer_fn: Callable,
    head_fn: Callable,
    outer_params: Any,
    stack_params: Any,
    batch: dict,
    aux_weights: dict | None = None,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    repeats: int = 1,
    remat_policy=FULL_REMAT,
    has_aux: bool = False,
    scan_layers: bool = True,
    replica_axes: tuple[str, ...] = ("data",),
):
    """-> (objective, (head loss sum, aux)) of the whole batch through an explicit `schedule`;
    only the objective carries a gradient (to `outer_params` and `stack_params`, never to `batch`).

    embed_fn(outer_params, mb) -> x_bTD runs on stage 0, layer_fn(x_bTD, layer_params, mb) -> x_bTD
    (with `has_aux`: (x_bTD, aux)) is one layer of the [L, ...] stack, head_fn(outer_params,
    y_bTD, mb) -> loss sum (float32 scalar) runs on the last stage; `mb` is one piece of `batch`
    (every leaf [B, ...] split into micro-batches as pipeline_apply splits x). The three must be
    pure functions of their arguments (no traced values closed over). The objective is the sum of
    the head's losses plus, with `has_aux`, sum over float aux leaves named in `aux_weights` of
    weight x the leaf's per-layer values summed over layers, averaged over the batch pieces
    (micro-batches x replicas) as pipeline_apply averages aux. `aux` is pipeline_apply's: [L, ...]
    means over the pieces, or () without `has_aux`. Sharding and `replica_axes` as pipeline_apply's.
    `repeats` R > 1 (interleaved_1f1b): device s holds the layer chunks s, s+P, ... (as the
    circular schedule does) and M must be a multiple of P. zb_h1 (R = 1) splits each backward into
    its input gradient and its weight gradients, the latter deferred (timetables.table_zb).
    """
    # Long on purpose: the docstring above is the contract every explicit schedule keeps; the
    # body (~30 lines) is one custom_vjp around the schedule and reads best whole.
    kw = dict(
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        repeats=repeats,
        remat_policy=remat_policy,
        has_aux=has_aux,
        scan_layers=scan_layers,
        replica_axes=replica_axes,
    )
    run = functools.partial(_schedule, (embed_fn, layer_fn, head_fn), **kw)
    aux_weights = {} if aux_weights is None else aux_weights
    batch_zeros = jax.tree.map(lambda a: (a.shape, a.dtype), batch)

    @jax.custom_vjp
    def objective(outer, stack, batch, weights):
        return run(outer, stack, batch, weights, backward=False)[0]

    def fwd(outer, stack, batch, weights):  # the whole schedule; its gradients are the residuals
        return run(outer, stack, batch, weights, backward=True)

    def zero(sd):  # no gradient to the batch: float0 for integer leaves
        return np.zeros(sd[0], sd[1] if jnp.issubdtype(sd[1], jnp.inexact) else jax.dtypes.float0)

    def bwd(grads, ct):  # the objective is a sum: its cotangent scales the gradients
        ct_objective = ct[0]
        scaled = jax.tree.map(lambda g: (g * ct_objective).astype(g.dtype), grads)
        return (
            *scaled,
            jax.tree.map(zero, batch_zeros, is_leaf=lambda x: isinstance(x, tuple)),
            jax.tree.map(jnp.zeros_like, aux_weights),
        )

    objective.defvjp(fwd, bwd)
    return objective(outer_params, stack_params, batch, aux_weights)


def _schedule(fns, outer, stack, batch, aux_weights, *, backward, **kw):
    """-> ((objective, (head loss, aux)), (d_outer, d_stack) or None)."""
    L, B = jax.tree.leaves(stack)[0].shape[0], jax.tree.leaves(batch)[0].shape[0]
    P, M, R = kw["stages"], kw["microbatches"], kw["repeats"]
    replicas = replica_axes_of(kw["replica_axes"])
    with axis_rules(inner_rules(replicas)):
        validate(
            n_layers=L,
            batch=B,
            stages=P,
            microbatches=M,
            repeats=R,
            schedule=kw["schedule"],
            batch_shards=mesh_size(batch_axes()),
        )
        tt = timetable(kw["schedule"])
        if tt.slots is None:
            raise ValueError(f"explicit.loss: '{tt.name}' is a forward-scan schedule (gpipe.py)")
        A = mesh_size(replicas)
        prog = Program(fns, tt, P, M, R, A, L, kw["remat_policy"], kw["has_aux"], kw["scan_layers"])
        return Run(prog, outer, stack, batch, aux_weights, backward).run()


# ------------------------------------------------------------------------------ what it can run


def _forward_scan_names() -> str:
    """The schedules that run any model on any pool: those of the forward-scan engine."""
    return ", ".join(t.name for t in TIMETABLES.values() if t.engine == FORWARD_SCAN)


def check_model(cfg, schedule: str) -> None:
    """One line for a model these schedules do not run (on any backend: `plan --search` asks
    too)."""
    if getattr(cfg, "arch", ""):
        raise UserError(
            f"--pipeline.schedule {schedule} runs the built-in decoder only, not the registered"
            f" model '{cfg.arch}'; valid schedules for it: {_forward_scan_names()}"
        )


def check_backend(cfg, schedule: str) -> None:
    """One line for a model these schedules cannot run on this process's devices: MoE on an XLA:CPU
    thread pool too small for a tick's concurrent forward and backward collectives (mesh/xla.py)."""
    devices = jax.local_device_count()
    need, have = (
        xla.CPU_THREADS_PER_DEVICE * devices,
        xla.cpu_pool_threads(os.environ, devices, os.cpu_count() or 1),
    )
    if cfg.n_experts and jax.default_backend() == "cpu" and devices > 1 and have < need:
        raise UserError(
            f"--pipeline.schedule {schedule} runs MoE models (model.n_experts={cfg.n_experts}) on"
            f" {devices} CPU devices only with PJRT_NPROC={need} or more (XLA:CPU's thread pool,"
            f" now {have}: its in-process collectives stop with fewer); set it before starting,"
            f" or use a schedule that runs MoE with any pool: {_forward_scan_names()}"
        )
