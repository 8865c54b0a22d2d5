"""The loop proper, from the first step to --steps or a stop signal: step, log, recover, save,
evaluate. Everything it reports to is the Run (train/run/run.py); train/run/loop.py builds what
it needs and summarises what it returns."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable

import jax

from train.core import pair_loss
from train.core.config import Config
from train.core.inference import Evaluator
from train.run import faults
from train.run.resilience import StopSignals
from train.run.run import Run


@dataclasses.dataclass
class Evals:
    """What an eval evaluates: the training data's held-out batches (none without them) and the
    --data.eval_source sets, with the run's evaluator on the parameters `model_params(state)`
    gives (a LoRA run's merged ones); `figures(params) -> {"eval/NAME": value}`: a post-training
    objective's own held-out figures in place of the held-out loss (grpo's rewards of greedy
    completions, a preference objective's loss and accuracy on held-out pairs: see loop.py)."""

    held_out: list[dict]
    sets: list
    evaluator: Evaluator
    model_params: Callable
    figures: Callable | None = None

    def scored_by_objective(self, s, rollouts=None, frozen=None) -> Evals:
        """These evals with the held-out split scored by the objective itself where it has its
        own measure, in place of the held-out token loss: grpo's held-out prompts by the rewards
        of their greedy completions (train/run/rollouts.py), a preference objective's held-out
        pairs by its loss and metrics (train/core/pair_loss.py), against the reference that
        `frozen` holds (dpo, ipo: a LoRA run's base, else the reference model). `s`: the run's
        setup."""
        cfg, figures = s.cfg, None
        if self.held_out and rollouts is not None:
            figures = functools.partial(rollouts.held_out_rewards, held_out=self.held_out)
        elif self.held_out and cfg.post.preference:
            ref = pair_loss.reference_params(cfg, frozen) if cfg.post.needs_reference else None
            scorer = pair_loss.HeldOutPairs(s, ref)
            figures = functools.partial(scorer, batches=self.held_out)
        if figures is None:
            return self
        return dataclasses.replace(self, held_out=[], figures=figures)

    def due(self, step: int, every: int, last: int) -> bool:
        some = self.held_out or self.sets or self.figures
        return bool(some) and (step % every == 0 or step == last)

    def losses(self, state) -> tuple[float | None, dict[str, float], dict[str, float]]:
        """-> (the loss on the held-out batches, None without them; each eval set's loss; the
        objective's held-out figures)."""
        params = self.model_params(state)  # a LoRA run's merge, once for every set
        return (
            self.evaluator.loss(params, self.held_out) if self.held_out else None,
            {s.name: self.evaluator.loss(params, s.batches) for s in self.sets},
            self.figures(params) if self.figures else {},
        )


def run_steps(
    cfg: Config, run: Run, step_fn, state, batch, data, signals: StopSignals, evals: Evals
):
    """Steps from the state's on, `batch` the first one's -> (the last state, the signal that
    stopped the run or None). The last save is committed before it returns; the data and the
    profiler are closed whatever happens."""
    t, log_every, step = cfg.train, cfg.logging.log_every, int(state.step)
    # a signal before the first step: nothing to save
    stopped_by, hang_at = signals.received, faults.current().hang_steps
    # a grpo run with several updates per rollout stops at a rollout boundary: a checkpoint then
    # never holds a half-used rollout (train/run/rollouts.py)
    per_rollout, pending = cfg.post.updates_per_rollout if cfg.post.grpo else 1, None
    try:
        with run.heartbeat, run.watchdog:
            while step < t.steps and not stopped_by:
                state, metrics = run.step(step_fn, state, batch, step + 1)
                step += 1
                run.stepped(step, metrics)
                if step in hang_at:
                    threading.Event().wait()  # fault injection: a hang the watchdog must catch
                pending = signals.requested(step) or pending
                stopped_by = pending if step % per_rollout == 0 else None
                if step < t.steps and not stopped_by:
                    batch, waited = data.next()
                    run.stats.wait_s += waited
                # step 1: the starting loss
                if step % log_every == 0 or step in (1, t.steps) or stopped_by:
                    bad = run.record(step, metrics)
                    if t.max_bad_steps and bad >= t.max_bad_steps:
                        state = run.recover(state, step)
                final = bool(stopped_by) or step == t.steps
                if run.saves.due(step, force=final):
                    run.checkpoint(step, state, final)
                if stopped_by:
                    break
                if evals.due(step, t.eval_every, t.steps):
                    run.evaluate(step, functools.partial(evals.losses, state))
            run.commit_last_save()
    finally:
        data.close()
        run.profiler.close()
    return state, stopped_by


def nothing_to_train(point, steps: int) -> dict:
    """The summary of a run whose resume point already reached --steps (said on process 0)."""
    if jax.process_index() == 0:
        print(
            f"{point.src.step_dir(point.step)}: step {point.step} already reached --steps"
            f" {steps}; nothing to train (raise --steps to continue)",
            flush=True,
        )
    return {"steps": point.step, "resumed_from": point.step, "trained_steps": 0, "exit_code": 0}
