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

from checkpoint import finite, peer_copy
from checkpoint.integrity import UnreadableCheckpoint
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
from train.core import lora
from train.core import state as train_state
from train.core.setup import RunSetup
from train.core.state import TrainState
from train.run.comm_layout import convert, saved_abstract
from train.run.resilience import Diverged


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
    # latest: train/run/named_runs.py made it a PATH, unless --run-dir was given
    elif c.resume in ("auto", "latest"):
        point = (_newest_local(run, abstract, saver, local) if local else None) or _latest_intact(
            run, abstract, saver
        )
    else:
        src, step = open_checkpoint(c.resume)
        if src.directory == saver.directory:
            src = saver
        # a layout that cannot be converted fails before anything runs
        saved_abstract(run, abstract, src, step)
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
        for copies in local.companions:  # the peer copies (checkpoint/peer_copy.py)
            drop_after(copies, point.step if point else None)
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
    c = run.cfg.checkpoint
    peer = (
        peer_copy.peer_tier(local, c.local_dir, keep=c.local_keep, async_save=c.async_save)
        if c.local_peer
        else None
    )
    candidates = peer_copy.recoverable_steps(local, peer) if peer else steps_everywhere(local)
    for step in candidates:
        if newest_shared is not None and step <= newest_shared:
            break
        restored, why, damaged = None, "", False
        try:
            if peer is None or step in local.all_steps():  # else the next process's copy serves
                why = saved_elsewhere(local, step, run.mesh) or (
                    ""
                    if saved_abstract(run, abstract, local, step) is abstract
                    else f"local step {step} was saved with other --comm settings"
                )
                restored = None if why else local.restore(step, abstract)
        except UserError as e:  # damaged, or saved with other settings: the persistent tier decides
            why, damaged = str(e), isinstance(e, UnreadableCheckpoint)
        if all_processes(not why):
            try:  # a process without its own copy: its shards from the next process's copy
                restored = (
                    peer and peer_copy.complete(peer, step, abstract, run.mesh, restored)
                ) or restored
            except UserError as e:  # every process raises it alike
                print(f"warning: {e}; not resuming from local step {step}", flush=True)
                continue
            return ResumePoint(local, step, restored)
        if why:  # every process names the reason of its own copy
            moved = f"; set aside as {local.set_aside(step)}" if damaged else ""
            print(
                f"warning: process {jax.process_index()}: {why}{moved}; not resuming from local"
                f" step {step}",
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
                + " (nothing was deleted; to start fresh, move them aside or use another"
                " --checkpoint.dir; to read one anyway, --resume PATH shows its error)"
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
        state, meta["converted"] = convert(run, abstract, state)
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
    # LoRA's is the base (train/core/lora.py)
    if run.cfg.checkpoint.init_from and not lora.enabled(run.cfg.lora):
        state, note = init_from(run, abstract.params, run.cfg.checkpoint.init_from)
        return state, {}, note
    return create(), {}, ""


def init_from(run: RunSetup, abstract_params: Any, path: str) -> tuple[TrainState, str]:
    """--init-from PATH: step 0 with a fresh optimizer around the parameters of a checkpoint (full
    or parameters-only, e.g. `python -m checkpoint hf import`), read straight into this mesh's
    shardings."""
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
            f"{max_bad} skipped steps in a row (non-finite or spikes) at step {step} and no"
            " checkpoint"
            f" to restore in {saver.directory}" + (" that reads back" if saver.all_steps() else "")
        )
    last, restored = found
    log.print(
        f"recovery: {max_bad} skipped steps in a row (non-finite or spikes) at step {step};"
        f" restored the weights of step {last} from {saver.step_dir(last)} and skipped batches"
        f" {last + 1}-{step}"
    )
    return restored.replace(step=state.step)
