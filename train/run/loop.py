"""The training loop: the only place with I/O. Data in; metrics, eval and a sample out.

`Trainer.fit()` reads top to bottom: setup (the data, then the step, compiled and checked to fit
in memory before anything is allocated), resume (train/run/resume.py picks the state to start from),
the loop, the summary; an out-of-memory failure anywhere in it ends in one line. The run's
pieces are computed once, in train/core/setup.py; what the loop reports to is train/run/run.py's Run.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh

from checkpoint.manager import Checkpointer, open_checkpoint, shared_directory
from checkpoint.orbax_log import kept_in
from checkpoint.saving import committed_on_exit
from checkpoint.tiers import local_tier
from errors import UserError
from mesh.build import start_mesh
from mesh.rules import axis_rules
from mesh.spec import mesh_text
from models import context, model
from models.sample import generate
from train.core import lora
from train.core import state as train_state
from train.core.config import Config
from train.core.memory import check_fits, step_bytes_per_device
from train.core.setup import abstract_batch, abstract_state, compile_step, jit_step, setup
from train.core.step import eval_step
from train.data import make_pipeline
from train.data.evalsets import EvalSet, open_eval_source
from train.data.evalsets import describe as describe_sets
from train.data.external import IterableData
from train.data.tokenizers import ByteTokenizer
from train.run import faults, resume, trainer_args
from train.run.device_memory import out_of_memory_line
from train.run.goodput import Goodput
from train.run.metrics import summary
from train.run.resilience import StopSignals
from train.run.run import Run, open_run
from train.run.rundir import claim, start_named_run, withdraw_named_run
from train.run.startup import Skeleton, check_before_creating, checkpoint_dir, local_tier_dir
from train.run.watchdog import doing, set_doing


class Trainer:
    """Build everything from a Config, then `fit()`. Usable from notebooks as well as the CLI."""

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
        replacing cross-entropy (train/core/step.py token_losses); `optimizer`: an optax transformation
        replacing AdamW, `schedule`: its learning rate (a number or a function of the update
        count; required with `optimizer`, what the log reports; without `optimizer`, AdamW's)."""
        self._started_at = time.time()  # goodput counts this attempt's wall time from here
        trainer_args.check(
            cfg,
            mesh=mesh,
            devices=devices,
            on_log=on_log,
            data=data,
            eval_data=eval_data,
            loss=loss,
        )
        self.cfg = cfg
        self.on_log = on_log
        self.data, self.eval_data = data, eval_data
        self.setup = s = setup(
            cfg,
            mesh if mesh is not None else start_mesh(cfg.parallelism, devices),
            loss=loss,
            optimizer=optimizer,
            schedule=schedule,
        )
        # the BRIGADE_INJECT_* drills, checked before anything compiles
        faults.current().check(cfg.train.steps, jax.process_count(), own_data=data is not None)
        self.mesh, self.rules, self.model_cfg, self.compute_dtype = (
            s.mesh,
            s.rules,
            cfg.model,
            s.compute_dtype,
        )
        self.tx, self.lr, self.sync, self.local_clip = s.tx, s.lr, s.sync, s.local_clip
        self.batch_sharding, self.state_shardings = s.batch_sharding, s.state_shardings
        self.local_devices = [
            d for d in s.mesh.devices.flat if d.process_index == jax.process_index()
        ]
        self.predicted_peak: int | None = (
            None  # per device, from the compiled step's memory analysis
        )
        self.base = None  # --lora.rank > 0: the frozen base (train/core/lora.py), loaded when the run starts

    # -- building blocks --------------------------------------------------------------------
    def create_state(self) -> train_state.TrainState:
        return self._windowed(
            train_state.create(
                self.model_cfg,
                self.tx,
                self.mesh,
                self.rules,
                self.cfg.train.seed,
                self.sync,
                lora_cfg=self.cfg.lora,
            )
        )

    def model_params(self, state) -> dict:
        """What the model computes with: `state.params`, or a LoRA run's base with its adapters merged."""
        return state.params if self.base is None else self._merge(self.base, state.params)

    @functools.cached_property
    def _merge(self):
        return jax.jit(
            functools.partial(lora.model_params, self.cfg), out_shardings=self.setup.base_shardings
        )

    def load_lora_base(self, meta: dict) -> str:
        """--lora.rank > 0: the frozen base loaded into `self.base` (from --init-from, or the pointer
        in a resumed checkpoint's `meta`) and its fingerprint recorded in the config every save
        carries, with its step directory as --init-from (the pointer a resume or an export follows)
        -> the line for the log."""
        cfg = self.cfg
        self.base, found, pointer, note = lora.load_base(
            cfg, self.mesh, self.rules, self.setup.base_shardings, meta
        )
        self.cfg = dataclasses.replace(
            cfg,
            lora=dataclasses.replace(cfg.lora, base_fingerprint=found),
            checkpoint=dataclasses.replace(cfg.checkpoint, init_from=pointer),
        )
        self.setup = dataclasses.replace(self.setup, cfg=self.cfg)
        return note

    def _windowed(self, state) -> train_state.TrainState:
        """`state` (abstract or real) with the --train.spike_factor window when it is on."""
        return train_state.with_loss_window(state, self.cfg.train.spike_factor, self.mesh)

    def abstract_state(self) -> train_state.TrainState:
        """ShapeDtypeStructs with shardings of this run's state (plan, restore)."""
        return self._abstract_state

    @functools.cached_property
    def _abstract_state(self) -> train_state.TrainState:
        # traced once per Trainer: the resume check, the restore, NaN recovery and --init-from all ask for it
        return self._windowed(abstract_state(self.setup))

    def jit_step(self):
        return jit_step(self.setup)

    def dp_axes(self) -> tuple[str, ...]:
        """Leading batch mesh axes (size > 1) that shard no parameter: plain data parallelism."""
        return self.setup.dp_axes

    def abstract_batch(self) -> dict:
        return abstract_batch(self.setup)

    def compile_step(self, state, batch):
        return compile_step(self.setup, state, batch)

    @functools.cached_property
    def _eval_fn(self):
        # one jitted function per Trainer: a fresh jax.jit per eval would retrace and recompile every time
        return jax.jit(
            functools.partial(
                eval_step, self.model_cfg, pipeline=self.cfg.pipeline, loss_fn=self.setup.loss_fn
            )
        )

    def eval_loss(self, params, batches) -> float:
        with (
            jax.set_mesh(self.mesh),
            axis_rules(self.rules),
            context.strategy(self.cfg.parallelism.context_strategy),
        ):
            sums = [self._eval_fn(params, b) for b in batches]
        total, count = np.sum([jax.device_get(s) for s in sums], axis=0)
        return float(total / max(count, 1.0))

    def sample(self, params, prompt: str, n_tokens: int, seed: int = 0, tokenizer=None) -> str:
        tokenizer = tokenizer or ByteTokenizer()
        prompt_tokens = tokenizer.encode([prompt or "\n"])[0][None, :].astype(np.int32)
        replicate_acts = {k: () for k in self.rules}  # a batch of one cannot be split over devices
        with jax.set_mesh(self.mesh), axis_rules(replicate_acts):
            out = generate(
                self.model_cfg, params, prompt_tokens, jax.random.key(seed), max_new=n_tokens
            )
        return tokenizer.decode(np.asarray(jax.device_get(out))[0])

    # -- checkpoints (the policy is train/run/resume.py's) ----------------------------------------
    def open_checkpoints(self, owners=(None, None)) -> Checkpointer:
        """The directory this run saves into: --checkpoint.dir, else <run_dir>/checkpoints (and its
        local tier, with --checkpoint.local_dir). `owners`: the run as the owner of each of them
        (train/run/startup.py): retention deletes the run's own steps alone."""
        c = self.cfg.checkpoint
        directory = shared_directory(checkpoint_dir(self.cfg))
        saver = Checkpointer(
            directory,
            keep=c.keep,
            keep_every=c.keep_every,
            async_save=c.async_save,
            run_owner=owners[0],
        )
        if owners[1] is not None:  # opened now with its owner; resume and saves find it
            local_tier(
                saver, c.local_dir, keep=c.local_keep, async_save=c.async_save, run_owner=owners[1]
            )
        return saver

    def resume_point(self, saver: Checkpointer) -> tuple[Checkpointer, int] | None:
        """Where --resume says to continue from: (checkpoint directory, step), or None for a fresh start."""
        point = resume.resume_point(self.setup, self.abstract_state(), saver)
        return (point.src, point.step) if point else None

    def restore(self, src: Checkpointer, step: int) -> tuple[train_state.TrainState, dict]:
        """`step` read straight into this trainer's mesh, shardings and --comm layout."""
        return resume.restore(self.setup, self.abstract_state(), src, step)

    def init_from(self, path: str) -> tuple[train_state.TrainState, str]:
        """--init-from PATH: the parameters of a checkpoint, with a fresh optimizer."""
        return resume.init_from(self.setup, self.abstract_state().params, path)

    # -- the run ------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to --steps, saving checkpoints; resume first if --resume finds one. The summary's
        `exit_code` is 0, or 128 + the signal number when SIGTERM/SIGINT stopped the run. The
        run directory is locked for the whole run (train/run/rundir.py): a second run on it exits."""
        cfg = self._name_the_run()
        self.goodput = Goodput(self._started_at)
        # Orbax's error records go to a file of the run dir, not onto the one line that ends a run
        with kept_in(cfg.logging.run_dir, jax.process_index()):
            try:
                return self._claim_and_train(cfg)
            except UserError:
                withdraw_named_run(cfg)  # refused before it wrote anything: no runs/<name> left
                raise

    def _claim_and_train(self, cfg: Config) -> dict:
        """What can be refused without creating anything is, first (train/run/startup.py); then the
        run claims its directories (a later refusal takes back what it created) and trains."""
        owners = check_before_creating(cfg, shared_directory(checkpoint_dir(cfg)))
        data = self._open_data()  # a bad --data, or a vocabulary too small for it
        skeleton = Skeleton(cfg.logging.run_dir, checkpoint_dir(cfg), local_tier_dir(cfg))
        with (
            claim(cfg.logging.run_dir, cfg.checkpoint.dir, undo=skeleton.undo),
            committed_on_exit(self.open_checkpoints(owners)) as saver,
            StopSignals() as signals,
        ):  # from here on a signal stops the run cleanly, even mid-compile
            with out_of_memory_line(lambda: self.predicted_peak, self.local_devices, doing):
                return self._compile_and_train(saver, signals, data)

    def _name_the_run(self) -> Config:
        """The default run dir made a fresh named one (train/run/rundir.py start_named_run) when a run
        starts, not when the Trainer is built: a Trainer built for plan or analysis writes nothing.
        The CLI has named it already (once per job, for the supervisor's restarts)."""
        named = start_named_run(self.cfg)
        if named is not self.cfg:
            self.cfg, self.setup = named, dataclasses.replace(self.setup, cfg=named)
        return self.cfg

    def _open_data(self):
        """The built-in pipeline of --data, or the Trainer's own iterable (train/data/external.py)."""
        cfg, t = self.cfg, self.cfg.train
        if self.data is not None:
            return IterableData(
                self.data,
                self.eval_data,
                batch_size=t.batch_size,
                seq_len=t.seq_len,
                packing_mask=cfg.data.packing_mask,
                batch_sharding=self.batch_sharding,
                vocab_size=self.model_cfg.vocab_size,
            )
        return make_pipeline(
            cfg.data,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            seed=t.seed,
            batch_sharding=self.batch_sharding,
            vocab_size=self.model_cfg.vocab_size,
        )

    def _compile_and_train(self, saver, signals: StopSignals, data) -> dict:
        """fit() from the compile to the summary (an out-of-memory failure anywhere in it: one line)."""
        cfg, t, gp = self.cfg, self.cfg.train, self.goodput
        # -- resume: the checkpoint --resume picks (its metadata only; nothing is allocated), found
        # before the compile so that a run already at --steps does not compile for nothing
        point = resume.resume_point(self.setup, self.abstract_state(), saver)
        if not point:  # a fresh run: --init-from's parameters must speak the data's tokenizer
            resume.check_init_tokenizer(self.setup, data)
        if point and point.step >= t.steps:
            return self._nothing_to_train(point)
        lora.check_start(cfg, resuming=point is not None)
        sets = (
            self._open_eval_sets(data) if t.eval_every else []
        )  # a bad --data.eval_source: before the compile
        step_fn, compile_s = self._compile_checked()
        t0 = time.perf_counter()  # the restore (read whole to verify it), or a fresh start
        state, meta, note = resume.initial_state(
            self.setup, self.abstract_state(), point, self.create_state, t0
        )
        state = self._windowed(
            state
        )  # --init-from's parameters come without the spike guard's window
        if lora.enabled(cfg.lora):  # the step's third argument: the frozen base
            note = "; ".join(filter(None, [note, self.load_lora_base(meta)]))
            step_fn = functools.partial(
                lambda compiled, base, state, batch: compiled(state, batch, base),
                step_fn,
                self.base,
            )
        gp.add(
            "restore"
            if point or cfg.checkpoint.init_from
            else "compile",  # a fresh init: mostly its compile
            time.perf_counter() - t0,
        )
        if isinstance(
            data, IterableData
        ):  # a user iterable is restored from the checkpoint's position
            data.seek(step := int(state.step), meta.get("data", {}).get("loader"))
        else:  # the built-in pipeline's batches are a function of the step
            data.seek(step := int(state.step))
        batch, _ = data.next()
        evals = data.eval_batches(t.eval_batches) if t.eval_every else []
        run = open_run(
            self.setup,
            self.abstract_state(),
            saver,
            data,
            point,
            state,
            self.goodput,
            opening=(compile_s, note, meta),
            on_log=self.on_log,
        )
        if sets:
            run.log.print(describe_sets(sets, t.seq_len))
        # -- the loop
        stopped_by, hang_at = (
            signals.received,
            faults.current().hang_steps,
        )  # a signal already: nothing to save
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
                    if (
                        step % cfg.logging.log_every == 0 or step in (1, t.steps) or stopped_by
                    ):  # 1: the starting loss
                        bad = run.record(step, metrics)
                        if t.max_bad_steps and bad >= t.max_bad_steps:
                            state = run.recover(state, step)
                    final = bool(stopped_by) or step == t.steps
                    if run.saves.due(step, force=final):
                        run.checkpoint(step, state, final)
                    if stopped_by:
                        break
                    if (evals or sets) and (step % t.eval_every == 0 or step == t.steps):
                        run.evaluate(step, functools.partial(self._eval_losses, state, evals, sets))
                run.commit_last_save()
        finally:
            data.close()
            run.profiler.close()
        # -- summary
        return self._finish(run, data, state, point, compile_s, stopped_by)

    def _open_eval_sets(self, data) -> list[EvalSet]:
        """--data.eval_source, opened and checked against the model's vocabulary and tokenizer: the
        training data's (the ids the model learns), or for a user's iterable, which records none,
        the --init-from checkpoint's; with neither there is nothing to compare."""
        cfg, t = self.cfg, self.cfg.train
        if not cfg.data.eval_source:
            return []
        sources = getattr(data, "sources", None)
        if sources:
            meta, whose = {"tokenizer": sources[0].tokenizer}, "the training data's"
        elif cfg.checkpoint.init_from:
            src, at = open_checkpoint(cfg.checkpoint.init_from)
            meta, whose = src.meta(at), "the --init-from checkpoint's"
        else:
            meta, whose = {}, ""

        def check_tokenizer(record: dict, where: str) -> None:
            resume.check_tokenizer(meta, record, cfg.data.allow_tokenizer_mismatch, where, whose)

        return open_eval_source(
            cfg.data,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            seed=t.seed,
            eval_batches=t.eval_batches,
            vocab_size=self.model_cfg.vocab_size,
            sharding=self.batch_sharding,
            check_tokenizer=check_tokenizer,
        )

    def _eval_losses(
        self, state, evals: list[dict], sets: list[EvalSet]
    ) -> tuple[float | None, dict[str, float]]:
        """-> (the loss on the training data's held-out batches, None without them; each eval set's loss)."""
        params = self.model_params(state)  # a LoRA run's merge, once for every set
        return (
            self.eval_loss(params, evals) if evals else None,
            {s.name: self.eval_loss(params, s.batches) for s in sets},
        )

    def _compile_checked(self):
        """-> (the step compiled from the abstract state, seconds). Compiled before any state exists,
        so that the memory check comes before the allocation that a machine too small for the model
        would not survive."""
        t0 = time.perf_counter()
        set_doing("compiling the train step")
        step_fn = self.compile_step(self.abstract_state(), self.abstract_batch())
        compile_s = time.perf_counter() - t0
        self.goodput.add("compile", compile_s)
        self.predicted_peak = step_bytes_per_device(step_fn).get("peak")
        set_doing("initialising or restoring the state")
        if not self.cfg.train.skip_memory_check:
            check_fits(step_fn, list(self.mesh.devices.flat), mesh_text(self.mesh.shape))
        return step_fn, compile_s

    def _nothing_to_train(self, point: resume.ResumePoint) -> dict:
        if jax.process_index() == 0:
            print(
                f"{point.src.step_dir(point.step)}: step {point.step} already reached --steps"
                f" {self.cfg.train.steps}; nothing to train (raise --steps to continue)",
                flush=True,
            )
        self.history, self.eval_history = [], []
        return {"steps": point.step, "resumed_from": point.step, "trained_steps": 0, "exit_code": 0}

    def _finish(
        self, run: Run, data, state, point, compile_s: float, stopped_by: int | None
    ) -> dict:
        """A sample, then the summary: logged, written to summary.json, returned; the final state
        and the records kept (`.state`, `.history`, `.eval_history`)."""
        t, t0 = self.cfg.train, time.perf_counter()
        tokenizer = (
            data.tokenizer()
        )  # None when a prepared dataset's tokenizer file no longer loads
        text = (
            self.sample(self.model_params(state), t.prompt, t.sample_tokens, t.seed, tokenizer)
            if t.sample_tokens and tokenizer and model.decodes(self.model_cfg) and not stopped_by
            else ""
        )
        self.goodput.add("eval", time.perf_counter() - t0)
        saved = run.saves.started
        out = summary(
            run.history,
            run.eval_history,
            self.goodput,
            model_cfg=self.model_cfg,
            mesh=self.mesh,
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
