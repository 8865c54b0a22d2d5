"""The training loop: the only place with I/O. Data in; metrics, eval and a sample out.

`Trainer.fit()` reads top to bottom: setup (the data, then the step, compiled and checked to fit
in memory before anything is allocated), resume (train/run/resume.py picks the state to start
from), the steps (train/run/steps.py), the summary; an out-of-memory failure anywhere in it ends
in one line. The run's pieces are computed once, in train/core/setup.py (`trainer.setup`); what
the loop reports to is train/run/run.py's Run.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
from jax.sharding import Mesh

from checkpoint.manager import Checkpointer, shared_directory
from checkpoint.orbax_log import kept_in
from checkpoint.saving import committed_on_exit
from errors import UserError
from mesh.build import start_mesh
from models import model
from train.core import lora, pair_loss, qlora
from train.core import state as train_state
from train.core.config import Config
from train.core.inference import Evaluator, sample_text
from train.core.setup import abstract_batch, abstract_state, compile_checked, create_state, setup
from train.data.evalsets import describe as describe_sets
from train.data.external import IterableData
from train.run import checkpoint_match, faults, resume, trainer_args
from train.run.device_memory import out_of_memory_line
from train.run.goodput import Goodput
from train.run.inputs import open_data, open_eval_sets
from train.run.metrics import summary
from train.run.named_runs import start_named_run, withdraw_named_run
from train.run.resilience import StopSignals
from train.run.rollouts import Rollouts
from train.run.run import Run, open_run
from train.run.rundir import claim
from train.run.startup import (
    Skeleton,
    check_before_creating,
    checkpoint_dir,
    local_tier_dir,
    open_checkpoints,
)
from train.run.steps import Evals, nothing_to_train, run_steps
from train.run.watchdog import doing, set_doing


class Trainer:
    """Build everything from a Config, then `fit()`. Usable from notebooks as well as the CLI.
    `trainer.setup` holds the run's pieces (mesh, rules, shardings, optimizer: train/core/setup.py);
    after fit(), `.state`, `.history` and `.eval_history` hold the final state and the records."""

    def __init__(
        self,
        cfg: Config,
        *,
        mesh: Mesh | None = None,
        devices: list | None = None,
        on_log=None,
        data=None,
        eval_data=None,
        loss=None,
        optimizer=None,
        schedule=None,
    ):
        """`mesh`: the entry point's (else one is built from --mesh over `devices`, after starting
        the distributed runtime). `on_log(record)`: called with every metrics record as it is
        logged (the dicts written to metrics.jsonl), e.g. for a live plot in a notebook.

        Extension points (docs/extending.md): `data`, `eval_data`: iterables of batches replacing
        --data (train/data/external.py); `loss(logits_BTV, batch) -> loss_BT`: a per-token loss
        replacing cross-entropy (train/core/batch_loss.py token_losses); `optimizer`: an optax
        transformation replacing AdamW, `schedule`: its learning rate (a number or a function of
        the update count; required with `optimizer`, what the log reports; without `optimizer`,
        AdamW's)."""
        self._started_at = time.time()  # goodput counts this attempt's wall time from here
        trainer_args.check(cfg, mesh, devices, on_log, data, eval_data, loss)
        self.cfg, self.on_log, self.data, self.eval_data = cfg, on_log, data, eval_data
        mesh = mesh if mesh is not None else start_mesh(cfg.parallelism, devices)
        self.setup = setup(cfg, mesh, loss=loss, optimizer=optimizer, schedule=schedule)
        # the BRIGADE_INJECT_* drills, checked before anything compiles
        faults.current().check(cfg.train.steps, jax.process_count(), own_data=data is not None)
        self.evaluator = Evaluator(self.setup)
        self.predicted_peak: int | None = None  # per device, from the compiled step's memory
        self.base = None  # --lora.rank > 0: the frozen base (train/core/lora.py), loaded at start
        self.reference = None  # dpo, ipo without LoRA: the frozen reference, loaded at start

    def model_params(self, state) -> dict:
        """What the model computes with: `state.params`, or a LoRA run's base with its adapters
        merged."""
        return state.params if self.base is None else self._merge(self.base, state.params)

    @functools.cached_property
    def _merge(self):
        merge = functools.partial(lora.model_params, self.cfg)
        if qlora.enabled(self.cfg.lora):  # pairs the arrays as they are: merged per layer in use
            return merge
        return jax.jit(merge, out_shardings=self.setup.base_shardings)

    @functools.cached_property
    def _abstract(self) -> train_state.TrainState:
        # traced once per Trainer: the resume check, the restore, NaN recovery and --init-from
        # all ask for it
        return abstract_state(self.setup)

    def _use_config(self, cfg: Config) -> None:
        """The run's config from now on (its named run dir, its LoRA base recorded), in the setup
        too: the saves record the setup's."""
        self.cfg, self.setup = cfg, dataclasses.replace(self.setup, cfg=cfg)

    def fit(self) -> dict:
        """Train to --steps, saving checkpoints; resume first if --resume finds one. The summary's
        `exit_code` is 0, or 128 + the signal number when SIGTERM/SIGINT stopped the run. The
        run directory is locked for the whole run (train/run/rundir.py): a second run on it
        exits. The default run dir becomes a fresh named one (start_named_run) now, not when the
        Trainer is built: a Trainer built for plan or analysis writes nothing."""
        if (named := start_named_run(self.cfg)) is not self.cfg:
            self._use_config(named)
        cfg = self.cfg
        self.goodput = Goodput(self._started_at)
        # Orbax's error records go to a file of the run dir, not onto the one line that ends a run
        with kept_in(cfg.logging.run_dir, jax.process_index()):
            try:
                return self._claim_and_train(cfg)
            except UserError:
                withdraw_named_run(cfg)  # refused before it wrote anything: no runs/<name> left
                raise

    def _claim_and_train(self, cfg: Config) -> dict:
        """What can be refused without creating anything is, first (train/run/startup.py); then
        the run claims its directories (a later refusal takes back what it created) and trains."""
        owners = check_before_creating(cfg, shared_directory(checkpoint_dir(cfg)))
        data = open_data(self.setup, self.data, self.eval_data)  # a bad --data: before the claim
        skeleton = Skeleton(cfg.logging.run_dir, checkpoint_dir(cfg), local_tier_dir(cfg))
        # from here on a signal stops the run cleanly, even mid-compile
        with (
            claim(cfg.logging.run_dir, cfg.checkpoint.dir, undo=skeleton.undo),
            committed_on_exit(open_checkpoints(cfg, owners)) as saver,
            StopSignals() as signals,
        ):
            with out_of_memory_line(
                lambda: self.predicted_peak, self.setup.mesh.local_devices, doing
            ):
                return self._compile_and_train(saver, signals, data)

    def _compile_and_train(self, saver: Checkpointer, signals: StopSignals, data) -> dict:
        """fit() from the compile to the summary (an out-of-memory failure anywhere in it: one
        line)."""
        cfg, t = self.cfg, self.cfg.train
        # the checkpoint --resume picks (its metadata only; nothing is allocated), found before
        # the compile so that a run already at --steps does not compile for nothing
        point = resume.resume_point(self.setup, self._abstract, saver)
        if not point:  # a fresh run: --init-from's parameters must speak the data's tokenizer
            checkpoint_match.check_init_tokenizer(self.setup, data)
        if point and point.step >= t.steps:
            self.history, self.eval_history = [], []
            return nothing_to_train(point, t.steps)
        lora.check_start(cfg, resuming=point is not None)
        # a bad --data.eval_source: before the compile
        sets = open_eval_sets(self.setup, data) if t.eval_every else []
        t0 = time.perf_counter()
        set_doing("compiling the train step")
        step_fn, self.predicted_peak = compile_checked(
            self.setup, self._abstract, abstract_batch(self.setup)
        )
        compile_s = time.perf_counter() - t0
        self.goodput.add("compile", compile_s)
        set_doing("initialising or restoring the state")
        state, meta, step_fn, note = self._initial_state(point, step_fn)
        # grpo: the step's batch is the prompts' completions sampled by this policy
        rollouts = Rollouts(self.setup, step_fn, self.model_params, data) if cfg.post.grpo else None
        step_fn = rollouts or step_fn
        if isinstance(data, IterableData):  # a user iterable resumes from the saved position
            data.seek(int(state.step), meta.get("data", {}).get("loader"))
        else:  # the built-in pipeline's batches are a function of the step
            data.seek(int(state.step))
        batch, _ = data.next()
        held_out = data.eval_batches(t.eval_batches) if t.eval_every else []
        opening = (compile_s, note, meta)
        run = open_run(
            self.setup,
            self._abstract,
            saver,
            data,
            point,
            state,
            self.goodput,
            opening,
            self.on_log,
        )
        if sets:
            run.log.print(describe_sets(sets, t.seq_len))
        evals = Evals(held_out, sets, self.evaluator, self.model_params)
        evals = evals.scored_by_objective(self.setup, rollouts, self.reference or self.base)
        state, stopped_by = run_steps(cfg, run, step_fn, state, batch, data, signals, evals)
        return self._finish(run, data, state, point, compile_s, stopped_by)

    def _initial_state(self, point: resume.ResumePoint | None, step_fn):
        """-> (the state to start from, its checkpoint's meta, the step to run it with, a line for
        the log). The restore (read whole to verify it) or a fresh start count as goodput's
        restore, a fresh init as compile (mostly its compile)."""
        cfg, s, t0 = self.cfg, self.setup, time.perf_counter()
        state, meta, note = resume.initial_state(
            s, self._abstract, point, lambda: create_state(s), t0
        )
        # --init-from's parameters come without the spike guard's window
        state = train_state.with_loss_window(state, cfg.train.spike_factor, s.mesh)
        if lora.enabled(cfg.lora):  # the step's third argument: the frozen base
            step_fn, self.base, recorded, line = with_base(cfg, s, step_fn, meta)
            self._use_config(recorded)
            note = "; ".join(filter(None, [note, line]))
        if s.ref_shardings is not None:  # dpo/ipo without LoRA: the frozen reference, its argument
            step_fn, self.reference, recorded, line = with_reference(self.cfg, s, step_fn, meta)
            self._use_config(recorded)
            note = "; ".join(filter(None, [note, line]))
        restored = point or cfg.checkpoint.init_from
        self.goodput.add("restore" if restored else "compile", time.perf_counter() - t0)
        return state, meta, step_fn, note

    def _finish(self, run: Run, data, state, point, compile_s: float, stopped_by) -> dict:
        """A sample, then the summary: logged, written to summary.json, returned; the final state
        and the records kept (`.state`, `.history`, `.eval_history`)."""
        t, t0 = self.cfg.train, time.perf_counter()
        tokenizer = data.tokenizer()  # None when a prepared dataset's tokenizer no longer loads
        text = ""
        if t.sample_tokens and tokenizer and model.decodes(self.cfg.model) and not stopped_by:
            params = self.model_params(state)
            text = sample_text(self.setup, params, t.prompt, t.sample_tokens, t.seed, tokenizer)
        self.goodput.add("eval", time.perf_counter() - t0)
        saved = run.saves.started
        out = summary(
            run.history,
            run.eval_history,
            self.goodput,
            model_cfg=self.cfg.model,
            mesh=self.setup.mesh,
            compile_s=compile_s,
            sample=text,
            resumed_from=point.step if point else None,
            checkpoint=run.saves.saver.step_dir(saved) if saved is not None else None,
            stopped_by=stopped_by,
            predicted_peak_bytes=self.predicted_peak,
        )
        run.finish(out, self.cfg.logging.run_dir)
        self.state, self.history, self.eval_history = state, run.history, run.eval_history
        return out


def with_base(cfg: Config, s, step_fn, meta: dict):
    """-> (the step with LoRA's frozen base (train/core/lora.py) as its third argument, the base,
    the config with the base's fingerprint and pointer recorded, a line for the log)."""
    base, found, pointer, line = lora.load_base(cfg, s.mesh, s.rules, s.base_shardings, meta)
    step = functools.partial(
        lambda compiled, base, state, batch: compiled(state, batch, base), step_fn, base
    )
    return step, base, lora.with_base_recorded(cfg, found, pointer), line


def with_reference(cfg: Config, s, step_fn, meta: dict):
    """-> (the step with the reference model (train/core/pair_loss.py) as its third argument, the
    reference's parameters, the config with the reference's fingerprint recorded (every save holds
    it), a line for the log)."""
    reference, found, line = pair_loss.load_reference(cfg, s.ref_shardings, meta)
    recorded = dataclasses.replace(cfg, post=dataclasses.replace(cfg.post, ref_fingerprint=found))
    step = functools.partial(
        lambda compiled, ref, state, batch: compiled(state, batch, ref), step_fn, reference
    )
    return step, reference, recorded, line
