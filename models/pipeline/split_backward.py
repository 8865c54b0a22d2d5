"""Split a backward pass in two: the part its caller needs now (B: the input gradient, on the
pipeline's critical path) and the part that can wait (W: the weight gradients), without computing
anything twice. Zero-bubble pipeline schedules run B as soon as the next stage's gradient arrives
and W later, in ticks that would otherwise be idle (explicit.py, `zb_h1`).

`jax.vjp` computes both at once. Here the backward is traced to a jaxpr and its equations are
partitioned by what each output needs: B holds every equation an input gradient needs (the
recomputed forward, the chain of input gradients through every layer), W the rest (mostly the
weight-gradient matmuls x^T g and their sums). What W reads from B (each projection's input x and
output gradient g) B returns as `saved`; that is the memory a zero-bubble schedule pays.

The partition follows the data through the structure JAX gives a layer stack:
  - call-like equations (jit, remat, custom_jvp/vjp calls) are inlined first;
  - a `scan` (the stack's layers, blockwise attention) is split into a B scan and a W scan: the
    carry the B outputs need (the input gradient, closed under what it reads) stays in B, the weight
    gradients' accumulators go to W, and every per-iteration value W reads from B leaves the B scan
    as a stacked output and enters the W scan as an input;
  - any other equation (a `while`, a `shard_map` such as the MoE experts') is atomic: in B if B
    needs one of its outputs, else in W.
The result is exact: the same equations on the same values, only in two groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax._src import core

from models.pipeline.jaxpr_eval import Env, bind, eval_inlined, jaxpr_and_consts, scan_counts


class _Stash:
    """A value the B part of a split scan returns stacked for its W part (an env key, not a Var)."""


class _Plan:
    """The partition of one jaxpr: `b` and `w` items in program order, each ("eqn", eqn) or
    ("scan", _ScanSplit); `reads_b`/`reads_w`: what each part reads that it does not define."""

    def __init__(self, jaxpr: core.Jaxpr, b_out: list[bool], w_out: list[bool]):
        self.jaxpr = jaxpr
        need_b = {v for v, k in zip(jaxpr.outvars, b_out) if k and isinstance(v, core.Var)}
        need_w = {v for v, k in zip(jaxpr.outvars, w_out) if k and isinstance(v, core.Var)}
        b, w = [], []
        for eqn in reversed(jaxpr.eqns):
            ob = [o in need_b for o in eqn.outvars]
            ow = [o in need_w for o in eqn.outvars]
            if eqn.primitive.name == "scan" and any(ow) and any(ob):
                split = _ScanSplit(eqn, ob, ow)
                b.append(("scan-b", split))
                w.append(("scan-w", split))
                need_b |= set(split.outer_reads_b)
                need_w |= set(split.outer_reads_w)
            elif any(ob):
                b.append(("eqn", eqn))
                need_b |= {v for v in eqn.invars if isinstance(v, core.Var)}
            elif any(ow):
                w.append(("eqn", eqn))
                need_w |= {v for v in eqn.invars if isinstance(v, core.Var)}
        self.b, self.w = b[::-1], w[::-1]
        defined_w = {o for kind, x in self.w for o in _outs(kind, x)}
        self.reads_w = [
            v for v in _ordered(_reads(kind, x) for kind, x in self.w) if v not in defined_w
        ]
        self.reads_w += [
            v
            for v, k in zip(jaxpr.outvars, w_out)
            if k and isinstance(v, core.Var) and v not in defined_w and v not in self.reads_w
        ]
        self.reads_b = [v for v in _ordered(_reads(kind, x) for kind, x in self.b)]
        self.reads_b += [
            v
            for v, k in zip(jaxpr.outvars, b_out)
            if k and isinstance(v, core.Var) and v not in self.reads_b
        ]

    def run_b(self, env: Env):
        self._run(self.b, env)

    def run_w(self, env: Env):
        self._run(self.w, env)

    @staticmethod
    def _run(items, env: Env):
        for kind, x in items:
            if kind == "eqn":
                env.write(x.outvars, bind(x, [env.read(v) for v in x.invars]))
            else:
                (x.run_b if kind == "scan-b" else x.run_w)(env)


def _ordered(groups):
    seen, out = set(), []
    for g in groups:
        for v in g:
            if (
                isinstance(v, (core.Var, _Stash))
                and not isinstance(v, core.DropVar)
                and v not in seen
            ):
                seen.add(v)
                out.append(v)
    return out


def _reads(kind, x):
    if kind == "eqn":
        return x.invars
    return x.outer_reads_b if kind == "scan-b" else x.outer_reads_w


def _outs(kind, x):
    if kind == "eqn":
        return x.outvars
    return x.outer_defs_b if kind == "scan-b" else x.outer_defs_w


def _split_carries(bj, carry_in, ncar: int, ys_b: list[bool], ob: list[bool], ow: list[bool]):
    """-> (the body's plan, B's carries, W's carries): the carries each part reads must be computed
    by that part, so both sets grow to a fixed point."""
    ny = len(ys_b)
    carry_b = {i for i in range(ncar) if ob[i]}
    carry_w = {i for i in range(ncar) if ow[i] and i not in carry_b}
    while True:
        plan = _Plan(
            bj,
            [i in carry_b for i in range(ncar)] + ys_b,
            [i in carry_w for i in range(ncar)] + [ow[ncar + j] and not ys_b[j] for j in range(ny)],
        )
        more_b = {i for i, v in enumerate(carry_in) if v in set(plan.reads_b)} - carry_b
        more_w = {i for i, v in enumerate(carry_in) if v in set(plan.reads_w)} - carry_b - carry_w
        if not more_b and not more_w:
            return plan, sorted(carry_b), sorted(carry_w)
        carry_b |= more_b
        carry_w = (carry_w | more_w) - carry_b


class _ScanSplit:
    """One scan split into a B scan and a W scan (see the module's docstring)."""

    def __init__(self, eqn, ob: list[bool], ow: list[bool]):
        p = eqn.params
        self.eqn = eqn
        bj, body_consts = jaxpr_and_consts(p["jaxpr"])
        nc, ncar = scan_counts(p)
        self.nc, self.ncar, self.body_consts = nc, ncar, body_consts
        consts_in, carry_in, xs_in = (
            bj.invars[:nc],
            bj.invars[nc : nc + ncar],
            bj.invars[nc + ncar :],
        )
        ny = len(bj.outvars) - ncar
        ys_b = [ob[ncar + j] for j in range(ny)]
        plan, carry_b, carry_w = _split_carries(bj, carry_in, ncar, ys_b, ob, ow)
        self.plan, self.carry_b, self.carry_w = plan, carry_b, carry_w
        self.ys_b = [j for j in range(ny) if ys_b[j]]
        self.ys_w = [j for j in range(ny) if ow[ncar + j] and not ys_b[j]]
        own_w = (
            {carry_in[i] for i in self.carry_w} | set(consts_in) | set(xs_in) | set(bj.constvars)
        )
        # what W reads per iteration from B: B-defined values and the B carry's value at that
        # iteration
        self.stash = [v for v in plan.reads_w if v not in own_w]
        self.stash_keys = [_Stash() for _ in self.stash]
        rb, rw = set(plan.reads_b), set(plan.reads_w)
        self.consts_b = [k for k, v in enumerate(consts_in) if v in rb]
        self.consts_w = [k for k, v in enumerate(consts_in) if v in rw]
        self.xs_b = [k for k, v in enumerate(xs_in) if v in rb]
        self.xs_w = [k for k, v in enumerate(xs_in) if v in rw]
        self._outer_vars(eqn)

    def _outer_vars(self, eqn) -> None:
        """The scan equation's own inputs each part reads and outputs each part defines."""
        outer, nc, ncar = eqn.invars, self.nc, self.ncar

        def lit(vs):
            return [v for v in vs if isinstance(v, core.Var)]

        self.outer_reads_b = lit(
            [outer[k] for k in self.consts_b]
            + [outer[nc + i] for i in self.carry_b]
            + [outer[nc + ncar + k] for k in self.xs_b]
        )
        self.outer_reads_w = (
            lit(
                [outer[k] for k in self.consts_w]
                + [outer[nc + i] for i in self.carry_w]
                + [outer[nc + ncar + k] for k in self.xs_w]
            )
            + self.stash_keys
        )
        outs = eqn.outvars
        self.outer_defs_b = (
            [outs[i] for i in self.carry_b] + [outs[ncar + j] for j in self.ys_b] + self.stash_keys
        )
        self.outer_defs_w = [outs[i] for i in self.carry_w] + [outs[ncar + j] for j in self.ys_w]

    def _body_env(self, consts, const_idx, carry, carry_idx, xs, xs_idx):
        bj, nc, ncar = self.plan.jaxpr, self.nc, self.ncar
        env = Env()
        env.write(bj.constvars, self.body_consts)
        env.write([bj.invars[k] for k in const_idx], consts)
        env.write([bj.invars[nc + i] for i in carry_idx], carry)
        env.write([bj.invars[nc + ncar + k] for k in xs_idx], xs)
        return env

    def _loop(self, env, body, consts, init, xs):
        p = self.eqn.params
        return jax.lax.scan(
            lambda c, x: body(consts, c, x),
            init,
            xs,
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )

    def run_b(self, outer: Env):
        bj, ncar, nc, ins = self.plan.jaxpr, self.ncar, self.nc, self.eqn.invars

        def body(consts, carry, xs):
            env = self._body_env(consts, self.consts_b, carry, self.carry_b, xs, self.xs_b)
            self.plan.run_b(env)
            return (
                [env.read(bj.outvars[i]) for i in self.carry_b],
                [env.read(bj.outvars[ncar + j]) for j in self.ys_b]
                + [env.read(v) for v in self.stash],
            )

        carry, ys = self._loop(
            outer,
            body,
            [outer.read(ins[k]) for k in self.consts_b],
            [outer.read(ins[nc + i]) for i in self.carry_b],
            [outer.read(ins[nc + ncar + k]) for k in self.xs_b],
        )
        outer.write(self.outer_defs_b, list(carry) + list(ys))

    def run_w(self, outer: Env):
        bj, ncar, nc, ins = self.plan.jaxpr, self.ncar, self.nc, self.eqn.invars

        def body(consts, carry, xs):
            env = self._body_env(
                consts, self.consts_w, carry, self.carry_w, xs[: len(self.xs_w)], self.xs_w
            )
            env.write(self.stash, xs[len(self.xs_w) :])
            self.plan.run_w(env)
            return [env.read(bj.outvars[i]) for i in self.carry_w], [
                env.read(bj.outvars[ncar + j]) for j in self.ys_w
            ]

        carry, ys = self._loop(
            outer,
            body,
            [outer.read(ins[k]) for k in self.consts_w],
            [outer.read(ins[nc + i]) for i in self.carry_w],
            [outer.read(ins[nc + ncar + k]) for k in self.xs_w]
            + [outer[k] for k in self.stash_keys],
        )
        outer.write(self.outer_defs_w, list(carry) + list(ys))


# ------------------------------------------------------------------------------ the interface


class Split:
    """fn(*args) -> (now, later), two pytrees, split so that

        now, saved = split.b(*args)        # every equation `now` needs
        later = split.w(saved, *kept)      # the rest; kept = [args[i] for i in keep_argnums]

    give fn's outputs. `saved` (a flat list) holds what W reads from B and from the arguments not
    kept; `keep_argnums` names the arguments the caller passes to W again (the same values: the
    weights, say), so that they are not saved. Built from abstract `args` (arrays or
    ShapeDtypeStructs) under the context fn runs in (mesh, axis rules); b and w then run on
    values of those shapes, also under vmap."""

    def __init__(self, fn: Callable, args: tuple, keep_argnums: tuple[int, ...] = ()):
        flat, self.in_tree = jax.tree.flatten(args)
        closed, out_shape = jax.make_jaxpr(
            lambda *a: fn(*jax.tree.unflatten(self.in_tree, a)), return_shape=True
        )(*flat)
        now, later = out_shape
        self.now_tree, self.later_tree = jax.tree.structure(now), jax.tree.structure(later)
        n_now = self.now_tree.num_leaves
        # inline call-like equations (traced again: a jaxpr of scans and atomic equations)
        inlined = jax.make_jaxpr(lambda *a: eval_inlined(closed.jaxpr, closed.consts, a))(*flat)
        self.jaxpr, self.consts = inlined.jaxpr, inlined.consts
        n_out = len(self.jaxpr.outvars)
        self.plan = _Plan(
            self.jaxpr, [i < n_now for i in range(n_out)], [i >= n_now for i in range(n_out)]
        )
        self.n_now = n_now
        arg_slices, start = [], 0
        for a in args:
            n = len(jax.tree.leaves(a))
            arg_slices.append(range(start, start + n))
            start += n
        kept_leaves = {k for i in keep_argnums for k in arg_slices[i]}
        self.kept = [self.jaxpr.invars[k] for k in sorted(kept_leaves)]
        self.keep_argnums = tuple(keep_argnums)
        self.saved = [
            v
            for v in self.plan.reads_w
            if v not in set(self.kept) and v not in set(self.jaxpr.constvars)
        ]

    def b(self, *args) -> tuple[Any, list]:
        env = Env()
        env.write(self.jaxpr.constvars, self.consts)
        env.write(self.jaxpr.invars, jax.tree.leaves(args))
        self.plan.run_b(env)
        now = [env.read(v) for v in self.jaxpr.outvars[: self.n_now]]
        return jax.tree.unflatten(self.now_tree, now), [env[v] for v in self.saved]

    def w(self, saved: list, *kept) -> Any:
        env = Env()
        env.write(self.jaxpr.constvars, self.consts)
        env.write(self.kept, jax.tree.leaves(kept))
        env.write(self.saved, saved)
        self.plan.run_w(env)
        later = [env.read(v) for v in self.jaxpr.outvars[self.n_now :]]
        return jax.tree.unflatten(self.later_tree, later)
