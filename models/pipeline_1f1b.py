"""The 1F1B pipeline schedule: every stage alternates the forward of one micro-batch with the
backward of another, so a stage keeps the inputs of a bounded number of micro-batches (at most
2(P-1), whatever M) instead of all M as GPipe's autodiff of a forward scan does.

Autodiff of a forward scan cannot start a micro-batch's backward before the whole forward ends,
so the backward is written out: a program of ticks (`lax.scan`s; the timetable is
models/schedules.py's `table_1f1b`), sharded over the stage dim exactly like GPipe's buffer
(models/pipeline.py), in which each tick every stage may
  - F: run the forward of micro-batch m = t - s and save its stage input in a ring of K slots;
    stage 0 embeds the tokens itself, the last stage applies the head and loss at once and gets
    the cotangent that starts m's backward in the same tick;
  - B: run `jax.vjp` of its stage on the saved input of micro-batch t - 2(P-1) + s (the stage's
    forward is recomputed inside: full-stage remat, which is what bounds memory) and add the weight
    gradients into the carry.
Activations roll one stage forward and activation gradients one stage back per tick (one
collective-permute each). The ticks come in three scans: P-1 warm-up ticks (F only), M steady
ticks (F and B), P-1 cool-down ticks (B only), so the program computes (M+P-1)(F+B) per device,
GPipe's cost and bubble (P-1)/(M+P-1).

Why 2(P-1) and not Megatron's P-s: all stages run the same program each tick (one F slot and one B
slot), so an activation needs P-1-s ticks out to the last stage and as many back: stage s holds
2(P-1-s) micro-batches. Megatron's per-stage timetables, where stage s runs a backward while s+1
runs a forward, would compute both F and B on every stage every half tick in this SPMD form (1.5x
the compute) for P-s in flight.

`loss` wraps the schedule in a `jax.custom_vjp` whose forward runs it and keeps the gradients as
residuals, so callers differentiate the objective with `jax.value_and_grad` as for any function.

Letters as in models/pipeline.py; K ring slots (stage inputs kept per stage).
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
from mesh.rules import axis_rules, logical_to_spec
from mesh.shard import entry_axes
from models.pipeline import (
    _REPLICAS,
    FULL_REMAT,
    _act_names,
    _inner_rules,
    _mesh_size,
    _pin,
    replicas,
    stages,
    sum_counts,
)
from models.schedules import (
    EXPLICIT,
    backward_item,
    forward_item,
    phases,
    ring_slots,
    validate,
    w_slots,
    weight_item,
)
from models.split_backward import Split

# ------------------------------------------------------------------------------ the program


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
    repeats: int = 1,
    remat_policy=FULL_REMAT,
    has_aux: bool = False,
    scan_layers: bool = True,
    replica_axes: tuple[str, ...] = ("data",),
    zero_bubble: bool = False,
):
    """-> (objective, (head loss sum, aux)) of the whole batch through the 1F1B schedule; only the
    objective carries a gradient (to `outer_params` and `stack_params`, never to `batch`).

    embed_fn(outer_params, mb) -> x_bTD runs on stage 0, layer_fn(x_bTD, layer_params, mb) -> x_bTD
    (with `has_aux`: (x_bTD, aux)) is one layer of the [L, ...] stack, head_fn(outer_params,
    y_bTD, mb) -> loss sum (float32 scalar) runs on the last stage; `mb` is one piece of `batch`
    (every leaf [B, ...] split into micro-batches as pipeline_apply splits x). The three must be
    pure functions of their arguments (no traced values closed over). The objective is the sum of
    the head's losses plus, with `has_aux`, sum over float aux leaves named in `aux_weights` of
    weight x the leaf's per-layer values summed over layers, averaged over the batch pieces
    (micro-batches x replicas) as pipeline_apply averages aux. `aux` is pipeline_apply's: [L, ...]
    means over the pieces, or () without `has_aux`. Sharding and `replica_axes` as pipeline_apply's.
    `repeats` R > 1 runs interleaved 1F1B: device s holds the layer chunks s, s+P, ... (as the
    circular schedule does, models/pipeline.py) and M must be a multiple of P. `zero_bubble` runs
    ZB-H1 (R = 1): each backward split into its input gradient and its weight gradients, the latter
    deferred (models/schedules.py `table_zb`).
    """
    kw = dict(
        stages=stages,
        microbatches=microbatches,
        repeats=repeats,
        remat_policy=remat_policy,
        has_aux=has_aux,
        scan_layers=scan_layers,
        replica_axes=replica_axes,
        zero_bubble=zero_bubble,
    )
    run = functools.partial(_schedule, embed_fn, layer_fn, head_fn, **kw)
    aux_weights = {} if aux_weights is None else aux_weights
    batch_zeros = jax.tree.map(lambda a: (a.shape, a.dtype), batch)

    @jax.custom_vjp
    def objective(outer, stack, batch, weights):
        return run(outer, stack, batch, weights, backward=False)[0]

    def fwd(outer, stack, batch, weights):  # the whole schedule; its gradients are the residuals
        return run(outer, stack, batch, weights, backward=True)

    def bwd(grads, ct):  # the objective is a sum: its cotangent scales the gradients
        ct_objective = ct[0]
        scaled = jax.tree.map(lambda g: (g * ct_objective).astype(g.dtype), grads)
        zero = lambda sd: np.zeros(
            sd[0], jax.dtypes.float0 if not jnp.issubdtype(sd[1], jnp.inexact) else sd[1]
        )
        return (
            *scaled,
            jax.tree.map(zero, batch_zeros, is_leaf=lambda x: isinstance(x, tuple)),
            jax.tree.map(jnp.zeros_like, aux_weights),
        )

    objective.defvjp(fwd, bwd)
    return objective(outer_params, stack_params, batch, aux_weights)


def _schedule(
    embed_fn,
    layer_fn,
    head_fn,
    outer,
    stack,
    batch,
    aux_weights,
    *,
    stages,
    microbatches,
    repeats,
    remat_policy,
    has_aux,
    scan_layers,
    replica_axes,
    zero_bubble,
    backward,
):
    """-> ((objective, (head loss, aux)), (d_outer, d_stack) or None)."""
    L, B = jax.tree.leaves(stack)[0].shape[0], jax.tree.leaves(batch)[0].shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes = entry_axes(logical_to_spec(("stages", "batch"))[1]) if not mesh.empty else ()
    replicas = tuple(a for a in batch_axes if a in replica_axes and mesh.shape[a] > 1)
    with axis_rules(_inner_rules(replicas)):
        schedule = "zb_h1" if zero_bubble else EXPLICIT[repeats > 1]
        validate(
            n_layers=L,
            batch=B,
            stages=stages,
            microbatches=microbatches,
            repeats=repeats,
            schedule=schedule,
            batch_shards=_mesh_size(batch_axes),
        )
        return _Program(
            embed_fn,
            layer_fn,
            head_fn,
            stages,
            microbatches,
            repeats,
            _mesh_size(replicas),
            L,
            remat_policy,
            has_aux,
            scan_layers,
            schedule,
        ).run(outer, stack, batch, aux_weights, backward)


class _Program:
    """The tick program for one shape (P, M, R, A, J): the vmapped stage pieces and the tick body."""

    def __init__(
        self,
        embed_fn,
        layer_fn,
        head_fn,
        P,
        M,
        R,
        A,
        L,
        remat_policy,
        has_aux,
        scan_layers,
        schedule,
    ):
        self.embed_fn, self.head_fn, self.P, self.M, self.R, self.A, self.L = (
            embed_fn,
            head_fn,
            P,
            M,
            R,
            A,
            L,
        )
        self.schedule, self.KW = schedule, w_slots(P, M)
        self.J, self.K = L // (P * R), ring_slots(P, M, R)
        mesh_empty = jax.sharding.get_abstract_mesh().empty
        self.stage_axis = None if mesh_empty else logical_to_spec(("stages",))[0]
        self.replica_axis = logical_to_spec((_REPLICAS,))[0] if A > 1 else None

        def layer_at(x_bTD, p_J, k, mb):
            # the layer's weights are picked inside the remat region (as in pipeline_apply)
            out = layer_fn(x_bTD, jax.tree.map(lambda a: a[k], p_J), mb)
            return out if has_aux else (out, ())

        layer = layer_at if remat_policy is None else jax.checkpoint(layer_at, policy=remat_policy)
        self.stage = lambda x_bTD, p_J, mb: jax.lax.scan(
            lambda x, k: layer(x, p_J, k, mb),
            x_bTD,
            jnp.arange(self.J),
            unroll=1 if scan_layers else self.J,
        )

    def vmapped(self, fn, in_axes):
        """fn over one piece -> over [P, A, ...]: replicas inside, stages outside, as pipeline_apply."""
        inner = jax.vmap(fn, in_axes=in_axes, spmd_axis_name=self.replica_axis)
        return jax.vmap(inner, in_axes=in_axes, spmd_axis_name=self.stage_axis)

    def aux_objective(self, aux_J, weights):
        """The stage's aux term of the objective for one piece (see `loss`)."""
        terms = [
            jnp.sum(aux_J[k]) * w / (self.M * self.A)
            for k, w in weights.items()
            if isinstance(aux_J, dict) and k in aux_J
        ]
        return sum(terms, jnp.zeros((), jnp.float32))

    def forward(
        self, x_in, p_J, outer, mb, first, weights
    ):  # one piece -> (y, aux_J, aux objective)
        x = jnp.where(first, self.embed_fn(outer, mb).astype(x_in.dtype), x_in)
        y, aux_J = self.stage(x, p_J, mb)
        return y, aux_J, self.aux_objective(aux_J, weights)

    def backward(self, x_in, p_J, outer, mb, first, weights, ct_y):  # -> (d x_in, d p_J, d outer)
        def f(x_in, p_J, outer):
            y, _, aux_obj = self.forward(x_in, p_J, outer, mb, first, weights)
            return y, aux_obj

        _, vjp = jax.vjp(f, x_in, p_J, outer)
        return vjp((ct_y, jnp.ones((), jnp.float32)))

    def split_backward(self, run_bwd, args: tuple) -> tuple[Split, list[int]]:
        """The vmapped `backward` split (models/split_backward.py) -> (split, stage dims):
        split.b(x_in, p_J, outer, mb, first, weights, ct_y) -> (d x_in, saved) and
        split.w(saved, p_J, outer, mb, first, weights) -> (d p_J, d outer), all [P, A, ...] but
        outer and weights; stage dims: where each saved value has its stage dim. The split is of
        the batched program (a shard_map inside, such as the MoE experts', is batched by vmap before
        autodiff, as in `backward`), so the stage dim is found by a second, abstract trace with
        twice the stages: the one dim that doubles."""
        fn = lambda *a: (lambda dx, dp, do: (dx, (dp, do)))(*run_bwd(*a))
        split = Split(fn, args, keep_argnums=(1, 2, 3, 4, 5))
        twice = lambda t: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((2 * a.shape[0], *a.shape[1:]), a.dtype), t
        )
        probe_args = tuple(twice(a) if i not in (2, 5) else a for i, a in enumerate(args))
        probe = Split(fn, probe_args, keep_argnums=(1, 2, 3, 4, 5))
        one, two = jax.eval_shape(split.b, *args)[1], jax.eval_shape(probe.b, *probe_args)[1]
        dims = []
        for a, b in zip(
            one, two, strict=True
        ):  # None: no stage dim (an iota, the zeros of a select's transpose)
            grown = [d for d, (n, m) in enumerate(zip(a.shape, b.shape)) if m != n]
            assert not grown or (len(grown) == 1 and b.shape[grown[0]] == 2 * a.shape[grown[0]]), (
                a.shape,
                b.shape,
            )
            dims.append(grown[0] if grown else None)
        return split, dims

    @staticmethod
    def stage_first(x, d, P):
        """A saved value with its stage dim first ([P, ...]; one without gets one, every stage a copy)."""
        return jnp.broadcast_to(x, (P, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)

    @staticmethod
    def stage_back(x_P, d):
        """The inverse of stage_first: a value without stage dim is stage 0's copy, written by
        stage 0 in the tick that reads it (its W runs in its B's tick)."""
        return x_P[0] if d is None else jnp.moveaxis(x_P, 0, d)

    def head(self, outer, y, mb, backward):  # -> (loss, d outer, d y) or (loss, None, None)
        if not backward:
            return self.head_fn(outer, y, mb), None, None
        value, vjp = jax.vjp(lambda o, y: self.head_fn(o, y, mb), outer, y)
        return (value, *vjp(jnp.ones_like(value)))

    def run(self, outer, stack, batch, weights, backward):
        # One function on purpose (~95 lines): the tick body and its masks are closures over the
        # same shapes, names and vmapped pieces; split, each piece would take them all.
        P, M, R, A, J, K = self.P, self.M, self.R, self.A, self.J, self.K
        stage_P, last_P = jnp.arange(P), jnp.arange(P) == P - 1
        mask = lambda ok_P, a: jnp.where(
            ok_P.reshape(P, *[1] * (a.ndim - 1)), a, jnp.zeros((), a.dtype)
        )
        add = lambda acc, ok_P, g: jax.tree.map(
            lambda s, x: s + mask(ok_P, x.astype(s.dtype)), acc, g
        )
        per_stage = lambda fn: jax.vmap(fn, spmd_axis_name=self.stage_axis)
        by_replica = lambda ok_P: jnp.broadcast_to(ok_P[:, None], (P, A))

        def add_at(
            acc, ok_P, r_P, g
        ):  # g [P, A, J, ...] into acc [P, A, R, J, ...] at each stage's chunk r
            hit_PR = (jnp.arange(R) == r_P[:, None]) & ok_P[:, None]
            return jax.tree.map(
                lambda s, x: (
                    s
                    + jnp.where(
                        hit_PR.reshape(P, 1, R, *[1] * (x.ndim - 2)),
                        x[:, :, None].astype(s.dtype),
                        0,
                    )
                ),
                acc,
                g,
            )

        # [L, ...] -> [P, A, R, J, ...]: layer (r*P + s)*J + k sits at [s, :, r, k]; the A copies are
        # views of one stage's weights, one per replica, so that each replica's gradient stays local
        # until the one reduction at the end
        stack_PARJ = jax.tree.map(
            lambda a: _pin(
                jnp.broadcast_to(
                    jnp.moveaxis(a.reshape(R, P, J, *a.shape[1:]), 1, 0)[:, None],
                    (P, A, R, J, *a.shape[1:]),
                ),
                ("stages", _REPLICAS),
                2,
            ),
            stack,
        )
        chunk = lambda r_P: jax.tree.map(
            lambda a: _pin(
                per_stage(lambda a_ARJ, r: a_ARJ[:, r])(a, r_P) if R > 1 else a[:, :, 0],
                ("stages", _REPLICAS),
                2,
            ),
            stack_PARJ,
        )
        b = jax.tree.leaves(batch)[0].shape[0] // M
        batch_M = jax.tree.map(
            lambda a: _pin(
                a.reshape(A, b // A, M, *a.shape[1:]).transpose(2, 0, 1, *range(3, a.ndim + 2)),
                (None, _REPLICAS) + _act_names(a.ndim),
            ),
            batch,
        )
        pick = lambda m_P: jax.tree.map(
            lambda a: _pin(
                a[jnp.clip(m_P, 0, M - 1)], ("stages", _REPLICAS) + _act_names(a.ndim - 2)
            ),
            batch_M,
        )
        x_shape = jax.eval_shape(self.embed_fn, outer, jax.tree.map(lambda a: a[0, 0], batch_M))
        state_names = ("stages", _REPLICAS) + _act_names(len(x_shape.shape))
        zeros = lambda *lead, dt=x_shape.dtype: jnp.zeros((*lead, *x_shape.shape), dt)
        f32 = lambda tree, *lead: jax.tree.map(
            lambda a: jnp.zeros((*lead, *a.shape), jnp.float32), tree
        )
        run_fwd = self.vmapped(self.forward, (0, 0, None, 0, 0, None))
        run_bwd = self.vmapped(self.backward, (0, 0, None, 0, 0, None, 0))
        run_head = self.vmapped(lambda o, y, mb: self.head(o, y, mb, backward), (None, 0, 0))
        zb = backward and self.schedule == "zb_h1"
        if zb:  # the backward in two: B (input gradient) now, W (weight gradients) s ticks later
            shapes = jax.eval_shape(lambda: (pick(stage_P), chunk(stage_P * 0)))
            x_PA = jax.ShapeDtypeStruct((P, A, *x_shape.shape), x_shape.dtype)
            split, stage_dims = self.split_backward(
                run_bwd,
                (
                    x_PA,
                    shapes[1],
                    outer,
                    shapes[0],
                    jax.ShapeDtypeStruct((P, A), jnp.bool_),
                    weights,
                    x_PA,
                ),
            )
            saved_shapes = jax.eval_shape(
                split.b,
                x_PA,
                shapes[1],
                outer,
                shapes[0],
                jax.ShapeDtypeStruct((P, A), jnp.bool_),
                weights,
                x_PA,
            )[1]

        def tick(c, t, slots):
            do_f, do_head, do_b, do_w = (
                "F" in slots,
                "H" in slots,
                "B" in slots and backward,
                "W" in slots and backward,
            )
            m_f, r_f, i_f, ok_f = forward_item(t, stage_P, P, M, R)
            m_b, r_b, i_b, ok_b = backward_item(t, stage_P, P, M, R)
            head_P = last_P & (r_f == R - 1)  # the last virtual stage: the head runs after it
            c = dict(c)
            if do_f:  # stage 0 embeds the tokens on its first chunk, else runs what was rolled in
                mb_f = pick(m_f)
                y, aux_J, aux_obj = run_fwd(
                    c["fwd"],
                    chunk(r_f),
                    outer,
                    mb_f,
                    by_replica((stage_P == 0) & (r_f == 0)),
                    weights,
                )
                c["loss"] = c["loss"] + mask(ok_f, aux_obj)
                c["aux"] = add_at(c["aux"], ok_f, r_f, jax.tree.map(lambda a: a / (M * A), aux_J))
            if (
                do_head
            ):  # the last virtual stage turns micro-batch m_f into its loss and the cotangent of y
                value, d_outer, dy = run_head(outer, y, mb_f)
                c["head"] = c["head"] + mask(ok_f & head_P, value)
            if do_b:
                saved = per_stage(lambda r, i: r[i])(
                    c["ring"], i_b % K
                )  # read before this tick's forward reuses the slot
                if do_head:  # the last virtual stage's backward is of this tick's forward: its input, the head's cotangent
                    at_head = (last_P & (r_b == R - 1)).reshape(P, *[1] * (saved.ndim - 1))
                    x_b, ct = jnp.where(at_head, c["fwd"], saved), jnp.where(at_head, dy, c["bwd"])
                else:
                    x_b, ct = saved, c["bwd"]
                args = (
                    _pin(x_b, state_names),
                    chunk(r_b),
                    outer,
                    pick(m_b),
                    by_replica((stage_P == 0) & (r_b == 0)),
                    weights,
                    _pin(ct, state_names),
                )
                if zb:  # keep what W reads in its slot until tick m + 2(P-1), stage dim first
                    dx, saved = split.b(*args)
                    write = lambda r, x, i, ok: jax.lax.dynamic_update_index_in_dim(
                        r, jnp.where(ok, x, r[i]), i, 0
                    )
                    c["w_ring"] = [
                        _pin(
                            per_stage(write)(r, self.stage_first(x, d, P), m_b % self.KW, ok_b),
                            ("stages",),
                            1,
                        )
                        for r, x, d in zip(c["w_ring"], saved, stage_dims)
                    ]
                else:
                    dx, dp, d_o = run_bwd(*args)
                    c["d_stack"], c["d_outer"] = (
                        add_at(c["d_stack"], ok_b, r_b, dp),
                        add(c["d_outer"], ok_b, d_o),
                    )
                if do_head:
                    c["d_outer"] = add(c["d_outer"], ok_f & head_P, d_outer)
                c["bwd"] = _pin(
                    jnp.roll(dx, -1, axis=0), state_names
                )  # stage s's input gradient -> s-1 (0 -> P-1)
            if do_w:  # every stage: the weight gradients of micro-batch t - 2(P-1)
                m_w, ok_w = weight_item(t, P, M)
                m_P, ok_P = jnp.full((P,), m_w), jnp.broadcast_to(ok_w, (P,))
                saved = [
                    self.stage_back(r[:, m_w % self.KW], d) for r, d in zip(c["w_ring"], stage_dims)
                ]
                dp, d_o = split.w(
                    saved,
                    chunk(jnp.zeros((P,), jnp.int32)),
                    outer,
                    pick(m_P),
                    by_replica(stage_P == 0),
                    weights,
                )
                c["d_stack"] = add_at(c["d_stack"], ok_P, jnp.zeros((P,), jnp.int32), dp)
                c["d_outer"] = add(c["d_outer"], ok_P, d_o)
            if do_f and backward:
                write = lambda r, x, i, ok: jax.lax.dynamic_update_index_in_dim(
                    r, jnp.where(ok, x, r[i]), i, 0
                )
                c["ring"] = per_stage(write)(c["ring"], c["fwd"], i_f % K, ok_f)
            if do_f:
                c["fwd"] = _pin(
                    jnp.roll(y, 1, axis=0), state_names
                )  # stage s's output -> s+1 (P-1 -> 0)
            return c, None

        aux_shape = jax.eval_shape(
            lambda: self.stage(
                zeros(),
                jax.tree.map(lambda a: a[0, 0, 0], stack_PARJ),
                jax.tree.map(lambda a: a[0, 0], batch_M),
            )[1]
        )
        c = {
            "fwd": _pin(zeros(P, A), state_names),
            "loss": jnp.zeros((P, A)),
            "head": jnp.zeros((P, A)),
            "aux": f32(aux_shape, P, A, R),
        }
        if backward:
            ring = _pin(
                zeros(P, K, A), ("stages", None, _REPLICAS) + _act_names(len(x_shape.shape))
            )
            c |= {
                "bwd": _pin(zeros(P, A), state_names),
                "ring": ring,
                "d_outer": f32(outer, P, A),
                "d_stack": jax.tree.map(
                    lambda a: jnp.zeros((P, A, R, J, *a.shape[1:]), jnp.float32), stack
                ),
            }
        if zb:
            c["w_ring"] = [
                _pin(
                    jnp.zeros(
                        (P, self.KW, *(sd.shape if d is None else np.delete(sd.shape, d))), sd.dtype
                    ),
                    ("stages",),
                    1,
                )
                for sd, d in zip(saved_shapes, stage_dims)
            ]
        for _, start, count, slots in phases(self.schedule, P, M, R):
            if count and (backward or "F" in slots):
                c, _ = jax.lax.scan(
                    functools.partial(tick, slots=slots), c, jnp.arange(start, start + count)
                )
        # [P, R, J] -> [R, P, J]: layer order
        in_layer_order = lambda a: jnp.swapaxes(a.sum(axis=1), 0, 1).reshape(self.L, *a.shape[4:])
        aux = jax.tree.map(in_layer_order, c["aux"])
        head_sum = c["head"].sum()
        out = (c["loss"].sum() + head_sum, (head_sum, aux))
        if not backward:
            return out, None
        d_stack = jax.tree.map(lambda g, p: in_layer_order(g).astype(p.dtype), c["d_stack"], stack)
        d_outer = jax.tree.map(lambda g, p: g.sum(axis=(0, 1)).astype(p.dtype), c["d_outer"], outer)
        return out, (d_outer, d_stack)


# ------------------------------------------------------------------------------ the decoder


def runs(cfg, pipeline) -> bool:
    """Whether the train step's objective goes through `decoder_loss`: --pipeline.schedule 1f1b or
    interleaved_1f1b on a mesh whose pipeline axis is > 1 (elsewhere the schedule is moot)."""
    if pipeline is None or pipeline.schedule not in EXPLICIT or stages() < 2:
        return False
    check_model(cfg, pipeline.schedule)
    check_backend(cfg, pipeline.schedule)
    return True


def check_model(cfg, schedule: str) -> None:
    """One line for a model these schedules do not run (on any backend: `plan --search` asks too)."""
    if getattr(cfg, "arch", ""):
        raise UserError(
            f"--pipeline.schedule {schedule} runs the built-in decoder only, not the registered"
            f" model '{cfg.arch}'; valid schedules for it: gpipe, circular"
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
            f" or use a schedule that runs MoE with any pool: gpipe, circular"
        )


def decoder_loss(
    cfg, params: dict, batch: dict, pipeline, token_loss: Callable, stat_weights: dict
):
    """The built-in decoder's objective through the 1F1B schedule -> (objective, loss sum, MoE stats
    as Decoder returns them, {} when dense). `token_loss(logits_bTV, mb) -> loss_bT` is the
    per-token loss; the objective is sum(loss_BT x weights) + sum over `stat_weights` of weight x
    the stat's mean over MoE layers. Call it on a mesh with pipeline > 1."""
    from models import model as model_lib  # imported here: both import the pipeline
    from models import transformer

    pieces, outer, stack = model_lib.module(cfg, params).pieces(token_loss)
    P = stages()
    n_groups = cfg.n_layers // pieces.per_group
    positions_BT = batch.get("positions")
    if positions_BT is None:
        positions_BT = transformer.default_positions(
            batch.get("segment_ids"), batch["inputs"].shape
        )
    M = pipeline.microbatches_for(P)
    objective, (loss_sum, stats) = loss(
        lambda o, mb: pieces.embed(o, mb["inputs"]),
        lambda x_bTD, p, mb: pieces.group(x_bTD, p, mb["positions"], mb.get("segment_ids")),
        pieces.head,
        outer,
        stack,
        {**batch, "positions": positions_BT},
        {k: w / n_groups for k, w in stat_weights.items()},
        stages=P,
        microbatches=M,
        repeats=pipeline.repeats,
        remat_policy=pieces.remat_policy,
        has_aux=True,
        scan_layers=cfg.scan_layers,
        replica_axes=pipeline.replica_axes,
        zero_bubble=pipeline.schedule == "zb_h1",
    )
    pieces_M = M * replicas(pipeline.replica_axes)
    return objective, loss_sum, sum_counts(stats, pieces.count_stats, pieces_M)
