"""The training loop: the only place with I/O. Data in; metrics, eval and a sample out.

`Trainer.fit()` reads top to bottom: setup (the data, then the step, compiled and checked to fit
in memory before anything is allocated), resume (train/resume.py picks the state to start from),
the loop, the summary. The run's pieces are computed once, in train/setup.py.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from checkpoint.layout import RUN_SUBDIR
from checkpoint.manager import Checkpointer, shared_directory
from checkpoint.saving import Saves, committed_on_exit
from mesh.build import start_mesh
from mesh.rules import axis_rules
from mesh.shard import warn_undersharded
from mesh.spec import mesh_text
from models.flops import flops_per_token, param_count
from models.sample import generate
from train import resume, state as train_state
from train.config import Config, dump
from train.data import make_pipeline
from train.data.tokenizers import ByteTokenizer
from train.goodput import Goodput
from train.memory import check_fits
from train.metrics import MetricsLogger, StepProfiler, StepStats, json_safe, peak_flops, summary, summary_text
from train.resilience import Diverged, StopSignals, injected_steps
from train.rundir import claim, prepare_run_dir, run_dir_writes
from train.setup import RunSetup, abstract_batch, abstract_state, compile_step, jit_step, setup
from train.step import eval_step
from train.watchdog import PeerHeartbeat, Watchdog


class Trainer:
    """Build everything from a Config, then `fit()`. Usable from notebooks as well as the CLI."""

    def __init__(self, cfg: Config, *, mesh: Mesh | None = None, devices: list | None = None, on_log=None):
        """`mesh`: the entry point's (else one is built from --mesh over `devices`, after starting
        the distributed runtime). `on_log(record)`: called with every metrics record as it is
        logged (the dicts written to metrics.jsonl), e.g. for a live plot in a notebook."""
        self._started_at = time.time()  # goodput counts this attempt's wall time from here
        self.cfg = cfg
        self.on_log = on_log
        self.setup = s = setup(cfg, mesh if mesh is not None else start_mesh(cfg.parallelism, devices))
        self.mesh, self.rules, self.model_cfg, self.compute_dtype = s.mesh, s.rules, cfg.model, s.compute_dtype
        self.tx, self.lr, self.sync, self.local_clip = s.tx, s.lr, s.sync, s.local_clip
        self.batch_sharding, self.state_shardings = s.batch_sharding, s.state_shardings

    # -- building blocks --------------------------------------------------------------------
    def create_state(self) -> train_state.TrainState:
        return train_state.create(self.model_cfg, self.tx, self.mesh, self.rules, self.cfg.train.seed, self.sync)

    def abstract_state(self) -> train_state.TrainState:
        """ShapeDtypeStructs with shardings of this run's state (plan, restore)."""
        return self._abstract_state

    @functools.cached_property
    def _abstract_state(self) -> train_state.TrainState:
        # traced once per Trainer: the resume check, the restore, NaN recovery and --init-from all ask for it
        return abstract_state(self.setup)

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
        return jax.jit(functools.partial(eval_step, self.model_cfg, pipeline=self.cfg.pipeline))

    def eval_loss(self, params, batches) -> float:
        with jax.set_mesh(self.mesh), axis_rules(self.rules):
            sums = [self._eval_fn(params, b) for b in batches]
        total, count = np.sum([jax.device_get(s) for s in sums], axis=0)
        return float(total / max(count, 1.0))

    def sample(self, params, prompt: str, n_tokens: int, seed: int = 0, tokenizer=None) -> str:
        tokenizer = tokenizer or ByteTokenizer()
        prompt_tokens = tokenizer.encode([prompt or "\n"])[0][None, :].astype(np.int32)
        replicate_acts = {k: () for k in self.rules}  # a batch of one cannot be split over devices
        with jax.set_mesh(self.mesh), axis_rules(replicate_acts):
            out = generate(self.model_cfg, params, prompt_tokens, jax.random.key(seed), max_new=n_tokens)
        return tokenizer.decode(np.asarray(jax.device_get(out))[0])

    # -- checkpoints (the policy is train/resume.py's) ----------------------------------------
    def open_checkpoints(self) -> Checkpointer:
        """The directory this run saves into: --checkpoint.dir, else <run_dir>/checkpoints."""
        c = self.cfg.checkpoint
        directory = shared_directory(c.dir or os.path.join(self.cfg.logging.run_dir, RUN_SUBDIR))
        return Checkpointer(directory, keep=c.keep, keep_every=c.keep_every, async_save=c.async_save)

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
        run directory is locked for the whole run (train/rundir.py): a second run on it exits."""
        cfg, t = self.cfg, self.cfg.train
        self.goodput = gp = Goodput(self._started_at)
        with claim(cfg.logging.run_dir, cfg.checkpoint.dir), committed_on_exit(self.open_checkpoints()) as saver, \
                StopSignals() as signals:  # from here on a signal stops the run cleanly, even mid-compile
            # -- setup: the data first (a bad --data is one line before the compile), then the step
            data = make_pipeline(cfg.data, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed,
                                 batch_sharding=self.batch_sharding, vocab_size=self.model_cfg.vocab_size)
            step_fn, compile_s = self._compile_checked()
            # -- resume: the checkpoint --resume picks (read whole to verify it), or a fresh start
            t0 = time.perf_counter()
            point = resume.resume_point(self.setup, self.abstract_state(), saver)
            if point and point.step >= t.steps:
                return self._nothing_to_train(point)
            state, meta, note = resume.initial_state(self.setup, self.abstract_state(), point, self.create_state, t0)
            gp.add("restore" if point or cfg.checkpoint.init_from else "compile",  # a fresh init: mostly its compile
                   time.perf_counter() - t0)
            data.seek(step := int(state.step))
            batch, _ = data.next()
            evals = data.eval_batches(t.eval_batches) if t.eval_every else []
            run = self._start_run(saver, data, point, state, compile_s, note, meta)
            # -- the loop
            stopped_by, hang_at = signals.received, injected_steps("HANG")  # a signal already: nothing to save
            try:
                with run.heartbeat, run.watchdog:
                    while step < t.steps and not stopped_by:
                        with run.profiler.step(step + 1):
                            state, metrics = step_fn(state, batch)
                        step += 1
                        run.stepped(step, metrics)
                        if step in hang_at:
                            threading.Event().wait()  # fault injection: a hang the watchdog must catch
                        stopped_by = signals.requested(step)
                        if step < t.steps and not stopped_by:
                            batch, waited = data.next()
                            run.stats.wait_s += waited
                        if step % cfg.logging.log_every == 0 or step in (1, t.steps) or stopped_by:  # 1: the starting loss
                            bad = run.record(step, metrics)
                            if t.max_bad_steps and bad >= t.max_bad_steps:
                                state = run.recover(state, step)
                        final = bool(stopped_by) or step == t.steps
                        if run.saves.due(step, force=final):
                            run.checkpoint(step, state, final)
                        if stopped_by:
                            break
                        if evals and (step % t.eval_every == 0 or step == t.steps):
                            run.evaluate(step, lambda: self.eval_loss(state.params, evals))
                    run.commit_last_save()
            finally:
                data.close()
                run.profiler.close()
            # -- summary
            return self._finish(run, data, state, point, compile_s, stopped_by)

    def _compile_checked(self):
        """-> (the step compiled from the abstract state, seconds). Compiled before any state exists,
        so that the memory check comes before the allocation that a machine too small for the model
        would not survive."""
        t0 = time.perf_counter()
        step_fn = self.compile_step(self.abstract_state(), self.abstract_batch())
        compile_s = time.perf_counter() - t0
        self.goodput.add("compile", compile_s)
        if not self.cfg.train.skip_memory_check:
            check_fits(step_fn, list(self.mesh.devices.flat), mesh_text(self.mesh.shape))
        return step_fn, compile_s

    def _nothing_to_train(self, point: resume.ResumePoint) -> dict:
        if jax.process_index() == 0:
            print(f"{point.src.step_dir(point.step)}: step {point.step} already reached --steps"
                  f" {self.cfg.train.steps}; nothing to train (raise --steps to continue)", flush=True)
        self.history, self.eval_history = [], []
        return {"steps": point.step, "resumed_from": point.step, "trained_steps": 0, "exit_code": 0}

    def _start_run(self, saver, data, point, state, compile_s, note, meta) -> _Run:
        """The run directory's files, the logger and the opening lines; -> what the loop reports to."""
        cfg = self.cfg
        with run_dir_writes(cfg.logging.run_dir):  # a full disk or a read-only directory: one line, exit 2
            if jax.process_index() == 0:
                prepare_run_dir(cfg.logging.run_dir, dump(cfg), point.step if point else None, self.goodput)
            log = MetricsLogger(cfg.logging.run_dir, cfg.train.steps, int(state.step),
                                tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress)
        for msg in warn_undersharded(self.mesh, state.params):
            log.print(f"warning: {msg}")
        peak, peak_src = peak_flops(self.compute_dtype, cfg.logging.peak_tflops, self.mesh.devices.flat)
        log.print(f"brigade: {param_count(self.model_cfg) / 1e6:.2f}M params, mesh {mesh_text(self.mesh.shape)}"
                  f" ({self.mesh.size} device{'s' * (self.mesh.size > 1)}), {self.compute_dtype} compute,"
                  f" {data.describe()}, step compiled in {compile_s:.1f}s; peak: {peak_src}")
        if note:
            recomputed = self.goodput.recomputed_steps if point else 0
            log.print(note + (f"; {recomputed} step(s) to recompute" if recomputed else ""))
        config = cfg.to_dict()
        if point:
            resume.warn_changed_settings(meta, config, data, log)
        return _Run.start(self.setup, Saves(saver, every=cfg.checkpoint.every, mesh=self.mesh, config=config,
                                            seed=cfg.train.seed, data_position=data.state),
                          log, self.goodput, int(state.step), peak, self.on_log,
                          recover_from=lambda s, at: resume.recover(self.setup, self.abstract_state(), saver, s, at, log))

    def _finish(self, run: _Run, data, state, point, compile_s: float, stopped_by: int | None) -> dict:
        """A sample, then the summary: logged, written to summary.json, returned; the final state
        and the records kept (`.state`, `.history`, `.eval_history`)."""
        t, t0 = self.cfg.train, time.perf_counter()
        tokenizer = data.tokenizer()  # None when a prepared dataset's tokenizer file no longer loads
        text = self.sample(state.params, t.prompt, t.sample_tokens, t.seed, tokenizer) \
            if t.sample_tokens and tokenizer and not stopped_by else ""
        self.goodput.add("eval", time.perf_counter() - t0)
        saved = run.saves.started
        out = summary(run.history, run.eval_history, self.goodput, model_cfg=self.model_cfg, mesh=self.mesh,
                      compile_s=compile_s, sample=text, resumed_from=point.step if point else None,
                      checkpoint=run.saves.saver.step_dir(saved) if saved is not None else None, stopped_by=stopped_by)
        run.finish(out, self.cfg.logging.run_dir)
        self.state, self.history, self.eval_history = state, run.history, run.eval_history
        return out


@dataclasses.dataclass
class _Run:
    """What the loop reports to, passed explicitly: the logger and `on_log`, the saves, the step
    timer, the goodput, the profiler, the watchdog and the peer heartbeat; and the records kept
    for the summary."""
    log: MetricsLogger
    goodput: Goodput
    on_log: Callable[[dict], None] | None
    saves: Saves
    stats: StepStats
    profiler: StepProfiler
    heartbeat: PeerHeartbeat
    watchdog: Watchdog
    recover_from: Callable  # (state, step) -> the state of the newest checkpoint that reads back
    history: list[dict] = dataclasses.field(default_factory=list)
    eval_history: list[dict] = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, run_setup: RunSetup, saves: Saves, log: MetricsLogger, goodput: Goodput, step: int, peak: float,
              on_log, recover_from) -> _Run:
        """The reporters of a loop starting after `step`; its step timer starts now."""
        cfg, t, mesh = run_setup.cfg, run_setup.cfg.train, run_setup.mesh
        heartbeat = PeerHeartbeat(timeout_s=cfg.parallelism.peer_timeout)
        stacks = os.path.join(cfg.logging.run_dir, f"watchdog-stacks.{jax.process_index()}.txt")
        return cls(log=log, goodput=goodput, on_log=on_log, saves=saves,
                   stats=StepStats(t.batch_size * t.seq_len, flops_per_token(cfg.model, t.seq_len), peak, mesh.size,
                                   step),
                   profiler=StepProfiler(cfg.profile.steps, t.steps, cfg.logging.run_dir),
                   heartbeat=heartbeat, watchdog=Watchdog(t.step_timeout, stacks, heartbeat.lost),
                   recover_from=recover_from)

    def _emit(self, rec: dict, into: list[dict]) -> None:
        self.log.log(rec)
        if self.on_log:
            self.on_log(rec)
        into.append(rec)

    def stepped(self, step: int, metrics) -> None:
        """Step `step` ran: progress for the watchdog; the profile trace stops after its window."""
        self.watchdog.beat(f"step {step}")
        traced = self.profiler.after(step, metrics)
        if traced:
            self.log.print(traced)

    def record(self, step: int, metrics: dict) -> int:
        """Log `step`'s record -> the number of non-finite steps in a row."""
        rec, bad = self.stats.record(step, jax.device_get(metrics), self.goodput)  # the only host sync in steady state
        self._emit(rec, self.history)
        self.log.advance(rec["steps_since_log"])
        if bad:
            self.log.print(f"warning: step {step}: non-finite gradients, update skipped ({bad} in a row,"
                           f" {rec['skipped_steps']} in total)")
        return bad

    def recover(self, state, step: int):
        """--train.max_bad_steps non-finite steps in a row: back to the last committed checkpoint."""
        t0 = time.perf_counter()
        with self.watchdog.waiting(f"recovery at step {step} (the last save's commit, then a restore)"):
            state = self.recover_from(state, step)
        self.goodput.add("restore", self.stats.pause(t0))
        return state

    def checkpoint(self, step: int, state, final: bool) -> None:
        """Save `step` (it is due). Blocks only for the device->host copy: the state may be donated
        by the next step right after. A state that is not finite is never saved; at the run's last
        step that is Diverged (exit 3), naming the newest committed checkpoint."""
        t0 = time.perf_counter()
        # Orbax's save() first waits for the previous save's commit: not a hang
        with self.watchdog.waiting(f"checkpoint step {step} to be handed to the saver"):
            skipped = self.saves.maybe_save(step, state, force=final)
        if skipped and final:
            raise Diverged(f"step {step}: the parameters or optimizer state are not finite (NaN or inf), so"
                           f" step {step} was not saved; {skipped}; lower --lr or raise --train.warmup_steps")
        if skipped:
            self.log.print(f"warning: step {step}: the state is not finite (NaN or inf); checkpoint skipped ({skipped})")
        self.goodput.add("checkpoint", self.stats.pause(t0))
        self.watchdog.beat(f"saving step {step}")

    def evaluate(self, step: int, eval_loss: Callable[[], float]) -> None:
        t0 = time.perf_counter()
        ev = eval_loss()
        self.goodput.add("eval", self.stats.pause(t0))
        self._emit({"step": step, "eval_loss": ev, "eval_ppl": math.exp(min(ev, 50.0))}, self.eval_history)
        self.watchdog.beat(f"eval at step {step}")

    def commit_last_save(self) -> None:
        """Wait for the last save's commit (SaveFailed if it failed) and say so."""
        saved = self.saves.started
        if saved is None:
            return
        t0 = time.perf_counter()
        with self.watchdog.waiting(f"the commit of checkpoint step {saved}"):
            self.saves.wait()
        self.goodput.add("checkpoint", time.perf_counter() - t0)
        self.log.print(f"checkpoint: step {saved} committed to {self.saves.saver.step_dir(saved)}"
                       f" (waited {time.perf_counter() - t0:.1f}s for the last save)")

    def finish(self, out: dict, run_dir: str) -> None:
        """The summary `out`: its lines logged, the sinks closed, summary.json written."""
        self.log.print(summary_text(out))
        self.log.close()
        if jax.process_index() == 0:
            with run_dir_writes(run_dir), open(os.path.join(run_dir, "summary.json"), "w") as f:
                json.dump(json_safe(out), f, indent=2, allow_nan=False)
