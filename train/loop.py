"""The training loop: the only place with I/O. Data in; metrics, eval and a sample out."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from mesh.build import describe, init_distributed, make_mesh
from mesh.errors import UserError
from mesh.rules import axis_rules, logical_to_spec, make_rules
from mesh.shard import axes_size, check_divisible, warn_undersharded
from models import model as M
from models.flops import flops_per_token, param_count
from models.sample import generate
from train import optim, state as S
from train.config import Config, dump
from train.data import corpus as C
from train.data.loader import Prefetcher, WindowSampler, eval_batches
from train.metrics import MetricsLogger, peak_flops
from train.step import eval_step, train_step

# Which config field sets each logical dim, for divisibility errors that name the culprit.
HINTS = {"heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "mlp": "model.d_ff", "embed": "model.d_model",
         "vocab": "model.vocab_size", "layers": "model.n_layers"}


class Trainer:
    """Build everything from a Config, then `fit()`. Usable from notebooks as well as the CLI."""

    def __init__(self, cfg: Config, *, devices: list | None = None):
        self.cfg = cfg
        p = cfg.parallelism
        if p.coordinator or p.num_processes > 1:
            init_distributed(p.coordinator or None, p.num_processes, p.process_id)
        else:
            init_distributed()
        self.mesh = make_mesh(p.mesh, p.mesh_dcn, devices)
        self.rules = make_rules(p.rules)
        self.model_cfg = cfg.model
        self._validate_shapes()
        self.tx = optim.make(cfg.train)
        self.lr = optim.schedule(cfg.train)
        self.batch_sharding = NamedSharding(self.mesh, logical_to_spec(("batch", "seq"), self.rules))
        self.state_shardings = S.shardings(self.model_cfg, self.tx, self.mesh, self.rules)
        self.compute_dtype = M.compute_dtype(self.model_cfg)

    # -- validation -------------------------------------------------------------------------
    def _validate_shapes(self) -> None:
        t, m = self.cfg.train, self.model_cfg
        check_divisible(self.mesh, M.abstract_params(m), M.param_axes(m), self.rules, HINTS)
        spec = logical_to_spec(("batch",), self.rules)[0]
        n = axes_size(self.mesh, spec)
        per_micro = t.batch_size // t.micro_batches
        if per_micro % n:
            axes = (spec,) if isinstance(spec, str) else spec
            layout = "x".join(f"{a}={self.mesh.shape[a]}" for a in axes)
            raise UserError(f"--batch-size {t.batch_size} (/ --micro-batches {t.micro_batches} = {per_micro}) is not"
                            f" divisible by the batch mesh axes {layout} = {n}; use a multiple of {n * t.micro_batches}")

    # -- building blocks --------------------------------------------------------------------
    def create_state(self) -> S.TrainState:
        return S.create(self.model_cfg, self.tx, self.mesh, self.rules, self.cfg.train.seed)

    def jit_step(self):
        step = functools.partial(train_step, self.model_cfg, self.tx, self.lr, self.cfg.train.micro_batches,
                                 self.dp_axes())
        return jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding),
                       out_shardings=(self.state_shardings, None), donate_argnums=(0,))

    def dp_axes(self) -> tuple[str, ...]:
        """Leading batch mesh axes (size > 1) that shard no parameter: plain data parallelism."""
        used = {a for sh in jax.tree.leaves(self.state_shardings.params) for e in sh.spec if e is not None
                for a in ((e,) if isinstance(e, str) else e)}
        out = []
        for a in self.rules["batch"]:
            if self.mesh.shape[a] == 1:
                continue
            if a in used:
                break
            out.append(a)
        return tuple(out)

    def compile_step(self, state, batch):
        with jax.set_mesh(self.mesh), axis_rules(self.rules):
            return self.jit_step().lower(state, batch).compile()

    def eval_loss(self, params, batches) -> float:
        fn = jax.jit(functools.partial(eval_step, self.model_cfg))
        with jax.set_mesh(self.mesh), axis_rules(self.rules):
            sums = [fn(params, b) for b in batches]
        total, count = np.sum([jax.device_get(s) for s in sums], axis=0)
        return float(total / max(count, 1.0))

    def sample(self, params, prompt: str, n_tokens: int, seed: int = 0) -> str:
        prompt_tokens = C.encode(prompt or "\n")[None, :].astype(np.int32)
        replicate_acts = {k: () for k in self.rules}  # a batch of one cannot be split over devices
        with jax.set_mesh(self.mesh), axis_rules(replicate_acts):
            out = generate(self.model_cfg, params, prompt_tokens, jax.random.key(seed), max_new=n_tokens)
        return C.decode(np.asarray(jax.device_get(out))[0])

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        t_start = time.perf_counter()
        corpus = C.load(cfg.data.source, cfg.data.eval_fraction, t.seed)
        if corpus.vocab_size > self.model_cfg.vocab_size:
            raise UserError(f"data '{corpus.name}' needs vocab_size >= {corpus.vocab_size} but"
                            f" model.vocab_size={self.model_cfg.vocab_size}")
        sampler = WindowSampler(corpus.train, t.batch_size, t.seq_len, t.seed)
        run_dir = cfg.logging.run_dir
        is_main = jax.process_index() == 0
        if is_main:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "config.json"), "w") as f:
                f.write(dump(cfg))
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                os.remove(os.path.join(run_dir, "metrics.jsonl"))  # a fresh run starts a fresh log
        log = MetricsLogger(run_dir, t.steps, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress)

        state = self.create_state()
        for msg in warn_undersharded(self.mesh, state.params):
            log.print(f"warning: {msg}")
        prefetch = Prefetcher(sampler, self.batch_sharding, int(state.step), cfg.data.prefetch)
        batch, _ = prefetch.next()
        t0 = time.perf_counter()
        step_fn = self.compile_step(state, batch)
        compile_s = time.perf_counter() - t0

        n_params = param_count(self.model_cfg)
        tokens_per_step = t.batch_size * t.seq_len
        flops_per_step = flops_per_token(self.model_cfg, t.seq_len) * tokens_per_step
        peak, peak_src = peak_flops(self.compute_dtype, cfg.logging.peak_tflops)
        n_dev = self.mesh.size
        log.print(f"brigade: {n_params / 1e6:.2f}M params, mesh {describe(self.mesh)} ({n_dev} devices),"
                  f" {self.compute_dtype} compute, data {corpus.name} ({len(corpus.train) / 1e6:.1f}M train tokens),"
                  f" step compiled in {compile_s:.1f}s; peak: {peak_src}")

        eval_sampler = WindowSampler(corpus.eval, t.batch_size, t.seq_len, t.seed, "eval") \
            if t.eval_every and len(corpus.eval) > t.seq_len + 2 else None
        evals = eval_batches(eval_sampler, self.batch_sharding, t.eval_batches) if eval_sampler else []

        history, eval_history = [], []
        wait_s, last_logged, t_last = 0.0, int(state.step), time.perf_counter()
        productive_s = 0.0
        step = int(state.step)
        try:
            while step < t.steps:
                state, metrics = step_fn(state, batch)
                step += 1
                if step < t.steps:
                    batch, waited = prefetch.next()
                    wait_s += waited
                if step % cfg.logging.log_every == 0 or step == t.steps or step == 1:  # step 1: the starting loss
                    m = jax.device_get(metrics)  # the only host sync in steady state
                    now = time.perf_counter()
                    n = step - last_logged
                    dt = (now - t_last) / n
                    productive_s += now - t_last
                    rec = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                           "lr": float(m["lr"]), "step_time_s": dt, "tokens_per_sec": tokens_per_step / dt,
                           "tokens_per_sec_per_device": tokens_per_step / dt / n_dev,
                           "mfu": flops_per_step / dt / peak if peak else 0.0, "data_wait_s": wait_s / n}
                    if not math.isfinite(rec["loss"]):
                        log.print(f"warning: non-finite loss at step {step}")
                    log.log(rec)
                    log.advance(n)
                    history.append(rec)
                    wait_s, last_logged, t_last = 0.0, step, time.perf_counter()
                if evals and step % t.eval_every == 0 or (evals and step == t.steps):
                    ev = self.eval_loss(state.params, evals)
                    rec = {"step": step, "eval_loss": ev, "eval_ppl": math.exp(min(ev, 50.0))}
                    log.log(rec)
                    eval_history.append(rec)
                    t_last = time.perf_counter()  # eval time is not step time
        finally:
            prefetch.close()

        text = self.sample(state.params, t.prompt, t.sample_tokens, t.seed) if t.sample_tokens else ""
        wall = time.perf_counter() - t_start
        steady = history[1:] or history
        summary = {
            "steps": step, "final_loss": history[-1]["loss"] if history else None,
            "first_loss": history[0]["loss"] if history else None,
            "eval_loss": eval_history[-1]["eval_loss"] if eval_history else None,
            "tokens_per_sec": float(np.median([r["tokens_per_sec"] for r in steady])) if steady else 0.0,
            "mfu": float(np.median([r["mfu"] for r in steady])) if steady else 0.0,
            "compile_s": compile_s, "wall_s": wall, "goodput": productive_s / wall if wall else 0.0,
            "params": n_params, "mesh": describe(self.mesh), "sample": text,
        }
        log.print(_summary_text(summary))
        log.close()
        if is_main:
            with open(os.path.join(run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        self.state = state
        self.history, self.eval_history = history, eval_history
        return summary


def _summary_text(s: dict) -> str:
    lines = [f"done: {s['steps']} steps in {s['wall_s']:.1f}s (compile {s['compile_s']:.1f}s),"
             f" loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}"
             + (f", eval loss {s['eval_loss']:.3f}" if s["eval_loss"] is not None else "")
             + f", {s['tokens_per_sec']:.0f} tokens/s, MFU {100 * s['mfu']:.1f}%, goodput {100 * s['goodput']:.0f}%"]
    if s["sample"]:
        lines += ["--- sample ---", s["sample"], "--------------"]
    return "\n".join(lines)


def with_overrides(cfg: Config, **sections) -> Config:
    """cfg with some fields replaced: with_overrides(cfg, train={'steps': 5})."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})
