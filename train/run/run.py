"""What the training loop reports to while it runs (train/run/loop.py builds one per run): the
logger and the sinks, the step timer and its split (compute, data wait, host), memory, the
straggler check, the loss-spike and non-finite warnings, recovery, saves, evals, the summary
files; and the fault injections that drills act out."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Callable

import jax

from checkpoint import storage
from checkpoint.saving import Saves
from mesh import expert_layout
from mesh.devices import peak_flops
from mesh.shard import warn_undersharded
from mesh.spec import mesh_text
from models import context, model
from models.flops import flops_per_token, param_count
from train.core.config import dump
from train.core.setup import RunSetup
from train.core.shapes import seq_shards
from train.run import checkpoint_match, elastic, faults, resume
from train.run.device_memory import MEMORY_FIELDS, figures
from train.run.goodput import Goodput
from train.run.metrics import (
    MetricsLogger,
    StepProfiler,
    StepStats,
    json_safe,
    summary_text,
)
from train.run.resilience import Diverged
from train.run.rundir import prepare_run_dir, run_dir_writes
from train.run.stragglers import Stragglers
from train.run.watchdog import PeerHeartbeat, Watchdog


@dataclasses.dataclass
class Run:
    """What the loop reports to, passed explicitly: the logger and `on_log`, the saves, the step
    timer, the goodput, the profiler, the watchdog, the peer heartbeat and the straggler check;
    the records kept for the summary; the spike count last reported; the injected faults."""

    log: MetricsLogger
    goodput: Goodput
    on_log: Callable[[dict], None] | None
    saves: Saves
    stats: StepStats
    profiler: StepProfiler
    heartbeat: PeerHeartbeat
    watchdog: Watchdog
    stragglers: Stragglers
    devices: list  # this process's devices, whose memory is logged
    recover_from: Callable  # (state, step) -> the state of the newest checkpoint that reads back
    spikes_reported: int = 0
    delay_s: float = 0.0  # BRIGADE_INJECT_STEP_DELAY: this process sleeps this long after each step
    spike_at: set[int] = dataclasses.field(default_factory=set)  # BRIGADE_INJECT_SPIKE_STEPS
    spike_target: int = 0  # the token id every target of an injected spike's batch becomes
    # in every record: the mesh and an elastic job's counts (train/run/elastic.py record_fields)
    fields: dict = dataclasses.field(default_factory=dict)
    history: list[dict] = dataclasses.field(default_factory=list)
    eval_history: list[dict] = dataclasses.field(default_factory=list)

    @classmethod
    def start(
        cls,
        run_setup: RunSetup,
        saves: Saves,
        log: MetricsLogger,
        goodput: Goodput,
        state,
        peak: float,
        on_log,
        recover_from,
    ) -> Run:
        """The reporters of a loop starting from `state`; its step timer starts now."""
        cfg, t, mesh, me = run_setup.cfg, run_setup.cfg.train, run_setup.mesh, jax.process_index()
        heartbeat = PeerHeartbeat(timeout_s=cfg.parallelism.peer_timeout)
        # faulthandler writes the stacks through a real file descriptor: a URL run dir gets them
        # locally
        stacks = os.path.join(
            cfg.logging.run_dir if storage.is_local(cfg.logging.run_dir) else tempfile.gettempdir(),
            f"watchdog-stacks.{me}.txt",
        )
        return cls(
            log=log,
            goodput=goodput,
            on_log=on_log,
            saves=saves,
            stats=StepStats(
                # a preference step's rows are pairs: two sequences each; grpo's G per prompt
                t.batch_size
                * t.seq_len
                * (2 if cfg.post.preference else cfg.post.group_size if cfg.post.grpo else 1),
                # a reference's forward adds a third of a trained token's FLOPs
                flops_per_token(cfg.model, t.seq_len) * (4 / 3 if cfg.post.needs_reference else 1),
                peak,
                mesh.size,
                int(state.step),
            ),
            profiler=StepProfiler(cfg.profile.steps, t.steps, cfg.logging.run_dir),
            heartbeat=heartbeat,
            watchdog=Watchdog(t.step_timeout, stacks, heartbeat.lost),
            stragglers=Stragglers(cfg.logging.straggler_threshold, me, jax.process_count()),
            devices=[d for d in mesh.devices.flat if d.process_index == me],
            recover_from=recover_from,
            spikes_reported=int(state.spike.skipped) if state.spike is not None else 0,
            delay_s=faults.current().delay_s(me),
            spike_at=faults.current().spike_steps,
            spike_target=cfg.model.vocab_size - 1,
            fields=elastic.record_fields(cfg, mesh),
        )

    def step(self, step_fn, state, batch, step: int):
        """Run step `step` (1-based) -> (state, metrics), timing how long the host blocks in it."""
        # fault injection: a corrupt batch, every target the last token id
        if step in self.spike_at:
            batch = {**batch, "targets": batch["targets"] * 0 + self.spike_target}
        t0 = time.perf_counter()
        with self.profiler.step(step):
            out = step_fn(state, batch)
        self.stats.device_s += time.perf_counter() - t0
        if self.delay_s:
            time.sleep(self.delay_s)  # fault injection: a straggler's slow host
        return out

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
        """Log `step`'s record, with this process's memory and (process 0) the straggler figures
        -> the updates skipped in a row (non-finite gradients or loss spikes)."""
        t0 = time.perf_counter()
        fetched = jax.device_get(metrics)  # the only host sync in steady state
        self.stats.device_s += time.perf_counter() - t0
        rec, bad, spikes = self.stats.record(step, fetched, self.goodput)
        memory = figures(self.devices)
        # absent: no counters
        rec.update({k: memory[k] for k in MEMORY_FIELDS if memory[k] is not None})
        fields, straggler = self.stragglers.observe(step, rec)
        rec.update(fields)
        rec.update(self.fields)
        self._emit(rec, self.history)
        self.log.advance(rec["steps_since_log"])
        if bad:
            self.log.print(
                f"warning: step {step}: non-finite gradients, update skipped ({bad} in a row,"
                f" {rec['skipped_steps']} in total)"
            )
        total = rec.get("spike_skipped_steps", 0)
        if total > self.spikes_reported:
            new, self.spikes_reported, median = (
                total - self.spikes_reported,
                total,
                rec["loss_running_median"],
            )
            self.log.print(
                f"warning: step {step}: {new} update(s) skipped since the last log as loss spikes"
                f" (loss above --train.spike_factor x the running median {median:.3f}; {spikes} in"
                f" a row, {total} in total)"
            )
        if straggler:
            self.log.print(straggler)
        return bad + spikes

    def recover(self, state, step: int):
        """--train.max_bad_steps skipped steps in a row: back to the last committed checkpoint
        (its spike count too, from which the next spike warning counts)."""
        t0 = time.perf_counter()
        with self.watchdog.waiting(
            f"recovery at step {step} (the last save's commit, then a restore)"
        ):
            state = self.recover_from(state, step)
        self.goodput.add("restore", self.stats.pause(t0))
        self.spikes_reported = int(state.spike.skipped) if state.spike is not None else 0
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
            raise Diverged(
                f"step {step}: the parameters or optimizer state are not finite (NaN or inf), so"
                f" step {step} was not saved; {skipped}; lower --lr or raise --train.warmup_steps"
            )
        if skipped:
            self.log.print(
                f"warning: step {step}: the state is not finite (NaN or inf); checkpoint skipped"
                f" ({skipped})"
            )
        self.goodput.add("checkpoint", self.stats.pause(t0))
        self.watchdog.beat(f"saving step {step}")

    def evaluate(
        self, step: int, eval_losses: Callable[[], tuple[float | None, dict, dict]]
    ) -> None:
        """Log the eval record of `step`: `eval_losses()` -> (the loss on the training data's
        held-out batches, or None when it holds none out; the loss on each --data.eval_source set,
        by name; a post-training objective's held-out figures, `eval/NAME`)."""
        t0 = time.perf_counter()
        ev, sets, figures = eval_losses()
        self.goodput.add("eval", self.stats.pause(t0))
        self._emit({**eval_record(step, ev, sets), **figures}, self.eval_history)
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
        self.log.print(
            f"checkpoint: step {saved} committed to {self.saves.saver.step_dir(saved)}"
            f" (waited {time.perf_counter() - t0:.1f}s for the last save)"
        )

    def finish(self, out: dict, run_dir: str) -> None:
        """The summary `out`: its lines logged, the sinks closed, summary.json written."""
        self.log.print(summary_text(out))
        self.log.close()
        if jax.process_index() == 0:
            with run_dir_writes(run_dir):
                storage.write_text(
                    storage.join(run_dir, "summary.json"),
                    json.dumps(json_safe(out), indent=2, allow_nan=False),
                )


def perplexity(loss: float) -> float:
    # capped: an untrained model's perplexity would flatten every plot
    return math.exp(min(loss, 50.0))


def eval_record(step: int, loss: float | None, sets: dict[str, float]) -> dict:
    """The metrics record of an eval: `eval_loss`/`eval_ppl` (the training data's held-out split)
    and `eval/NAME/loss`/`eval/NAME/perplexity` per --data.eval_source set."""
    rec: dict = {"step": step}
    if loss is not None:
        rec.update(eval_loss=loss, eval_ppl=perplexity(loss))
    for name, value in sets.items():
        rec.update({f"eval/{name}/loss": value, f"eval/{name}/perplexity": perplexity(value)})
    return rec


def attention(s: RunSetup) -> str:
    """What attention the run's step does at its sequence length (models/config.attention_kind)."""
    c = s.cfg
    n = seq_shards(s.mesh, s.rules)
    kind = c.model.attention_kind(jax.default_backend(), c.train.seq_len, c.data.packing_mask)
    return context.describe(
        context.by_positions(kind) if n > 1 else kind, n, c.parallelism.context_strategy
    )


def experts(s: RunSetup) -> str:
    """The MoE experts' layout over the FSDP axes, with a trailing comma; "" for a dense model."""
    if not s.cfg.model.n_experts:
        return ""
    text = expert_layout.describe(s.rules, s.cfg.parallelism.experts_over_fsdp, dict(s.mesh.shape))
    return f" {text}," if text else ""


def open_run(
    run_setup: RunSetup,
    abstract,
    saver,
    data,
    point,
    state,
    goodput: Goodput,
    opening: tuple,
    on_log,
) -> Run:
    """The run directory's files, the logger and the opening lines (`opening`: the compile's
    seconds, the resume note, the checkpoint's meta); -> what the loop reports to."""
    cfg, mesh, (compile_s, note, meta) = run_setup.cfg, run_setup.mesh, opening
    # a full disk or a read-only directory: one line, exit 2
    with run_dir_writes(cfg.logging.run_dir):
        if jax.process_index() == 0:
            prepare_run_dir(cfg.logging.run_dir, dump(cfg), point.step if point else None, goodput)
        log = MetricsLogger(
            cfg.logging.run_dir,
            cfg.train.steps,
            int(state.step),
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
        )
    for msg in warn_undersharded(mesh, state.params):
        log.print(f"warning: {msg}")
    peak, peak_src = peak_flops(run_setup.compute_dtype, cfg.logging.peak_tflops, mesh.devices.flat)
    log.print(
        f"brigade: {param_count(cfg.model) / 1e6:.2f}M params, mesh {mesh_text(mesh.shape)}"
        f" ({mesh.size} device{'s' * (mesh.size > 1)}), {model.compute_dtype_text(cfg.model)},"
        f" {attention(run_setup)},{experts(run_setup)} {data.describe()}, step compiled in"
        f" {compile_s:.1f}s; peak:"
        f" {peak_src}"
    )
    if note:
        recomputed = goodput.recomputed_steps if point else 0
        log.print(note + (f"; {recomputed} step(s) to recompute" if recomputed else ""))
    config = cfg.to_dict()
    if point:
        checkpoint_match.warn_changed_settings(meta, config, data, log)
    return Run.start(
        run_setup,
        Saves(
            saver,
            every=cfg.checkpoint.every,
            mesh=mesh,
            config=config,
            seed=cfg.train.seed,
            data_position=data.state,
        ),
        log,
        goodput,
        state,
        peak,
        on_log,
        recover_from=lambda s, at: resume.recover(run_setup, abstract, saver, s, at, log),
    )
