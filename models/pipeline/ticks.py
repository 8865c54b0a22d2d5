"""The explicit program's ticks on one set of arrays: the layer stack and the batch laid out over
stages and replicas, the carry (the activation and gradient in flight, the ring of stage inputs,
the gradient sums), and the tick body that runs the slots of the timetable (F forward, H head,
B backward or input gradient, W weight gradients) masked where a stage has nothing to run.

Letters as in models/pipeline/__init__.py; K ring slots (stage inputs kept per stage), KW the W
inputs' slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.pipeline.layout import REPLICAS, act_names, pin, split_microbatches
from models.pipeline.program import Program


def _mask(ok_P, a):
    """a where the stage's flag is set, else zeros."""
    return jnp.where(ok_P.reshape(ok_P.shape[0], *[1] * (a.ndim - 1)), a, jnp.zeros((), a.dtype))


def _add(acc, ok_P, g):
    return jax.tree.map(lambda s, x: s + _mask(ok_P, x.astype(s.dtype)), acc, g)


def _write(ring, x, i, ok):
    """Slot i of one stage's ring becomes x where ok."""
    return jax.lax.dynamic_update_index_in_dim(ring, jnp.where(ok, x, ring[i]), i, 0)


class Run:
    """One run of `prog` on (outer, stack, batch, weights); `backward`: also the gradients."""

    def __init__(self, prog: Program, outer, stack, batch, weights, backward: bool):
        P, M, R, A, J = prog.P, prog.M, prog.R, prog.A, prog.J
        self.prog, self.tt, self.outer, self.weights = prog, prog.tt, outer, weights
        self.stack, self.backward = stack, backward
        self.stage_P, self.last_P = jnp.arange(P), jnp.arange(P) == P - 1
        self.per_stage = lambda fn: jax.vmap(fn, spmd_axis_name=prog.stage_axis)

        # [L, ...] -> [P, A, R, J, ...]: layer (r*P + s)*J + k sits at [s, :, r, k]; the A copies
        # are views of one stage's weights, one per replica, so that each replica's gradient stays
        # local until the one reduction at the end
        def to_PARJ(a):
            a_PRJ = jnp.moveaxis(a.reshape(R, P, J, *a.shape[1:]), 1, 0)
            return pin(
                jnp.broadcast_to(a_PRJ[:, None], (P, A, R, J, *a.shape[1:])),
                ("stages", REPLICAS),
                2,
            )

        self.stack_PARJ = jax.tree.map(to_PARJ, stack)
        self.batch_M = jax.tree.map(lambda a: split_microbatches(a, M, A), batch)
        one_piece = jax.tree.map(lambda a: a[0, 0], self.batch_M)
        self.x_shape = jax.eval_shape(prog.embed_fn, outer, one_piece)
        self.state_names = ("stages", REPLICAS) + act_names(len(self.x_shape.shape))
        self.run_fwd = prog.vmapped(prog.forward, (0, 0, None, 0, 0, None))
        self.run_bwd = prog.vmapped(prog.backward, (0, 0, None, 0, 0, None, 0))
        self.run_head = prog.vmapped(lambda o, y, mb: prog.head(o, y, mb, backward), (None, 0, 0))
        self.split = None
        if backward and self.tt.splits_backward:
            self.split, self.stage_dims = self.split_backward()

    # -------------------------------------------------------------------------- layout

    def chunk(self, r_P):
        """Each stage's layer chunk r ([P, A, J, ...])."""
        R = self.prog.R

        def one(a):
            a_PAJ = self.per_stage(lambda a_ARJ, r: a_ARJ[:, r])(a, r_P) if R > 1 else a[:, :, 0]
            return pin(a_PAJ, ("stages", REPLICAS), 2)

        return jax.tree.map(one, self.stack_PARJ)

    def pick(self, m_P):
        """Each stage's micro-batch m ([P, A, b/A, ...])."""
        M = self.prog.M
        return jax.tree.map(
            lambda a: pin(a[jnp.clip(m_P, 0, M - 1)], ("stages", REPLICAS) + act_names(a.ndim - 2)),
            self.batch_M,
        )

    def by_replica(self, ok_P):
        return jnp.broadcast_to(ok_P[:, None], (self.prog.P, self.prog.A))

    def add_at(self, acc, ok_P, r_P, g):
        """g [P, A, J, ...] into acc [P, A, R, J, ...] at each stage's chunk r."""
        P, R = self.prog.P, self.prog.R
        hit_PR = (jnp.arange(R) == r_P[:, None]) & ok_P[:, None]

        def one(s, x):
            hit = hit_PR.reshape(P, 1, R, *[1] * (x.ndim - 2))
            return s + jnp.where(hit, x[:, :, None].astype(s.dtype), 0)

        return jax.tree.map(one, acc, g)

    def split_backward(self):
        """The backward in two: B (input gradient) now, W (weight gradients) later."""
        P, A, x_shape = self.prog.P, self.prog.A, self.x_shape
        mb_shapes, chunk_shapes = jax.eval_shape(
            lambda: (self.pick(self.stage_P), self.chunk(self.stage_P * 0))
        )
        x_PA = jax.ShapeDtypeStruct((P, A, *x_shape.shape), x_shape.dtype)
        first = jax.ShapeDtypeStruct((P, A), jnp.bool_)
        args = (x_PA, chunk_shapes, self.outer, mb_shapes, first, self.weights, x_PA)
        split, stage_dims = self.prog.split_backward(self.run_bwd, args)
        self.saved_shapes = jax.eval_shape(split.b, *args)[1]
        return split, stage_dims

    # -------------------------------------------------------------------------- the carry

    def carry0(self) -> dict:
        prog, x_shape = self.prog, self.x_shape
        P, A, R, J, K = prog.P, prog.A, prog.R, prog.J, prog.K

        def zeros(*lead):
            return jnp.zeros((*lead, *x_shape.shape), x_shape.dtype)

        def f32(tree, *lead):
            return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), jnp.float32), tree)

        aux_shape = jax.eval_shape(
            lambda: prog.stage(
                zeros(),
                jax.tree.map(lambda a: a[0, 0, 0], self.stack_PARJ),
                jax.tree.map(lambda a: a[0, 0], self.batch_M),
            )[1]
        )
        c = {
            "fwd": pin(zeros(P, A), self.state_names),
            "loss": jnp.zeros((P, A)),
            "head": jnp.zeros((P, A)),
            "aux": f32(aux_shape, P, A, R),
        }
        if self.backward:
            ring_names = ("stages", None, REPLICAS) + act_names(len(x_shape.shape))
            c |= {
                "bwd": pin(zeros(P, A), self.state_names),
                "ring": pin(zeros(P, K, A), ring_names),
                "d_outer": f32(self.outer, P, A),
                "d_stack": jax.tree.map(
                    lambda a: jnp.zeros((P, A, R, J, *a.shape[1:]), jnp.float32), self.stack
                ),
            }
        if self.split is not None:
            c["w_ring"] = [
                pin(
                    jnp.zeros(
                        (P, prog.KW, *(sd.shape if d is None else np.delete(sd.shape, d))), sd.dtype
                    ),
                    ("stages",),
                    1,
                )
                for sd, d in zip(self.saved_shapes, self.stage_dims)
            ]
        return c

    def run(self):
        """-> ((objective, (head loss, aux)), (d outer, d stack) or None)."""
        c = self.carry0()
        prog = self.prog
        for _, start, count, slots in self.tt.slots(prog.P, prog.M, prog.R):
            if count and (self.backward or "F" in slots):
                tick = functools.partial(self.tick, slots=slots)
                c, _ = jax.lax.scan(tick, c, jnp.arange(start, start + count))

        def in_layer_order(a):
            # [P, R, J] -> [R, P, J]: layer order
            return jnp.swapaxes(a.sum(axis=1), 0, 1).reshape(prog.L, *a.shape[4:])

        aux = jax.tree.map(in_layer_order, c["aux"])
        head_sum = c["head"].sum()
        out = (c["loss"].sum() + head_sum, (head_sum, aux))
        if not self.backward:
            return out, None
        d_stack = jax.tree.map(
            lambda g, p: in_layer_order(g).astype(p.dtype), c["d_stack"], self.stack
        )
        d_outer = jax.tree.map(
            lambda g, p: g.sum(axis=(0, 1)).astype(p.dtype), c["d_outer"], self.outer
        )
        return out, (d_outer, d_stack)

    # -------------------------------------------------------------------------- one tick

    def tick(self, c, t, slots: str):
        c = dict(c)
        f = self.forward_slot(c, t) if "F" in slots else None
        head = self.head_slot(c, f) if "H" in slots else None
        if "B" in slots and self.backward:
            self.backward_slot(c, t, head)
        if "W" in slots and self.backward:
            self.weights_slot(c, t)
        if f is not None:
            self.advance(c, t, f)
        return c, None

    def forward_slot(self, c, t):
        """Stage 0 embeds the tokens on its first chunk, the others run what was rolled in.
        -> (y, the micro-batch, valid, at the last virtual stage)."""
        prog = self.prog
        m_f, r_f, _, ok_f = self.tt.forward_item(t, self.stage_P, prog.P, prog.M, prog.R)
        mb_f = self.pick(m_f)
        first = self.by_replica((self.stage_P == 0) & (r_f == 0))
        y, aux_J, aux_obj = self.run_fwd(
            c["fwd"], self.chunk(r_f), self.outer, mb_f, first, self.weights
        )
        c["loss"] = c["loss"] + _mask(ok_f, aux_obj)
        c["aux"] = self.add_at(
            c["aux"], ok_f, r_f, jax.tree.map(lambda a: a / (prog.M * prog.A), aux_J)
        )
        # the last virtual stage: the head runs after it
        return y, mb_f, ok_f, self.last_P & (r_f == prog.R - 1)

    def head_slot(self, c, f):
        """The last virtual stage turns its micro-batch into its loss and the cotangent of y."""
        y, mb_f, ok_f, head_P = f
        value, d_outer, dy = self.run_head(self.outer, y, mb_f)
        c["head"] = c["head"] + _mask(ok_f & head_P, value)
        return dy, d_outer, ok_f & head_P

    def backward_slot(self, c, t, head):
        prog = self.prog
        P, M, R, K = prog.P, prog.M, prog.R, prog.K
        m_b, r_b, i_b, ok_b = self.tt.backward_item(t, self.stage_P, P, M, R)
        # read before this tick's forward reuses the slot
        saved = self.per_stage(lambda r, i: r[i])(c["ring"], i_b % K)
        x_b, ct = saved, c["bwd"]
        if head is not None:  # the last virtual stage's backward is of this tick's forward
            at_head = (self.last_P & (r_b == R - 1)).reshape(P, *[1] * (saved.ndim - 1))
            x_b, ct = jnp.where(at_head, c["fwd"], saved), jnp.where(at_head, head[0], c["bwd"])
        first = self.by_replica((self.stage_P == 0) & (r_b == 0))
        x_b, ct = pin(x_b, self.state_names), pin(ct, self.state_names)
        args = (x_b, self.chunk(r_b), self.outer, self.pick(m_b), first, self.weights, ct)
        if self.split is not None:  # keep what W reads in its slot until its tick, stage dim first
            dx, saved = self.split.b(*args)
            c["w_ring"] = [
                pin(
                    self.per_stage(_write)(r, prog.stage_first(x, d, P), m_b % prog.KW, ok_b),
                    ("stages",),
                    1,
                )
                for r, x, d in zip(c["w_ring"], saved, self.stage_dims)
            ]
        else:
            dx, dp, d_o = self.run_bwd(*args)
            c["d_stack"] = self.add_at(c["d_stack"], ok_b, r_b, dp)
            c["d_outer"] = _add(c["d_outer"], ok_b, d_o)
        if head is not None:
            c["d_outer"] = _add(c["d_outer"], head[2], head[1])
        # stage s's input gradient -> s-1 (0 -> P-1)
        c["bwd"] = pin(jnp.roll(dx, -1, axis=0), self.state_names)

    def weights_slot(self, c, t):
        """Every stage: the weight gradients of the micro-batch the timetable names."""
        prog = self.prog
        P = prog.P
        m_w, ok_w = self.tt.weight_item(t, P, prog.M)
        m_P, ok_P = jnp.full((P,), m_w), jnp.broadcast_to(ok_w, (P,))
        saved = [
            prog.stage_back(r[:, m_w % prog.KW], d) for r, d in zip(c["w_ring"], self.stage_dims)
        ]
        chunk0 = jnp.zeros((P,), jnp.int32)
        first = self.by_replica(self.stage_P == 0)
        dp, d_o = self.split.w(
            saved, self.chunk(chunk0), self.outer, self.pick(m_P), first, self.weights
        )
        c["d_stack"] = self.add_at(c["d_stack"], ok_P, chunk0, dp)
        c["d_outer"] = _add(c["d_outer"], ok_P, d_o)

    def advance(self, c, t, f):
        """Keep this tick's stage inputs for their backward, roll the outputs one stage on."""
        prog = self.prog
        if self.backward:
            _, _, i_f, ok_f = self.tt.forward_item(t, self.stage_P, prog.P, prog.M, prog.R)
            c["ring"] = self.per_stage(_write)(c["ring"], c["fwd"], i_f % prog.K, ok_f)
        # stage s's output -> s+1 (P-1 -> 0)
        c["fwd"] = pin(jnp.roll(f[0], 1, axis=0), self.state_names)
