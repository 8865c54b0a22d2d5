"""Evaluating a jaxpr equation by equation with its call-like equations (jit, remat, custom
JVP/VJP calls) inlined, and a scan run from a body function: what split_backward.py needs to run
the two halves of a backward it partitioned."""

from __future__ import annotations

import jax
from jax._src import core

# call-like primitives whose body is inlined before the split (their parameters name the body)
INLINE = (
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
)


def inlined_body(eqn) -> tuple[core.Jaxpr, list]:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if isinstance(j, core.ClosedJaxpr):
            return j.jaxpr, list(j.consts)
        if isinstance(j, core.Jaxpr):
            return j, []
    raise NotImplementedError(f"no body in {eqn.primitive.name}")


def bind(eqn, invals):
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


class Env(dict):
    def read(self, v):
        return v.val if isinstance(v, core.Literal) else self[v]

    def write(self, vs, vals):
        for v, x in zip(vs, vals):
            if not isinstance(v, core.DropVar):
                self[v] = x


def eval_scan(eqn, invals, body_fn):
    """Re-bind a scan equation through lax.scan with `body_fn(consts, carry, xs) -> (carry, ys)`."""
    p = eqn.params
    nc, ncar = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
    carry, ys = jax.lax.scan(
        lambda c, x: body_fn(consts, c, x),
        list(init),
        list(xs),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return list(carry) + list(ys)


def eval_inlined(jaxpr: core.Jaxpr, consts, args):
    """eval_jaxpr with call-like equations inlined, in scans too (traced again, this leaves a jaxpr
    whose only structure is scans and atomic equations)."""
    env = Env()
    env.write(jaxpr.constvars, consts)
    env.write(jaxpr.invars, args)
    for eqn in jaxpr.eqns:
        invals = [env.read(v) for v in eqn.invars]
        if eqn.primitive.name in INLINE:
            outs = eval_inlined(*inlined_body(eqn), invals)
        elif eqn.primitive.name == "scan":
            body, ncar = eqn.params["jaxpr"], eqn.params["num_carry"]

            def step(c, carry, x, body=body, ncar=ncar):
                out = eval_inlined(body.jaxpr, body.consts, [*c, *carry, *x])
                return out[:ncar], out[ncar:]

            outs = eval_scan(eqn, invals, step)
        else:
            outs = bind(eqn, invals)
        env.write(eqn.outvars, outs)
    return [env.read(v) for v in jaxpr.outvars]


# ------------------------------------------------------------------------------ the partition
