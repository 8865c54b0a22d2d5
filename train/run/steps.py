"""The loop proper, from the first step to --steps or a stop signal: step, log, recover, save,
evaluate. Everything it reports to is the Run (train/run/run.py); train/run/loop.py builds what
it needs and summarises what it returns."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable

import jax

from train.core.config import Config
from train.core.inference import Evaluator
from train.run import faults
from train.run.resilience import StopSignals
from train.run.run import Run


@dataclasses.dataclass
class Evals:
    """What an eval evaluates: the training data's held-out batches (none without them) and the
    --data.eval_source sets, with the run's evaluator on the parameters `model_params(state)`
    gives (a LoRA run's merged ones)."""

    held_out: list[dict]
    sets: list
    evaluator: Evaluator
    model_params: Callable

    def due(self, step: int, every: int, last: int) -> bool:
        return bool(self.held_out or self.sets) and (step % every == 0 or step == last)

    def losses(self, state) -> tuple[float | None, dict[str, float]]:
        """-> (the loss on the held-out batches, None without them; each eval set's loss)."""
        params = self.model_params(state)  # a LoRA run's merge, once for every set
        return (
            self.evaluator.loss(params, self.held_out) if self.held_out else None,
            {s.name: self.evaluator.loss(params, s.batches) for s in self.sets},
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
    try:
        with run.heartbeat, run.watchdog:
            while step < t.steps and not stopped_by:
                state, metrics = run.step(step_fn, state, batch, step + 1)
                step += 1
                run.stepped(step, metrics)
                if step in hang_at:
                    threading.Event().wait()  # fault injection: a hang the watchdog must catch
                stopped_by = signals.requested(step)
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
