"""Resume policy: the checkpoint a run continues from (--resume), read onto this run's mesh and
--comm layout; the fall-back past damaged steps; NaN recovery; --init-from.

Every function takes what it needs explicitly: the run's setup (train/core/setup.py), its abstract
state (traced once by the caller: the resume check, the restore, NaN recovery and --init-from all
need it), the checkpoint directory and the step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from checkpoint import finite, storage
from checkpoint.integrity import UnreadableCheckpoint
from checkpoint.layout import replica_layout, tokenizer_record
from checkpoint.manager import Checkpointer, open_checkpoint
from checkpoint.saving import step_list
from checkpoint.tiers import (
    all_processes,
    drop_after,
    local_tier,
    saved_elsewhere,
    steps_everywhere,
)
from errors import UserError
from mesh.spec import mesh_text
from train.core import comm, lora
from train.core import state as train_state
from train.core.config import CommConfig
from train.core.setup import RunSetup
from train.core.state import TrainState
from train.data.index import INDEX, read_index
from train.data.sources import REPREPARE, parse_mixture
from train.run.resilience import Diverged
from train.run.rundir import changed_settings


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The step a run continues from. `restored`: its (state, meta), when finding it meant reading
    it whole (--resume auto verifies the step it picks that way); None when only its metadata
    was read."""

    src: Checkpointer
    step: int
    restored: tuple[TrainState, dict] | None = None


def resume_point(run: RunSetup, abstract: TrainState, saver: Checkpointer) -> ResumePoint | None:
    """Where --resume says to continue from, checked to be usable by this run, or None for a fresh
    start. A step at or past --steps, which nothing will restore, is checked against this run's
    arrays (metadata only), so that a finished run still refuses a checkpoint it could not resume.
    With a local tier, `latest` looks there first, and each process's local steps after the
    point are deleted (they belong to the trajectory this run replaces)."""
    c = run.cfg.checkpoint
    local = local_tier(saver, c.local_dir, keep=c.local_keep, async_save=c.async_save)
    if c.resume == "none":
        if saver.all_steps():
            raise UserError(
                f"--resume none, but {saver.directory} already holds checkpoints (steps"
                f" {step_list(saver.all_steps())}) that new saves would collide with; use another"
                f" --run-dir or --checkpoint.dir, or delete them"
            )
        point = None
    elif c.resume in (
        "auto",
        "latest",
    ):  # latest: train/run/rundir.py made it a PATH, unless --run-dir was given
        point = (_newest_local(run, abstract, saver, local) if local else None) or _latest_intact(
            run, abstract, saver
        )
    else:
        src, step = open_checkpoint(c.resume)
        if src.directory == saver.directory:
            src = saver
        saved_abstract(
            run, abstract, src, step
        )  # a layout that cannot be converted fails before anything runs
        newer = [s for s in saver.all_steps() if s > step]
        if newer:
            raise UserError(
                f"--resume {c.resume}: step {step} is older than checkpoints already in"
                f" {saver.directory} (steps {step_list(newer)}), which this run would collide with;"
                f" use another --checkpoint.dir"
            )
        point = ResumePoint(src, step)
    if local:
        drop_after(local, point.step if point else None)
    if point and point.step >= run.cfg.train.steps:
        point.src.check_compatible(point.step, saved_abstract(run, abstract, point.src, point.step))
    return point


def _newest_local(
    run: RunSetup, abstract: TrainState, saver: Checkpointer, local: Checkpointer
) -> ResumePoint | None:
    """--resume auto with a local tier: the newest step that every process holds in its local
    tier and reads back whole, when it is newer than the persistent tier's newest step; else None
    (the persistent tier decides). The processes decide together: a step that one of them lacks,
    cannot read (set aside there as `<step>.unreadable`) or holds for another mesh layout is
    skipped by all, each process reading only its own copy (no collective while they disagree)."""
    newest_shared = saver.latest_step()
    for step in steps_everywhere(local):
        if newest_shared is not None and step <= newest_shared:
            break
        restored, why, damaged = None, "", False
        try:
            why = saved_elsewhere(local, step, run.mesh) or (
                ""
                if saved_abstract(run, abstract, local, step) is abstract
                else f"local step {step} was saved with other --comm settings"
            )
            restored = None if why else local.restore(step, abstract)
        except UserError as e:  # damaged, or saved with other settings: the persistent tier decides
            why, damaged = str(e), isinstance(e, UnreadableCheckpoint)
        if all_processes(not why):
            return ResumePoint(local, step, restored)
        if why:  # every process names the reason of its own copy
            moved = f"; set aside as {local.set_aside(step)}" if damaged else ""
            print(
                f"warning: process {jax.process_index()}: {why}{moved}; not resuming from local step {step}",
                flush=True,
            )
    return None


def _latest_intact(run: RunSetup, abstract: TrainState, saver: Checkpointer) -> ResumePoint | None:
    """--resume auto: the newest committed step that reads back completely. Unreadable newer
    steps are reported (one line each) and, once an intact one is found, renamed to
    `<step>.unreadable` so that this run can save those steps again; nothing is deleted. None
    when the directory holds no committed step; UserError when it holds only unreadable ones
    (starting from scratch would silently throw away the run's progress)."""
    is_main = jax.process_index() == 0

    def verify(step: int) -> tuple[TrainState, dict] | None:
        if step >= run.cfg.train.steps:  # nothing to train: the metadata suffices
            saver.check_files(step)
            saver.arrays(step)
            saver.meta(step)
            return None
        return restore(run, abstract, saver, step)  # the only way to find truncated array data

    found, bad = newest_readable(
        saver, verify, lambda line: print(line, flush=True) if is_main else None
    )
    if found is None:
        if bad:
            raise UserError(
                f"no intact checkpoint in {saver.directory}: "
                + "; ".join(f"step {s}: {e.file or 'see above'}: {e.reason}" for s, e in bad)
                + " (nothing was deleted; to start fresh, move them aside or use another --checkpoint.dir;"
                " to read one anyway, --resume PATH shows its error)"
            )
        return None
    step, restored = found
    for s, _ in bad:
        moved = saver.set_aside(s)
        if is_main:
            print(
                f"warning: unreadable step {s} set aside as {moved} (nothing deleted);"
                f" resuming from step {step}",
                flush=True,
            )
    return ResumePoint(saver, step, restored)


def newest_readable(
    saver: Checkpointer, read: Callable[[int], Any], warn: Callable[[str], None]
) -> tuple[tuple[int, Any] | None, list[tuple[int, UnreadableCheckpoint]]]:
    """-> ((the newest committed step that `read` reads back, what it returned) or None, the
    newer steps that were unreadable with their errors), warning once for each of those."""
    bad = []
    for step in sorted(saver.all_steps(), reverse=True):
        try:
            return (step, read(step)), bad
        except UnreadableCheckpoint as e:
            warn(f"warning: {e}; trying the previous checkpoint")
            bad.append((step, e))
    return None, bad


def saved_abstract(run: RunSetup, abstract: TrainState, src: Checkpointer, step: int) -> TrainState:
    """The abstract state (on this mesh) that `step` was saved as: `abstract` itself when it was
    saved in this run's layout. Its --comm settings may give another layout than this run's
    (error-feedback residuals or none, clipping in the optimizer chain or before the sync), and
    its residuals may hold another data-parallel replica count (a resume onto another mesh).
    Those `_convert` bridges; a switch to or from DiLoCo, or DiLoCo's per-replica state onto
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
            f"DiLoCo's per-replica state (optimizer states and drift of {n_saved} data-parallel replicas)"
            f" does not convert to this mesh's {n_now}"
            if diloco and resized
            else f"DiLoCo's train state (per-replica optimizer states and drift) does not convert to or from"
            f" this run's ({text(now)})"
        )
        raise UserError(
            f"checkpoint {src.step_dir(step)} was written with {text(saved or {})}: {why};"
            f" resume with its settings and data-parallel size, or start a new --run-dir"
        )
    tx = run.tx_with(clip=not local_clip)
    out = train_state.abstract(run.model_cfg, tx, run.mesh, run.rules, sync, lora_cfg=run.cfg.lora)
    if n_saved is not None and (
        resized or out.residual is None
    ):  # replicated here; `_convert` averages
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


def _convert(run: RunSetup, want: TrainState, state: TrainState) -> tuple[TrainState, str]:
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
        f"error-feedback residuals of {n_old} data-parallel replicas averaged onto this mesh's {n_new}",
    )


def restore(
    run: RunSetup, abstract: TrainState, src: Checkpointer, step: int
) -> tuple[TrainState, dict]:
    """`step` read straight into this run's mesh and shardings and converted to its --comm layout;
    the meta gets `converted`, a note for the log, when a conversion changed something. A step
    that is unreadable (missing, truncated or corrupt files) raises UnreadableCheckpoint, a
    UserError naming the step directory and the file."""
    saved = saved_abstract(run, abstract, src, step)
    comm_converted = saved is not abstract
    held = any(name.startswith("spike/") for name, _, _ in src.arrays(step))
    if held != (saved.spike is not None):  # --train.spike_factor turned on or off since this save
        saved = (
            train_state.with_loss_window(saved, 1.0, run.mesh)
            if held
            else saved.replace(spike=None)
        )
    state, meta = src.restore(step, saved)
    if comm_converted:
        state, meta["converted"] = _convert(run, abstract, state)
    if held != (abstract.spike is not None):
        state = train_state.with_loss_window(
            state.replace(spike=None), run.cfg.train.spike_factor, run.mesh
        )
        note = "the loss-spike window starts empty" if not held else "the loss-spike window dropped"
        meta["converted"] = "; ".join(filter(None, [meta.get("converted", ""), note]))
    return state, meta


def initial_state(
    run: RunSetup,
    abstract: TrainState,
    point: ResumePoint | None,
    create: Callable[[], TrainState],
    since: float,
) -> tuple[TrainState, dict, str]:
    """The state a run starts from -> (state, the checkpoint's meta or {}, a line to log or ""):
    the resume point's, --init-from's parameters with a fresh optimizer (only a fresh run: a
    restarted fine-tune resumes from its own saves), or `create()`, a fresh init. `since`: when
    the search for the resume point began (perf_counter; it reads the checkpoint it picks)."""
    if point:
        state, meta = point.restored or restore(run, abstract, point.src, point.step)
        return (
            state,
            meta,
            (
                f"resumed from {point.src.step_dir(point.step)} (step {point.step}, saved on mesh"
                f" {mesh_text(meta.get('mesh', {}))}) in {time.perf_counter() - since:.1f}s"
                + (
                    f"; converted to this run's --comm settings: {meta['converted']}"
                    if meta.get("converted")
                    else ""
                )
            ),
        )
    if run.cfg.checkpoint.init_from and not lora.enabled(
        run.cfg.lora
    ):  # LoRA's is the base (train/core/lora.py)
        state, note = init_from(run, abstract.params, run.cfg.checkpoint.init_from)
        return state, {}, note
    return create(), {}, ""


def init_from(run: RunSetup, abstract_params: Any, path: str) -> tuple[TrainState, str]:
    """--init-from PATH: step 0 with a fresh optimizer around the parameters of a checkpoint (full
    or parameters-only, e.g. `python -m checkpoint hf import`), read straight into this mesh's shardings."""
    src, step = open_checkpoint(path)
    hint = os.path.join(path, "model.yaml")
    try:
        params = src.restore_params(step, abstract_params)
    except UserError as e:
        if os.path.exists(hint) and "does not match" in str(e):
            raise UserError(f"{e} (the model config it was made with: --config {hint})") from None
        raise
    finite.check_params(params, f"--init-from {src.step_dir(step)}")  # NaN weights: loss nan
    state = train_state.from_params(run.model_cfg, run.tx, run.mesh, run.rules, params, run.sync)
    return state, f"initialised the parameters from {src.step_dir(step)} (fresh optimizer)"


def saved_tokenizer(meta: dict) -> dict | None:
    """The tokenizer record of a checkpoint (checkpoint.layout.tokenizer_record); for one that
    predates the record, that of the data its config names: the prepared dataset's index (the
    first source: a mixture shares one tokenizer) while it still exists, the byte-level record for
    the stdlib, synthetic and text sources; None when nothing tells (an older HF import)."""
    record = tokenizer_record(meta)
    data = meta.get("config", {}).get("data") if isinstance(meta.get("config"), dict) else None
    if record or not isinstance(data, dict) or not isinstance(data.get("source"), str):
        return record
    try:
        first = parse_mixture(data["source"])[0][0]
        if storage.isfile(storage.join(first, INDEX)):
            return read_index(first, f"the checkpoint's --data {first}", REPREPARE)["tokenizer"]
    except UserError:  # a mixture or index that no longer reads: nothing to compare against
        return None
    return (
        {"kind": "byte", "id": "byte"}
        if first in ("default", "synthetic") or os.path.exists(first)
        else None
    )


def check_tokenizer(
    meta: dict, data_tokenizer: dict, allow: bool, what: str, whose: str = "the checkpoint's"
) -> None:
    """UserError (one line naming both) when data prepared with `data_tokenizer` (a dataset's
    record) meets a checkpoint (`meta`) that records another tokenizer: its ids would be other
    tokens to the model. `allow`: --data.allow_tokenizer_mismatch. A checkpoint recording none passes.
    `whose`: what the line calls `meta`'s tokenizer (a run's eval sets compare with its training data's)."""
    saved = saved_tokenizer(meta)
    if allow or saved is None or saved["id"] == data_tokenizer.get("id"):
        return
    named = lambda r: r["id"] + (f" ({r['path']})" if r.get("path") else "")  # noqa: E731
    raise UserError(
        f"{what}: {whose} tokenizer is {named(saved)} but the data's is {named(data_tokenizer)},"
        f" so its token ids would be other tokens to the model; prepare the data with"
        f" `python -m train.data prepare --tokenizer {saved.get('path') or saved['kind']}`, or pass"
        f" --data.allow_tokenizer_mismatch true"
    )


def check_init_tokenizer(run: RunSetup, data) -> None:
    """--init-from PATH meeting data of another tokenizer: one line (check_tokenizer), before the
    compile. `data`: the run's opened pipeline; a user's iterable (Trainer(data=...)) has no
    recorded tokenizer to compare."""
    path, sources = run.cfg.checkpoint.init_from, getattr(data, "sources", None)
    if not path or not sources:
        return
    src, step = open_checkpoint(path)
    check_tokenizer(
        src.meta(step),
        sources[0].tokenizer,
        run.cfg.data.allow_tokenizer_mismatch,
        f"--init-from {path}",
    )


def recover(
    run: RunSetup, abstract: TrainState, saver: Checkpointer, state: TrainState, step: int, log
) -> TrainState:
    """--train.max_bad_steps skipped updates in a row (non-finite or, with --train.spike_factor,
    loss spikes): reload the last committed checkpoint that
    reads back (`log`: the run's MetricsLogger, for the warnings and the recovery line).

    The state keeps the current step number, so training skips the data window that led here
    (batches are a function of the step; replaying them would likely diverge again) and the
    schedule continues where it was."""
    saver.wait()
    found, _ = newest_readable(saver, lambda s: restore(run, abstract, saver, s)[0], log.print)
    max_bad = run.cfg.train.max_bad_steps
    if found is None:
        raise Diverged(
            f"{max_bad} skipped steps in a row (non-finite or spikes) at step {step} and no checkpoint"
            f" to restore in {saver.directory}" + (" that reads back" if saver.all_steps() else "")
        )
    last, restored = found
    log.print(
        f"recovery: {max_bad} skipped steps in a row (non-finite or spikes) at step {step}; restored the"
        f" weights of step {last} from {saver.step_dir(last)} and skipped batches {last + 1}-{step}"
    )
    return restored.replace(step=state.step)


def warn_changed_settings(meta: dict, config: dict, data, log) -> None:
    """One warning line listing the settings (`config`: this run's, as Config.to_dict()) and the
    data sources (`data`: the run's pipeline) that differ from the checkpoint's."""
    changed = changed_settings(meta.get("config", {}), config)
    if "loader" in meta.get(
        "data", {}
    ):  # the data itself (sources, windows) as well as the settings
        changed = list(dict.fromkeys(changed + data.check_state(meta["data"]["loader"])))
    if changed:
        log.print(
            f"warning: resuming with settings that differ from the checkpoint's: {', '.join(changed)}"
            + (
                " (the learning-rate schedule spans train.steps)"
                if any(c.startswith("train.steps ") for c in changed)
                else ""
            )
        )
