"""A checkpoint saved under other --comm settings (compression, error feedback, DiLoCo) or onto
another data-parallel replica count, read into this run's state: the abstract state it was saved
as, and the conversion to this run's layout (or one line naming why there is none)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from checkpoint.layout import replica_layout
from checkpoint.manager import Checkpointer
from errors import UserError
from train.core import comm
from train.core import state as train_state
from train.core.config import CommConfig
from train.core.setup import RunSetup
from train.core.state import TrainState


def saved_abstract(run: RunSetup, abstract: TrainState, src: Checkpointer, step: int) -> TrainState:
    """The abstract state (on this mesh) that `step` was saved as: `abstract` itself when it was
    saved in this run's layout. Its --comm settings may give another layout than this run's
    (error-feedback residuals or none, clipping in the optimizer chain or before the sync), and
    its residuals may hold another data-parallel replica count (a resume onto another mesh).
    Those `convert` bridges; a switch to or from DiLoCo, or DiLoCo's per-replica state onto
    another replica count, is refused in one line naming why."""
    saved = src.meta(step).get("config", {}).get("comm")
    names = {f.name for f in dataclasses.fields(CommConfig)}
    sync, local_clip = (
        comm.sync_layout(
            CommConfig(**{k: v for k, v in saved.items() if k in names}),
            run.dp_axes,
            run.cfg.train.grad_clip,
        )
        if isinstance(saved, dict)
        else (run.sync, run.local_clip)
    )
    (n_saved, diloco), n_now = replica_layout(src.arrays(step)), run.sync.replicas(run.mesh)
    resized = n_saved is not None and n_saved != n_now
    layout = lambda sync, clip: (sync.error_feedback, sync.outer_tx is not None, clip > 0)  # noqa: E731
    if layout(sync, local_clip) == layout(run.sync, run.local_clip) and not resized:
        return abstract
    if diloco != (run.sync.outer_tx is not None) or (resized and diloco):
        now = run.cfg.to_dict()["comm"]
        opts = ("compression", "error_feedback", "sync_every")
        text = lambda m: " ".join(f"--comm.{k} {m.get(k)}" for k in opts)  # noqa: E731
        why = (
            f"DiLoCo's per-replica state (optimizer states and drift of {n_saved} data-parallel"
            f" replicas) does not convert to this mesh's {n_now}"
            if diloco and resized
            else "DiLoCo's train state (per-replica optimizer states and drift) does not convert"
            f" to or from this run's ({text(now)})"
        )
        raise UserError(
            f"checkpoint {src.step_dir(step)} was written with {text(saved or {})}: {why};"
            f" resume with its settings and data-parallel size, or start a new --run-dir"
        )
    tx = run.tx_with(clip=not local_clip)
    out = train_state.abstract(run.model_cfg, tx, run.mesh, run.rules, sync, lora_cfg=run.cfg.lora)
    # replicated here; `convert` averages
    if n_saved is not None and (resized or out.residual is None):
        out = out.replace(
            residual=jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct(
                    (n_saved, *a.shape),
                    jnp.float32,
                    sharding=NamedSharding(run.mesh, jax.P(None, *sh.spec)),
                ),
                abstract.params,
                run.state_shardings.params,
            )
        )
    return out


def convert(run: RunSetup, want: TrainState, state: TrainState) -> tuple[TrainState, str]:
    """A state restored in another --comm layout -> this run's (`want`, its abstract state), and
    what changed ("" if nothing). The optimizer chain differs only in where clipping sits, which
    holds no arrays, so its leaves carry over in order; residuals start at zero (nothing pending)
    or are dropped (up to a step's worth of unsent gradient, which a change of compression forgoes
    anyway). Residuals of another replica count are averaged and given to every replica: the sync
    adds the mean of the replicas' residuals, so what is pending stays the same."""
    opt_leaves = jax.tree.leaves(state.opt_state)
    if [x.shape for x in opt_leaves] != [x.shape for x in jax.tree.leaves(want.opt_state)]:
        raise UserError(
            "the checkpoint's optimizer state does not match this run's (another optimizer setting)"
        )
    out = state.replace(
        opt_state=jax.tree.unflatten(jax.tree.structure(want.opt_state), opt_leaves)
    )
    if state.residual is None and want.residual is None:
        return out, ""
    if want.residual is None:
        return out.replace(residual=None), "error-feedback residuals dropped"
    if state.residual is None:
        zeros = jax.jit(
            lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), want.residual),
            out_shardings=run.state_shardings.residual,
        )()
        return out.replace(residual=zeros), "error-feedback residuals start at zero"
    n_old, n_new = (
        jax.tree.leaves(state.residual)[0].shape[0],
        jax.tree.leaves(want.residual)[0].shape[0],
    )
    mean = jax.jit(
        lambda r: jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), (n_new, *x.shape[1:])), r),
        out_shardings=run.state_shardings.residual,
    )
    return (
        out.replace(residual=mean(state.residual)),
        f"error-feedback residuals of {n_old} data-parallel replicas averaged onto this mesh's"
        f" {n_new}",
    )
