"""What one stage of the explicit program runs on one piece of a micro-batch: the forward (stage 0
embedding first), its backward by `jax.vjp` with the forward recomputed, the same backward split in
two (split_backward.py) for the schedules that defer the weight gradients, and the head; each
vmapped over the stage and replica dims. ticks.py runs them tick by tick.

Letters as in models/pipeline/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.pipeline.layout import replica_axis, stage_axis
from models.pipeline.split_backward import Split
from models.pipeline.timetables import Timetable


class Program:
    """The per-piece functions for one shape (P, M, R, A, J) and timetable. embed_fn(outer, mb) ->
    x_bTD, layer_fn(x_bTD, layer_params, mb) -> x_bTD (with `has_aux`: (x_bTD, aux)),
    head_fn(outer, y_bTD, mb) -> loss sum, as explicit.loss takes them."""

    def __init__(self, fns, tt: Timetable, P, M, R, A, L, remat_policy, has_aux, scan_layers):
        embed_fn, layer_fn, head_fn = fns
        self.embed_fn, self.head_fn, self.tt = embed_fn, head_fn, tt
        self.P, self.M, self.R, self.A, self.L = P, M, R, A, L
        self.J, self.K = L // (P * R), tt.ring_slots(P, M, R)
        self.KW = tt.w_slots(P, M) if tt.splits_backward else 0
        self.stage_axis, self.replica_axis = stage_axis(), replica_axis(A)

        def layer_at(x_bTD, p_J, k, mb):
            # the layer's weights are picked inside the remat region (as in pipeline_apply)
            out = layer_fn(x_bTD, jax.tree.map(lambda a: a[k], p_J), mb)
            return out if has_aux else (out, ())

        layer = layer_at if remat_policy is None else jax.checkpoint(layer_at, policy=remat_policy)

        def stage(x_bTD, p_J, mb):
            return jax.lax.scan(
                lambda x, k: layer(x, p_J, k, mb),
                x_bTD,
                jnp.arange(self.J),
                unroll=1 if scan_layers else self.J,
            )

        self.stage = stage

    def vmapped(self, fn, in_axes):
        """fn over one piece -> over [P, A, ...]: replicas inside, stages outside, as
        pipeline_apply."""
        inner = jax.vmap(fn, in_axes=in_axes, spmd_axis_name=self.replica_axis)
        return jax.vmap(inner, in_axes=in_axes, spmd_axis_name=self.stage_axis)

    def aux_objective(self, aux_J, weights):
        """The stage's aux term of the objective for one piece (see explicit.loss)."""
        terms = [
            jnp.sum(aux_J[k]) * w / (self.M * self.A)
            for k, w in weights.items()
            if isinstance(aux_J, dict) and k in aux_J
        ]
        return sum(terms, jnp.zeros((), jnp.float32))

    def forward(self, x_in, p_J, outer, mb, first, weights):
        """One piece -> (y, aux_J, aux objective); `first`: stage 0 on its first chunk, which
        embeds the tokens instead of reading what was rolled in."""
        x = jnp.where(first, self.embed_fn(outer, mb).astype(x_in.dtype), x_in)
        y, aux_J = self.stage(x, p_J, mb)
        return y, aux_J, self.aux_objective(aux_J, weights)

    def backward(self, x_in, p_J, outer, mb, first, weights, ct_y):
        """-> (d x_in, d p_J, d outer): the stage's vjp, its forward recomputed from x_in."""

        def f(x_in, p_J, outer):
            y, _, aux_obj = self.forward(x_in, p_J, outer, mb, first, weights)
            return y, aux_obj

        _, vjp = jax.vjp(f, x_in, p_J, outer)
        return vjp((ct_y, jnp.ones((), jnp.float32)))

    def head(self, outer, y, mb, backward):
        """-> (loss, d outer, d y), or (loss, None, None) without a backward."""
        if not backward:
            return self.head_fn(outer, y, mb), None, None
        value, vjp = jax.vjp(lambda o, y: self.head_fn(o, y, mb), outer, y)
        return (value, *vjp(jnp.ones_like(value)))

    def split_backward(self, run_bwd, args: tuple) -> tuple[Split, list[int | None]]:
        """The vmapped `backward` split (split_backward.py) -> (split, stage dims):
        split.b(x_in, p_J, outer, mb, first, weights, ct_y) -> (d x_in, saved) and
        split.w(saved, p_J, outer, mb, first, weights) -> (d p_J, d outer), all [P, A, ...] but
        outer and weights; stage dims: where each saved value has its stage dim. The split is of
        the batched program (a shard_map inside, such as the MoE experts', is batched by vmap
        before autodiff, as in `backward`), so the stage dim is found by a second, abstract trace
        with twice the stages: the one dim that doubles."""

        def fn(*a):
            dx, dp, do = run_bwd(*a)
            return dx, (dp, do)

        def twice(t):
            return jax.tree.map(
                lambda a: jax.ShapeDtypeStruct((2 * a.shape[0], *a.shape[1:]), a.dtype), t
            )

        split = Split(fn, args, keep_argnums=(1, 2, 3, 4, 5))
        probe_args = tuple(twice(a) if i not in (2, 5) else a for i, a in enumerate(args))
        probe = Split(fn, probe_args, keep_argnums=(1, 2, 3, 4, 5))
        one, two = jax.eval_shape(split.b, *args)[1], jax.eval_shape(probe.b, *probe_args)[1]
        dims = []
        # None: no stage dim (an iota, the zeros of a select's transpose)
        for a, b in zip(one, two, strict=True):
            grown = [d for d, (n, m) in enumerate(zip(a.shape, b.shape)) if m != n]
            doubled = len(grown) == 1 and b.shape[grown[0]] == 2 * a.shape[grown[0]]
            assert not grown or doubled, (a.shape, b.shape)
            dims.append(grown[0] if grown else None)
        return split, dims

    @staticmethod
    def stage_first(x, d, P):
        """A saved value with its stage dim first ([P, ...]; one without gets one, every stage a
        copy)."""
        return jnp.broadcast_to(x, (P, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)

    @staticmethod
    def stage_back(x_P, d):
        """The inverse of stage_first: a value without stage dim is stage 0's copy, written by
        stage 0 in the tick that reads it (its W runs in its B's tick)."""
        return x_P[0] if d is None else jnp.moveaxis(x_P, 0, d)
