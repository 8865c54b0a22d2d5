"""Parameters that are not finite (NaN or infinity) are refused where they enter Brigade from
elsewhere: an HF import (`from_pretrained`, `python -m checkpoint hf import`) and `--init-from`.
Such weights train to `loss nan` from the first step and evaluate to `loss nan`; one line naming
the tensor, before anything is written or trained, says why.

The check is one pass over each tensor: on the host while an HF tensor is converted anyway, on the
devices (one reduction per parameter, one small transfer) for a checkpoint read into its shardings.
"""

from __future__ import annotations

import numpy as np

from errors import UserError

ALLOW_FLAG = "--allow-nonfinite"


def nonfinite_text(x: np.ndarray) -> str:
    """'' for a finite array; else how many values are NaN or infinite and where the first is."""
    finite = np.isfinite(x)
    if finite.all():
        return ""
    bad = finite.size - int(np.count_nonzero(finite))
    first = tuple(int(i) for i in np.unravel_index(int(np.argmin(finite)), x.shape))
    return f"{bad} of {finite.size} values are NaN or infinite (the first at index {first})"


def check_host(source: str, name: str, x: np.ndarray, allow: bool = False) -> None:
    """UserError naming `name` of `source` when the host array `x` holds NaN or infinity (unless
    `allow`: an import kept for inspection or repair, `--allow-nonfinite`)."""
    if allow:
        return
    what = nonfinite_text(x)
    if what:
        raise UserError(
            f"'{source}': tensor {name}: {what}; the weights are damaged (re-download or"
            f" re-export them), or pass {ALLOW_FLAG} to import them anyway (training from them"
            f" gives loss nan)"
        )


def check_params(params, source: str) -> None:
    """UserError naming the first parameter (in tree order) of the device tree `params` that holds
    NaN or infinity: one reduction per parameter where it lives, one boolean each to the host."""
    import jax
    import jax.numpy as jnp

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        return
    finite = jax.device_get(
        jax.jit(lambda xs: [jnp.all(jnp.isfinite(x)) for x in xs])([x for _, x in leaves])
    )
    for (path, _), ok in zip(leaves, finite):
        if not ok:
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            raise UserError(
                f"{source}: parameter {name} holds NaN or infinity; training from it gives loss"
                f" nan from the first step (repair the checkpoint, or start from another)"
            )
