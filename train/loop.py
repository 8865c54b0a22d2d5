"""The training loop: the only place with I/O. Data in; metrics, eval and a sample out."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from checkpoint.layout import make_meta
from checkpoint.manager import RUN_SUBDIR, Checkpointer, open_checkpoint, shared_directory
from mesh.build import start_mesh
from mesh.spec import mesh_text
from errors import UserError
from mesh.rules import axis_rules
from mesh.shard import warn_undersharded
from models.flops import flops_per_token, param_count
from models.sample import generate
from train import optim, state as train_state
from train.config import CommConfig, Config, dump, profile_window
from train.data import make_pipeline
from train.data.tokenizers import ByteTokenizer
from train.goodput import Goodput, breakdown_text, read_records
from train.metrics import MetricsLogger, StepProfiler, drop_records_after, json_safe, peak_flops
from train.memory import check_fits
from train.resilience import Diverged, StopSignals, exit_code, injected_steps
from train.rundir import claim, run_dir_writes
from train.watchdog import PeerHeartbeat, Watchdog
from train import comm
from train.setup import abstract_batch, abstract_state, compile_step, jit_step, setup
from train.step import eval_step

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
        """ShapeDtypeStructs with shardings of this run's state (plan, restore). Traced once per
        Trainer: the resume check, the restore, NaN recovery and --init-from all ask for it."""
        if getattr(self, "_abstract_state", None) is None:
            self._abstract_state = abstract_state(self.setup)
        return self._abstract_state

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

    # -- checkpoints ------------------------------------------------------------------------
    def open_checkpoints(self) -> Checkpointer:
        """The directory this run saves into: --checkpoint.dir, else <run_dir>/checkpoints."""
        c = self.cfg.checkpoint
        directory = shared_directory(c.dir or os.path.join(self.cfg.logging.run_dir, RUN_SUBDIR))
        return Checkpointer(directory, keep=c.keep, keep_every=c.keep_every, async_save=c.async_save)

    def resume_point(self, saver: Checkpointer) -> tuple[Checkpointer, int] | None:
        """Where --resume says to continue from: (checkpoint directory, step), or None for a fresh start."""
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            if saver.all_steps():
                raise UserError(f"--resume none, but {saver.directory} already holds checkpoints (steps"
                                f" {_steps(saver.all_steps())}) that new saves would collide with; use another"
                                f" --run-dir or --checkpoint.dir, or delete them")
            return None
        if resume == "latest":
            return self._latest_intact(saver)
        src, step = open_checkpoint(resume)
        if src.directory == saver.directory:
            src = saver
        self._saved_abstract(src, step)   # a layout that cannot be converted fails before anything runs
        newer = [s for s in saver.all_steps() if s > step]
        if newer:
            raise UserError(f"--resume {resume}: step {step} is older than checkpoints already in"
                            f" {saver.directory} (steps {_steps(newer)}), which this run would collide with;"
                            f" use another --checkpoint.dir")
        return src, step

    def _saved_abstract(self, src: Checkpointer, step: int) -> train_state.TrainState:
        """The abstract state (on this mesh) that `step` was saved as. Its --comm settings may give
        another layout than this run's (error-feedback residuals or none, clipping in the optimizer
        chain or before the sync), and its residuals may hold another data-parallel replica count
        (a resume onto another mesh). Those `_convert` bridges; a switch to or from DiLoCo, or
        DiLoCo's per-replica state onto another replica count, is refused in one line naming why."""
        saved = src.meta(step).get("config", {}).get("comm")
        names = {f.name for f in dataclasses.fields(CommConfig)}
        sync, local_clip = (comm.sync_layout(CommConfig(**{k: v for k, v in saved.items() if k in names}),
                                             self.setup.dp_axes, self.cfg.train.grad_clip)
                            if isinstance(saved, dict) else (self.sync, self.local_clip))
        (n_saved, diloco), n_now = self._saved_replicas(src, step), self.sync.replicas(self.mesh)
        resized = n_saved is not None and n_saved != n_now
        layout = lambda sync, clip: (sync.error_feedback, sync.outer_tx is not None, clip > 0)  # noqa: E731
        if layout(sync, local_clip) == layout(self.sync, self.local_clip) and not resized:
            return self.abstract_state()
        if diloco != (self.sync.outer_tx is not None) or (resized and diloco):
            now = self.cfg.to_dict()["comm"]
            opts = ("compression", "error_feedback", "sync_every")
            text = lambda m: " ".join(f"--comm.{k} {m.get(k)}" for k in opts)  # noqa: E731
            why = (f"DiLoCo's per-replica state (optimizer states and drift of {n_saved} data-parallel replicas)"
                   f" does not convert to this mesh's {n_now}" if diloco and resized else
                   f"DiLoCo's train state (per-replica optimizer states and drift) does not convert to or from"
                   f" this run's ({text(now)})")
            raise UserError(f"checkpoint {src.step_dir(step)} was written with {text(saved or {})}: {why};"
                            f" resume with its settings and data-parallel size, or start a new --run-dir")
        tx = optim.make(self.cfg.train, clip=not local_clip)
        out = train_state.abstract(self.model_cfg, tx, self.mesh, self.rules, sync)
        if n_saved is not None and (resized or out.residual is None):  # replicated here; `_convert` averages
            out = out.replace(residual=jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct((n_saved, *a.shape), jnp.float32,
                                                   sharding=NamedSharding(self.mesh, jax.P(None, *sh.spec))),
                self.abstract_state().params, self.state_shardings.params))
        return out

    @staticmethod
    def _saved_replicas(src: Checkpointer, step: int) -> tuple[int | None, bool]:
        """(the data-parallel replica count of the step's per-replica state: the leading dim of its
        residuals or DiLoCo drift, None when it has none; whether it is DiLoCo's), from metadata."""
        arrays = [(name, shape) for name, shape, _ in src.arrays(step) if name.startswith(("residual/", "drift/"))]
        dims = {shape[0] for _, shape in arrays if shape}
        return (dims.pop() if len(dims) == 1 else None), any(n.startswith("drift/") for n, _ in arrays)

    def _convert(self, state: train_state.TrainState) -> tuple[train_state.TrainState, str]:
        """A state restored in another --comm layout -> this run's, and what changed ("" if nothing).
        The optimizer chain differs only in where clipping sits, which holds no arrays, so its
        leaves carry over in order; residuals start at zero (nothing pending) or are dropped (up to
        a step's worth of unsent gradient, which a change of compression forgoes anyway). Residuals
        of another replica count are averaged and given to every replica: the sync adds the mean of
        the replicas' residuals, so what is pending stays the same."""
        want = self.abstract_state()
        opt_leaves = jax.tree.leaves(state.opt_state)
        if [x.shape for x in opt_leaves] != [x.shape for x in jax.tree.leaves(want.opt_state)]:
            raise UserError("the checkpoint's optimizer state does not match this run's (another optimizer setting)")
        out = state.replace(opt_state=jax.tree.unflatten(jax.tree.structure(want.opt_state), opt_leaves))
        if state.residual is None and want.residual is None:
            return out, ""
        if want.residual is None:
            return out.replace(residual=None), "error-feedback residuals dropped"
        if state.residual is None:
            zeros = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), want.residual),
                            out_shardings=self.state_shardings.residual)()
            return out.replace(residual=zeros), "error-feedback residuals start at zero"
        n_old, n_new = jax.tree.leaves(state.residual)[0].shape[0], jax.tree.leaves(want.residual)[0].shape[0]
        mean = jax.jit(lambda r: jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), (n_new, *x.shape[1:])), r),
                       out_shardings=self.state_shardings.residual)
        return (out.replace(residual=mean(state.residual)),
                f"error-feedback residuals of {n_old} data-parallel replicas averaged onto this mesh's {n_new}")

    def _read(self, src: Checkpointer, step: int) -> tuple[train_state.TrainState, dict]:
        """`step` restored onto this mesh and converted to this run's --comm layout; the meta gets
        `converted`, a note for the log, when a conversion changed something."""
        abstract = self._saved_abstract(src, step)
        state, meta = src.restore(step, abstract)
        if abstract is not self.abstract_state():
            state, meta["converted"] = self._convert(state)
        return state, meta

    def restore(self, src: Checkpointer, step: int) -> tuple[train_state.TrainState, dict]:
        """The saved state, read straight into this trainer's mesh and shardings. A step that is
        unreadable (missing, truncated or corrupt files) raises UnreadableCheckpoint, a UserError
        naming the step directory and the file."""
        done = getattr(self, "_verified", None)  # read already by resume_point's check
        if done is not None and done[0] is src and done[1] == step:
            self._verified = None
            return done[2], done[3]
        return self._read(src, step)

    def _latest_intact(self, saver: Checkpointer) -> tuple[Checkpointer, int] | None:
        """--resume latest: the newest committed step that reads back completely. Unreadable newer
        steps are reported (one line each) and, once an intact one is found, renamed to
        `<step>.unreadable` so that this run can save those steps again; nothing is deleted. None
        when the directory holds no committed step; UserError when it holds only unreadable ones
        (starting from scratch would silently throw away the run's progress)."""
        from checkpoint.manager import UnreadableCheckpoint
        is_main = jax.process_index() == 0
        bad: list[tuple[int, UnreadableCheckpoint]] = []
        for step in sorted(saver.all_steps(), reverse=True):
            try:
                if step >= self.cfg.train.steps:  # nothing to train: the metadata suffices
                    saver.check_files(step)
                    saver.arrays(step)
                    saver.meta(step)
                else:  # read it all (the only way to find truncated array data); restore() reuses it
                    self._verified = (saver, step, *self._read(saver, step))
            except UnreadableCheckpoint as e:
                if is_main:
                    print(f"warning: {e}; trying the previous checkpoint", flush=True)
                bad.append((step, e))
                continue
            for s, _ in bad:
                moved = saver.set_aside(s)
                if is_main:
                    print(f"warning: unreadable step {s} set aside as {moved} (nothing deleted);"
                          f" resuming from step {step}", flush=True)
            return saver, step
        if bad:
            raise UserError(f"no intact checkpoint in {saver.directory}: " + "; ".join(
                f"step {s}: {e.file or 'see above'}: {e.reason}" for s, e in bad)
                + " (nothing was deleted; to start fresh, move them aside or use another --checkpoint.dir;"
                " to read one anyway, --resume PATH shows its error)")
        return None

    def _recover(self, saver: Checkpointer, state, step: int, log) -> train_state.TrainState:
        """--train.max_bad_steps non-finite steps in a row: reload the last committed checkpoint.

        The state keeps the current step number, so training skips the data window that led here
        (batches are a function of the step; replaying them would likely diverge again) and the
        schedule continues where it was."""
        from checkpoint.manager import UnreadableCheckpoint
        saver.wait()
        for last in sorted(saver.all_steps(), reverse=True):  # the newest step that reads back
            try:
                restored, _ = self.restore(saver, last)
                break
            except UnreadableCheckpoint as e:
                log.print(f"warning: {e}; trying the previous checkpoint")
        else:
            raise Diverged(f"{self.cfg.train.max_bad_steps} non-finite steps in a row at step {step} and no"
                           f" checkpoint to restore in {saver.directory}"
                           + (" that reads back" if saver.all_steps() else ""))
        log.print(f"recovery: {self.cfg.train.max_bad_steps} non-finite steps in a row at step {step}; restored"
                  f" the weights of step {last} from {saver.step_dir(last)} and skipped batches {last + 1}-{step}")
        return restored.replace(step=state.step)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to --steps, saving checkpoints; resume first if --resume finds one. The summary's
        `exit_code` is 0, or 128 + the signal number when SIGTERM/SIGINT stopped the run. The
        run directory is locked for the whole run (train/rundir.py): a second run on it exits."""
        with claim(self.cfg.logging.run_dir, self.cfg.checkpoint.dir):
            saver = self.open_checkpoints()
            failed = True
            try:
                with StopSignals() as signals:  # from here on a signal stops the run cleanly, even mid-compile
                    summary = self._fit(saver, signals)
                failed = False
                return summary
            finally:
                try:
                    saver.close()  # every save in flight is committed before fit() returns
                except Exception as e:  # noqa: BLE001
                    if not failed:  # else the error already on its way out says more
                        raise SaveFailed(saver, saver.latest_step() or 0, e) from None

    def _fit(self, saver: Checkpointer, signals: StopSignals) -> dict:
        cfg, t = self.cfg, self.cfg.train
        gp = self.goodput = Goodput(self._started_at)
        run_dir = cfg.logging.run_dir
        is_main = jax.process_index() == 0
        # Opened first: a bad --data is one line before the compile; it seeks to the resume point below.
        data = make_pipeline(cfg.data, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed,
                             batch_sharding=self.batch_sharding, vocab_size=self.model_cfg.vocab_size)
        t0 = time.perf_counter()
        # Compiled from the abstract state, before any state exists: the memory check below comes
        # before the allocation that a machine too small for the model would not survive.
        step_fn = self.compile_step(self.abstract_state(), self.abstract_batch())
        compile_s = time.perf_counter() - t0
        gp.add("compile", compile_s)
        if not t.skip_memory_check:
            check_fits(step_fn, list(self.mesh.devices.flat), mesh_text(self.mesh.shape))
        t0 = time.perf_counter()
        point = self.resume_point(saver)  # reads (and so verifies) the checkpoint it picks
        if point and point[1] >= t.steps:
            src, step = point
            src.check_compatible(step, self._saved_abstract(src, step))
            if is_main:
                print(f"{src.step_dir(step)}: step {step} already reached --steps {t.steps}; nothing to train"
                      f" (raise --steps to continue)", flush=True)
            self.history, self.eval_history = [], []
            return {"steps": step, "resumed_from": step, "trained_steps": 0, "exit_code": 0}
        state, meta, note = self._initial_state(point, t0)
        data.seek(int(state.step))
        self._data = data  # its state(step) goes into every checkpoint's meta
        step = int(state.step)
        with run_dir_writes(run_dir):  # a full disk or a read-only directory: one line, exit 2
            if is_main:
                self._prepare_run_dir(point[1] if point else None)
            log = MetricsLogger(run_dir, t.steps, step, tensorboard=cfg.logging.tensorboard,
                                progress=cfg.logging.progress)
        for msg in warn_undersharded(self.mesh, state.params):
            log.print(f"warning: {msg}")
        batch, _ = data.next()

        peak, peak_src = peak_flops(self.compute_dtype, cfg.logging.peak_tflops, self.mesh.devices.flat)
        log.print(f"brigade: {param_count(self.model_cfg) / 1e6:.2f}M params, mesh {mesh_text(self.mesh.shape)}"
                  f" ({self.mesh.size} device{'s' * (self.mesh.size > 1)}), {self.compute_dtype} compute, {data.describe()},"
                  f" step compiled in {compile_s:.1f}s; peak: {peak_src}")
        if note:
            log.print(note + (f"; {gp.recomputed_steps} step(s) to recompute" if point and gp.recomputed_steps else ""))
        if point:
            self._warn_changed_settings(meta, data, log)

        evals = data.eval_batches(t.eval_batches) if t.eval_every else []

        stats = _StepStats(t.batch_size * t.seq_len, flops_per_token(self.model_cfg, t.seq_len), peak,
                           self.mesh.size, step)
        history, eval_history = [], []
        saved, stopped_by = None, signals.received  # a signal before the first step: nothing new to save
        hang_at = injected_steps("HANG")
        profiler = StepProfiler(profile_window(cfg.profile.steps, t.steps), run_dir)
        heartbeat = PeerHeartbeat(timeout_s=cfg.parallelism.peer_timeout)
        watchdog = Watchdog(t.step_timeout, os.path.join(run_dir, f"watchdog-stacks.{jax.process_index()}.txt"),
                            heartbeat.lost)
        try:
            with heartbeat, watchdog:
                while step < t.steps and not stopped_by:
                    with profiler.step(step + 1):
                        state, metrics = step_fn(state, batch)
                    step += 1
                    watchdog.beat(f"step {step}")
                    if profiler.after(step, metrics):
                        log.print(f"profile: steps {cfg.profile.steps} traced into {profiler.dir}"
                                  f" (tensorboard --logdir {profiler.dir}, or open the .trace.json.gz in ui.perfetto.dev)")
                    if step in hang_at:
                        threading.Event().wait()  # fault injection: a hang the watchdog must catch
                    stopped_by = signals.requested(step)
                    if step < t.steps and not stopped_by:
                        batch, waited = data.next()
                        stats.wait_s += waited
                    if step % cfg.logging.log_every == 0 or step in (1, t.steps) or stopped_by:  # 1: the starting loss
                        rec, bad = stats.record(step, jax.device_get(metrics), gp)  # the only host sync in steady state
                        log.log(rec)
                        if self.on_log:
                            self.on_log(rec)
                        log.advance(rec["steps_since_log"])
                        history.append(rec)
                        if bad:
                            log.print(f"warning: step {step}: non-finite gradients, update skipped ({bad} in a row,"
                                      f" {rec['skipped_steps']} in total)")
                        if t.max_bad_steps and bad >= t.max_bad_steps:
                            t0 = time.perf_counter()
                            with watchdog.waiting(f"recovery at step {step} (the last save's commit, then a restore)"):
                                state = self._recover(saver, state, step, log)
                            gp.add("restore", stats.pause(t0))
                    if stopped_by or step == t.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                        # blocks only for the device->host copy; the state may be donated by the next step right after
                        t0 = time.perf_counter()
                        # Orbax's save() first waits for the previous save's commit: not a hang
                        with watchdog.waiting(f"checkpoint step {step} to be handed to the saver"):
                            started = self._save_if_finite(saver, step, state, log,
                                                           final=bool(stopped_by) or step == t.steps)
                        if started:
                            saved = step
                        gp.add("checkpoint", stats.pause(t0))
                        watchdog.beat(f"saving step {step}")
                    if stopped_by:
                        break
                    if evals and (step % t.eval_every == 0 or step == t.steps):
                        t0 = time.perf_counter()
                        ev = self.eval_loss(state.params, evals)
                        gp.add("eval", stats.pause(t0))
                        rec = {"step": step, "eval_loss": ev, "eval_ppl": math.exp(min(ev, 50.0))}
                        log.log(rec)
                        if self.on_log:
                            self.on_log(rec)
                        eval_history.append(rec)
                        watchdog.beat(f"eval at step {step}")
                if saved is not None:
                    t0 = time.perf_counter()
                    with watchdog.waiting(f"the commit of checkpoint step {saved}"):
                        self._wait(saver, saved)
                    gp.add("checkpoint", time.perf_counter() - t0)
                    log.print(f"checkpoint: step {saved} committed to {saver.step_dir(saved)}"
                              f" (waited {time.perf_counter() - t0:.1f}s for the last save)")
        finally:
            data.close()
            profiler.close()

        t0 = time.perf_counter()
        tokenizer = data.tokenizer()  # None when a prepared dataset's tokenizer file no longer loads
        text = self.sample(state.params, t.prompt, t.sample_tokens, t.seed, tokenizer) \
            if t.sample_tokens and tokenizer and not stopped_by else ""
        gp.add("eval", time.perf_counter() - t0)
        summary = self._summary(history, eval_history, compile_s, text, point, saver, saved, stopped_by)
        log.print(_summary_text(summary))
        log.close()
        if is_main:
            with run_dir_writes(run_dir), open(os.path.join(run_dir, "summary.json"), "w") as f:
                json.dump(json_safe(summary), f, indent=2, allow_nan=False)
        self.state = state
        self.history, self.eval_history = history, eval_history
        return summary

    def _initial_state(self, point: tuple[Checkpointer, int] | None, t0: float) -> tuple[train_state.TrainState, dict, str]:
        """The state this run starts from -> (state, the checkpoint's meta or {}, a line to log or
        ""): the resume point's, --init-from's parameters with a fresh optimizer, or a fresh init.
        `t0`: when the search for the resume point began (it reads the checkpoint it picks)."""
        gp = self.goodput
        if point:
            state, meta = self.restore(*point)
            gp.add("restore", time.perf_counter() - t0)
            return state, meta, (f"resumed from {point[0].step_dir(point[1])} (step {point[1]}, saved on mesh"
                                 f" {mesh_text(meta.get('mesh', {}))}) in {time.perf_counter() - t0:.1f}s"
                                 + (f"; converted to this run's --comm settings: {meta['converted']}"
                                    if meta.get("converted") else ""))
        if self.cfg.checkpoint.init_from:  # only a fresh run: a restarted fine-tune resumes from its own saves
            state, note = self.init_from(self.cfg.checkpoint.init_from)
            gp.add("restore", time.perf_counter() - t0)
            return state, {}, note
        state = self.create_state()
        gp.add("compile", time.perf_counter() - t0)  # mostly compiling the sharded init
        return state, {}, ""

    def _warn_changed_settings(self, meta: dict, data, log: MetricsLogger) -> None:
        """One warning line listing the settings (and data sources) that differ from the checkpoint's."""
        changed = _changed_settings(meta.get("config", {}), self.cfg.to_dict())
        if "loader" in meta.get("data", {}):  # the data itself (sources, windows) as well as the settings
            changed = list(dict.fromkeys(changed + data.check_state(meta["data"]["loader"])))
        if changed:
            log.print(f"warning: resuming with settings that differ from the checkpoint's: {', '.join(changed)}"
                      + (" (the learning-rate schedule spans train.steps)" if any(
                          c.startswith("train.steps ") for c in changed) else ""))

    def init_from(self, path: str) -> tuple[train_state.TrainState, str]:
        """--init-from PATH: step 0 with a fresh optimizer around the parameters of a checkpoint (full
        or parameters-only, e.g. `python -m models.hf import`), read straight into this mesh's shardings."""
        src, step = open_checkpoint(path)
        hint = os.path.join(path, "model.yaml")
        try:
            params = src.restore_params(step, self.abstract_state().params)
        except UserError as e:
            if os.path.exists(hint) and "does not match" in str(e):
                raise UserError(f"{e} (the model config it was made with: --config {hint})") from None
            raise
        state = train_state.from_params(self.model_cfg, self.tx, self.mesh, self.rules, params, self.sync)
        return state, f"initialised the parameters from {src.step_dir(step)} (fresh optimizer)"

    def _prepare_run_dir(self, resumed_step: int | None) -> None:
        """config.json, and metrics.jsonl trimmed to what the resumed checkpoint covers (the goodput
        of the attempt that died carries over from it)."""
        run_dir = self.cfg.logging.run_dir
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(dump(self.cfg))
        resumes = os.path.join(run_dir, "resumes.jsonl")   # one line per attempt that resumed
        if resumed_step is not None:
            with open(resumes, "a") as f:
                f.write(json.dumps({"step": resumed_step, "time": self.goodput.started_at}) + "\n")
            with open(resumes) as f:
                n_resumes = sum(1 for ln in f if ln.strip())
            self.goodput.resume(read_records(run_dir), resumed_step, restarts=n_resumes)
            drop_records_after(run_dir, resumed_step)  # logged after that save by the run that died
        else:  # a fresh run starts a fresh log
            for path in (os.path.join(run_dir, "metrics.jsonl"), resumes):
                if os.path.exists(path):
                    os.remove(path)

    @functools.cached_property
    def _state_is_finite(self):
        def finite(state) -> jax.Array:
            leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
            return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
        return jax.jit(finite)

    def _save_if_finite(self, saver: Checkpointer, step: int, state, log, final: bool) -> bool:
        """Save `step` unless its state holds a NaN or an infinity (a checkpoint must always be a
        safe place to resume from) -> whether a save started. Non-finite at the run's last step:
        Diverged (exit 3), naming the newest committed checkpoint."""
        with jax.set_mesh(self.mesh):
            if bool(self._state_is_finite(state)):
                self._save(saver, step, state)
                return True
        saver.wait()
        last = saver.latest_step()
        where = f"the newest committed checkpoint is {saver.step_dir(last)}" if last is not None else "no checkpoint"
        if final:
            raise Diverged(f"step {step}: the parameters or optimizer state are not finite (NaN or inf), so"
                           f" step {step} was not saved; {where}; lower --lr or raise --train.warmup_steps")
        log.print(f"warning: step {step}: the state is not finite (NaN or inf); checkpoint skipped ({where})")
        return False

    def _save(self, saver: Checkpointer, step: int, state) -> None:
        """Start saving `step`. An asynchronous save that failed in the background (full disk,
        permissions, storage gone) surfaces here or in `_wait`, as one SaveFailed line."""
        try:
            meta = make_meta(step, self.cfg.to_dict(), self.mesh, self.cfg.train.seed)
            meta["data"]["loader"] = self._data.state(step)  # checked by Pipeline.check_state on resume
            saver.save(step, state, meta)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (whatever Orbax/tensorstore raise for a failed write)
            raise SaveFailed(saver, step, e) from None

    def _wait(self, saver: Checkpointer, step: int) -> None:
        try:
            saver.wait()
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001
            raise SaveFailed(saver, step, e) from None

    def _summary(self, history, eval_history, compile_s, text, point, saver, saved, stopped_by) -> dict:
        steady = history[1:] or history
        times = self.goodput.totals()
        return {
            "steps": history[-1]["step"] if history else (point[1] if point else 0),
            "final_loss": history[-1]["loss"] if history else None,
            "first_loss": history[0]["loss"] if history else None,
            "eval_loss": eval_history[-1]["eval_loss"] if eval_history else None,
            "tokens_per_sec": float(np.median([r["tokens_per_sec"] for r in steady])) if steady else 0.0,
            "mfu": float(np.median([r["mfu"] for r in steady])) if steady else 0.0,
            "compile_s": compile_s, "wall_s": time.time() - self.goodput.started_at,
            "params": param_count(self.model_cfg), "mesh": mesh_text(self.mesh.shape), "sample": text,
            "resumed_from": point[1] if point else None,
            "checkpoint": saver.step_dir(saved) if saved is not None else None,
            "stopped_by": signal.Signals(stopped_by).name if stopped_by else None,
            "exit_code": exit_code(stopped_by),
            **times,
        }


class _StepStats:
    """Step time, throughput and MFU between logged steps. Time the loop spends on saves, evals
    and recovery (`pause`) is not step time."""

    _KNOWN = ("loss", "grad_norm", "lr", "skipped_steps", "bad_in_a_row")

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float, n_devices: int, step: int):
        self.tokens, self.flops = tokens_per_step, flops_per_token * tokens_per_step
        self.peak, self.n_devices = peak, n_devices
        self.last_step, self.t_last, self.paused_s, self.wait_s = step, time.perf_counter(), 0.0, 0.0

    def pause(self, since: float) -> float:
        """Count the time since `since` as not-stepping; -> its length."""
        dt = time.perf_counter() - since
        self.paused_s += dt
        return dt

    def record(self, step: int, m: dict, gp: Goodput) -> tuple[dict, int]:
        """The metrics.jsonl record for `step` from the fetched step metrics `m`, and the number
        of non-finite steps in a row."""
        now = time.perf_counter()
        n = step - self.last_step
        busy = max(now - self.t_last - self.paused_s, 1e-9)
        gp.add("productive", busy - self.wait_s)
        gp.add("data_wait", self.wait_s)
        dt = busy / n
        rec = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]),
               "step_time_s": dt, "tokens_per_sec": self.tokens / dt,
               "tokens_per_sec_per_device": self.tokens / dt / self.n_devices,
               "mfu": self.flops / dt / self.peak if self.peak else 0.0, "data_wait_s": self.wait_s / n,
               "skipped_steps": int(m["skipped_steps"]), "steps_since_log": n}
        # whatever else the step reports (e.g. MoE load balance): scalars, logged as they are
        rec.update({k: float(v) for k, v in m.items() if k not in self._KNOWN and np.ndim(v) == 0})
        rec.update(gp.totals())
        self.last_step, self.t_last, self.paused_s, self.wait_s = step, time.perf_counter(), 0.0, 0.0
        return rec, int(m["bad_in_a_row"])


class SaveFailed(UserError):
    """Writing a checkpoint failed (disk full, permissions, storage gone). Orbax writes a step under
    `<step>.orbax-checkpoint-tmp` and renames it only when complete, so committed steps are untouched."""

    exit_now = True  # the CLI exits at once: the failed save's writes still in flight would print noise

    def __init__(self, saver: Checkpointer, step: int, err: Exception):
        kept = saver.all_steps()
        tmp = re.search(r"/(\d+)\.orbax-checkpoint-tmp", str(err))
        step = int(tmp.group(1)) if tmp else step  # a background save fails a step later than it started
        super().__init__(f"checkpoint: saving step {step} to {saver.directory} failed ({_write_error(err)});"
                         f" committed checkpoints are intact (steps {_steps(kept) if kept else 'none'});"
                         f" free space or fix the directory, then run the same command again to resume")


def _write_error(err: Exception) -> str:
    """The OS reason and file of a failed write: OSError, or tensorstore's ValueError text."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f": {err.filename}" if err.filename else "")
    text = str(err)
    m = re.search(r'Failed to write \d+ bytes to file \d+: ([^\[]+?) \[os_error_code', text) \
        or re.search(r': ([A-Z][a-z][^:\[]+?) \[os_error_code', text)
    reason = m.group(1).strip() if m else (text.strip().splitlines() or [type(err).__name__])[0][:200]
    f = re.search(r'Failed writing: "([^"]+)"', text)
    return reason + (f": {f.group(1)}" if f else "")


# Settings that change what a resumed run computes (the rest, e.g. eval or logging, do not).
_RESUME_SENSITIVE = {"train": ("steps", "batch_size", "seq_len", "micro_batches", "lr", "min_lr_ratio", "warmup_steps",
                               "weight_decay", "decay_embeddings", "b1", "b2", "eps", "grad_clip", "seed"),
                     "data": ("source", "eval_fraction", "packing", "packing_mask"),
                     "comm": ("compression", "topk_fraction", "error_feedback", "sync_every", "outer_lr", "outer_momentum")}


def _changed_settings(saved: dict, now: dict) -> list[str]:
    """'section.field old -> new' for every resume-sensitive setting that changed: the listed train,
    data and comm fields, and every field of the model section (a changed param_dtype casts the
    restored parameters, a changed rope_theta or router changes what they compute)."""
    keys = {**_RESUME_SENSITIVE, "model": tuple(now.get("model", {}))}
    out = [f"{sec}.{k} {saved[sec][k]} -> {now[sec][k]}" for sec, names in keys.items() for k in names
           if isinstance(saved.get(sec), dict) and k in saved[sec] and saved[sec][k] != now[sec][k]]
    return [c + (" (the restored parameters are cast)" if c.startswith("model.param_dtype ") else "") for c in out]


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")


def _summary_text(s: dict) -> str:
    if s["stopped_by"]:
        head = (f"stopped by {s['stopped_by']} after step {s['steps']}"
                + (f", checkpoint {s['checkpoint']} committed" if s["checkpoint"] else "")
                + f"; exit status {s['exit_code']}")
        if s["first_loss"] is None:
            return head
        return head + f"\nloss {s['first_loss']:.3f} -> {s['final_loss']:.3f} in {s['wall_s']:.1f}s"
    lines = [f"done: {s['steps']} steps in {s['wall_s']:.1f}s (compile {s['compile_s']:.1f}s),"
             f" loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}"
             + (f", eval loss {s['eval_loss']:.3f}" if s["eval_loss"] is not None else "")
             + f", {s['tokens_per_sec']:.0f} tokens/s, MFU {100 * s['mfu']:.1f}%", breakdown_text(s)]
    if s["sample"]:
        lines += ["--- sample ---", s["sample"], "--------------"]
    return "\n".join(lines)
