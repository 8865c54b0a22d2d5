"""The one entry that runs a model's pieces (models/pieces.py) under any schedule: the training
objective of a batch, and the training forward of the layer stack. Which engine runs is the
schedule's timetable's: the forward scan (gpipe.py, differentiated by autodiff), the explicit
program (explicit.py, its backward written out), or, without a pipeline axis, a plain scan over
the layer groups.

What the pieces must provide: `embed(outer, tokens_BT, positions_BT, segment_ids_BT=None) ->
x_BTD`, `group(x_BTD, group_params, positions_BT, segment_ids_BT=None) -> (x_BTD, stats)`,
`head(outer, x_BTD, batch, chunk=0) -> loss sum`, `count_stats` (the stat names that are sums over
tokens), `remat_policy`, `scan_layers` and `cfg` (the model config). The params are (outer,
stack), every stack leaf [G, ...] over the G layer groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import quant
from models.config import PipelineConfig
from models.pieces import over_groups
from models.pipeline import explicit
from models.pipeline.gpipe import pipeline_apply
from models.pipeline.layout import replicas, stages
from models.pipeline.timetables import EXPLICIT_PROGRAM, timetable

PLAIN = "plain"  # no pipeline axis: a scan over the layer groups


def engine_for(cfg, pipeline: PipelineConfig | None) -> str:
    """What runs the training objective on the mesh in context: PLAIN without a pipeline axis > 1,
    else the engine of `pipeline`'s schedule (timetables.FORWARD_SCAN or EXPLICIT_PROGRAM; the
    latter after its one-line checks of the model and this process's devices)."""
    if stages() < 2:
        return PLAIN
    tt = timetable((pipeline or PipelineConfig()).schedule)
    if tt.engine == EXPLICIT_PROGRAM:
        explicit.check_model(cfg, tt.name)
        explicit.check_backend(cfg, tt.name)
    return tt.engine


def sum_counts(stats: dict, names: tuple[str, ...], pieces: int) -> dict:
    """Stats that are sums over tokens (`names`) from the pipeline's means over `pieces` of the
    batch (micro-batches x replicas)."""
    return {k: v * pieces if k in names else v for k, v in stats.items()}


def with_stat_terms(loss_sum, stats: dict, stat_weights: dict):
    """The objective: the loss sum plus, for each stat named in `stat_weights`, weight x its mean
    over the layers that report it (the MoE balance losses)."""
    terms = [w * jnp.mean(stats[k]) for k, w in stat_weights.items() if k in stats]
    return sum(terms, loss_sum)


def stack_forward(pieces, stack, x_BTD, positions_BT, segment_ids_BT=None, *, pipeline=None):
    """The layer groups on x_BTD -> (x_BTD, stats stacked [G, ...]): through pipeline_apply on a
    mesh with pipeline > 1 (`pipeline`'s schedule, default PipelineConfig(); the explicit
    schedules run the same forward ticks, as a forward without gradient), else a scan (or
    unrolled loop) over the groups, each rematerialised by the model's policy."""
    seg = () if segment_ids_BT is None else (segment_ids_BT,)
    # a quantised base's layers recompute their weights in the backward (models/quant.py)
    policy, P = quant.remat_policy(pieces.remat_policy, stack), stages()
    if P > 1:
        pc = pipeline or PipelineConfig()
        M = pc.microbatches_for(P)
        x_BTD, stats = pipeline_apply(
            pieces.group,
            stack,
            x_BTD,
            positions_BT,
            *seg,
            stages=P,
            microbatches=M,
            repeats=pc.repeats,
            schedule=pc.schedule,
            remat_policy=policy,
            remat_stage=pc.remat_stage,
            has_aux=True,
            scan_layers=pieces.scan_layers,
            replica_axes=pc.replica_axes,
        )
        return x_BTD, sum_counts(stats, pieces.count_stats, M * replicas(pc.replica_axes))

    def step(x_BTD, params_G):
        return pieces.group(x_BTD, params_G, positions_BT, *seg)

    if policy is not None:
        step = jax.checkpoint(step, policy=policy, prevent_cse=not pieces.scan_layers)
    return over_groups(step, x_BTD, stack, pieces.scan_layers)


def objective(pieces, params, batch: dict, *, pipeline=None, stat_weights=None, loss_chunk=0):
    """The training objective of one batch -> (objective, loss sum, stats as `stack_forward`
    returns them), for any schedule: differentiate the objective with jax.value_and_grad whatever
    the engine (the explicit one is a custom_vjp). `params`: (outer, stack). `batch`: "inputs",
    "targets", "positions" [B,T] (and "segment_ids", "weights" where given). The objective is the
    loss sum plus `stat_weights`' terms (with_stat_terms). `loss_chunk`: tokens per chunk of the
    head where it runs on the whole batch (plain and forward-scan engines); the explicit engine
    runs it per micro-batch, whole."""
    outer, stack = params
    stat_weights = stat_weights or {}
    if engine_for(pieces.cfg, pipeline) == EXPLICIT_PROGRAM:
        return _explicit_objective(pieces, outer, stack, batch, pipeline, stat_weights)
    x_BTD = pieces.embed(outer, batch["inputs"], batch["positions"], batch.get("segment_ids"))
    x_BTD, stats = stack_forward(
        pieces, stack, x_BTD, batch["positions"], batch.get("segment_ids"), pipeline=pipeline
    )
    loss_sum = pieces.head(outer, x_BTD, batch, chunk=loss_chunk)
    return with_stat_terms(loss_sum, stats, stat_weights), loss_sum, stats


def _explicit_objective(pieces, outer, stack, batch, pipeline, stat_weights):
    """`objective` through explicit.loss: the embedding on stage 0, the head per micro-batch on the
    last stage, the stat terms per group (weights / G summed over the G groups: the mean)."""
    P = stages()
    M = pipeline.microbatches_for(P)
    n_groups = jax.tree.leaves(stack)[0].shape[0]
    objective, (loss_sum, stats) = explicit.loss(
        lambda outer, mb: pieces.embed(outer, mb["inputs"], mb["positions"], mb.get("segment_ids")),
        lambda x, p, mb: pieces.group(x, p, mb["positions"], mb.get("segment_ids")),
        lambda outer, y, mb: pieces.head(outer, y, mb),
        outer,
        stack,
        batch,
        {k: w / n_groups for k, w in stat_weights.items()},
        stages=P,
        microbatches=M,
        schedule=pipeline.schedule,
        repeats=pipeline.repeats,
        remat_policy=quant.remat_policy(pieces.remat_policy, stack),
        has_aux=True,
        scan_layers=pieces.scan_layers,
        replica_axes=pipeline.replica_axes,
    )
    n_pieces = M * replicas(pipeline.replica_axes)
    return objective, loss_sum, sum_counts(stats, pieces.count_stats, n_pieces)
