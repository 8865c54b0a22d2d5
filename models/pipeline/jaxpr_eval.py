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


def jaxpr_and_consts(j) -> tuple[core.Jaxpr, list] | None:
    """(jaxpr, consts) of a closed or open jaxpr, None if `j` is neither. jax 0.12 folded
    ClosedJaxpr into Jaxpr, which then carries its own consts."""
    closed = getattr(core, "ClosedJaxpr", None)
    if closed is not None and isinstance(j, closed):
        return j.jaxpr, list(j.consts)
    if isinstance(j, core.Jaxpr):
        return j, list(getattr(j, "consts", None) or [])
    return None


def scan_counts(params) -> tuple[int, int]:
    """A scan equation's (constants, carries) among its inputs (constants, carries, xs): jax 0.12
    names them by flat trees (`ft_in`), earlier jax by counts."""
    if "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry = params["ft_in"].unpack()[:2]
    return len(consts.vals), len(carry.vals)


def inlined_body(eqn) -> tuple[core.Jaxpr, list]:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = jaxpr_and_consts(eqn.params.get(key))
        if body is not None:
            return body
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
    nc, ncar = scan_counts(p)
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
            body, ncar = jaxpr_and_consts(eqn.params["jaxpr"]), scan_counts(eqn.params)[1]

            def step(c, carry, x, body=body, ncar=ncar):
                out = eval_inlined(*body, [*c, *carry, *x])
                return out[:ncar], out[ncar:]

            outs = eval_scan(eqn, invals, step)
        else:
            outs = bind(eqn, invals)
        env.write(eqn.outvars, outs)
    return [env.read(v) for v in jaxpr.outvars]


# ------------------------------------------------------------------------------ the partition
