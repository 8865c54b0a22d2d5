"""GRPO's step (--objective grpo): rollouts from the current policy, then the updates on them.

The data pipeline prefetches fixed batches of B prompts (train/data/prompts.py); the completions
depend on the weights of the step that samples them, so they are made here, in the step: the
Trainer calls `Rollouts(state, prompts)` where it calls any step. It samples G completions of
each prompt with Brigade's KV-cache sampler (train/core/inference.py continue_prompts, jitted once)
from the policy's own parameters on the training mesh (the parameters stay sharded as they train;
the R = B G rows split over the batch's devices when R divides by them: inference.sampler_rules),
stopping once every row has emitted EOS, scores each with the reward (train/core/rewards.py),
computes the group-relative advantages and the step's batch (train/core/grpo_loss.py), and runs the
compiled train step on it. The sampling key is a function of --train.seed and the step, so a
resumed run samples the same completions.

Several updates per rollout (--post.updates_per_rollout N, the paper's mu, TRL's num_iterations):
a rollout is sampled at the steps that are multiples of N; the sampling policy's log-probabilities
of its completions are computed once right after (one forward, no gradient: `old_logp`), and the
N steps from there are each a full-batch optimizer step on the same batch (as TRL and Tunix do: no
split into N mini-batches), so the clipped ratio binds from the second one. The prompt pipeline
serves the rollout's prompts at each of its steps (train/data/prompts.py), and checkpoints fall at
rollout boundaries (train/core/post_sections.py, train/run/steps.py): a resume samples again what
the uninterrupted run sampled, from the same parameters.

Several processes: every process passes the same prompts and key to the sampler (one SPMD
program, its rows split over all processes' devices), gathers the completions (`complete`),
scores its share of them and gathers the others' (`scores`), so the rewards, advantages and batch
are the same on every process; the batch becomes one global array sharded like any batch, each
process placing the rows of its devices.

Logged with every step: `grpo/reward_mean`, `grpo/reward_std` (over the B G completions, of the
rollout the step trains on), `grpo/completion_tokens` (the mean completion length, its EOS
included), `grpo/rollout_tokens` (the tokens sampled by this step, B G x --post.max_new_tokens,
0 on a step that reuses its rollout), `grpo/rollout_tokens_per_sec`, `grpo/rollout_s` and
`grpo/rollout_share` (of the step's wall time, the update included), `grpo/clip_fraction` (the
completions' mean share of tokens whose ratio was clipped), `grpo/ratio_mean`,
`grpo/decode_steps` (the sampler's decode steps in the rollout: fewer than the prompts' spread
plus --post.max_new_tokens when every row ends early) and `post/kl` (with --post.kl_beta > 0)
from the step. At --eval-every, `eval/reward_mean` and `eval/pass_rate` of greedy completions
of the held-out prompts (`held_out_rewards`).
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from errors import UserError
from mesh.rules import axis_rules
from models import context
from train.core import grpo_loss, rewards
from train.core.inference import continue_prompts, sampler_rules
from train.core.setup import RunSetup
from train.core.shapes import batch_shards


class Rollouts:
    """The step of a grpo run: (state, a batch of prompts) -> (state, metrics)."""

    def __init__(self, s: RunSetup, step_fn, model_params, data):
        post = s.cfg.post
        self.tokenizer = data.tokenizer()
        if self.tokenizer is None:
            raise UserError(
                f"--data {data.name}: its tokenizer no longer loads; the rewards read the"
                " completions' text"
            )
        self.s, self.step_fn, self.model_params, self.data = s, step_fn, model_params, data
        self.reward = rewards.resolve(post.reward, post.reward_pattern)
        # the sampler's fixed shapes: every row holds P + max_new tokens; the prompts' shared
        # prefix of the shortest one's length fills the cache in one pass
        self.prefill = int(data.docs.prompt.min())
        self.width = data.P + post.max_new_tokens
        self._texts: dict[int, tuple[str, str]] = {}
        # several updates per rollout: the current rollout's (batch, figures), and pi_old's
        # log-probabilities, computed once per rollout on the batch's sharding
        self._rollout: tuple[dict, dict] | None = None
        self._old_logps = jax.jit(
            functools.partial(grpo_loss.token_logps, s.model_cfg, s.cfg.train.micro_batches),
            out_shardings=s.batch_sharding,
        )
        rows, devices = s.cfg.train.batch_size * post.group_size, batch_shards(s.mesh, s.rules)
        self.sampler_rules, split = sampler_rules(s.mesh, s.rules, rows)
        if split < devices and jax.process_index() == 0:
            print(
                f"grpo: the sampler's {rows} rows (--batch-size x --post.group_size) do not split"
                f" over the batch's {devices} devices: each samples them all",
                flush=True,
            )

    def texts(self, d: int) -> tuple[str, str]:
        """Record d's (prompt, answer) as text."""
        if d not in self._texts:
            prompt = self.data.tokens(d)[: int(self.data.docs.prompt[d])]
            self._texts[d] = (
                self.tokenizer.decode(prompt),
                self.tokenizer.decode(self.data.answer_ids(d)),
            )
        return self._texts[d]

    def complete(self, params, prompt_XP, length_X, key, temperature: float, rules):
        """-> (the continuation [X, max_new] of each right-padded prompt, the decode steps run),
        by the KV-cache sampler on the training mesh under axis `rules`; every row holds
        P + max_new tokens and stops once all rows have picked EOS."""
        tokens_XW = np.full((len(prompt_XP), self.width), self.data.eos, np.int32)
        tokens_XW[:, : prompt_XP.shape[1]] = prompt_XP
        with jax.set_mesh(self.s.mesh), axis_rules(rules):
            out_XS, steps_run = continue_prompts(
                self.s.model_cfg,
                params,
                tokens_XW,
                np.asarray(length_X, np.int32),
                key,
                prefill=self.prefill,
                steps=self.width - self.prefill,
                temperature=temperature,
                top_k=0,
                eos=self.data.eos,
            )
        if jax.process_count() > 1:  # split rows span other processes' devices: gather them
            out_XS = multihost_utils.process_allgather(out_XS, tiled=True)
        full_XW = np.concatenate([tokens_XW[:, : self.prefill], np.asarray(out_XS)], 1)
        at_XN = np.asarray(length_X)[:, None] + np.arange(self.s.cfg.post.max_new_tokens)
        return np.take_along_axis(full_XW, at_XN, 1), int(steps_run)

    def sample(self, params, prompts: dict, step: int):
        """-> (prompts [R, P], their lengths [R], G completions of each [R, max_new], the decode
        steps run), R = B G, row b G + g prompt b's completion g, sampled with the key of (seed,
        step)."""
        s, post = self.s, self.s.cfg.post
        prompt_RP = np.repeat(prompts["prompt"], post.group_size, 0)
        length_R = np.repeat(prompts["length"], post.group_size).astype(np.int32)
        key = jax.random.fold_in(jax.random.key(s.cfg.train.seed), step)
        new_RN, steps_run = self.complete(
            params, prompt_RP, length_R, key, float(post.temperature), self.sampler_rules
        )
        return prompt_RP, length_R, new_RN, steps_run

    def scores(self, records_B: np.ndarray, new_RN: np.ndarray, group: int = 0) -> np.ndarray:
        """The reward of each completion [B, G] (its text up to the EOS), row b G + g prompt b's
        completion g (G = `group`, --post.group_size by default). Each process scores its share
        (a contiguous block of rows) and gathers the others': the same rewards on every process,
        and a reward that fails on one process stops every process in one line."""
        post, eos = self.s.cfg.post, self.data.eos
        group = group or post.group_size
        n, procs, me = len(new_RN), jax.process_count(), jax.process_index()
        share = -(-n // procs)
        kept_R = grpo_loss.completion_lengths(new_RN, eos)
        mine, failed = np.zeros(share, np.float64), None
        for i, r in enumerate(range(me * share, min((me + 1) * share, n))):
            tokens, k, d = new_RN[r], kept_R[r], int(records_B[r // group])
            prompt, answer = self.texts(d)
            text = self.tokenizer.decode(tokens[: k - 1] if tokens[k - 1] == eos else tokens[:k])
            where = f"record {d + 1} of --data {self.data.name}"
            try:
                mine[i] = rewards.score(post.reward, self.reward, text, answer, prompt, where)
            except UserError as e:
                failed = e
                break
        if procs == 1:
            if failed:
                raise failed
            return mine[:n].reshape(-1, group)
        # the float64 rewards as int32 words: a gather in float32 would round them
        words = np.append(mine.view(np.int32), np.int32(failed is not None))
        gathered = np.asarray(multihost_utils.process_allgather(words), np.int32)  # [procs, ...]
        if failed:
            raise failed
        if gathered[:, -1].any():
            k = int(np.flatnonzero(gathered[:, -1])[0])
            raise UserError(
                f"--post.reward {post.reward}: failed on process {k} (its line says why)"
            )
        rewards_R = np.ascontiguousarray(gathered[:, :-1]).view(np.float64).reshape(-1)
        return rewards_R[:n].reshape(-1, group)

    def _place(self, rows: dict) -> dict:
        """Host rows, the same on every process -> global arrays sharded like the batch, each
        process placing its devices' rows."""
        sharding = self.s.batch_sharding
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in rows.items()
        }

    def rollout(self, state, prompts: dict, step: int) -> tuple[dict, dict]:
        """Sample, score and build the step's batch -> (the batch, the rollout's figures)."""
        s, post, t0 = self.s, self.s.cfg.post, time.perf_counter()
        params = self.model_params(state)
        prompt_RP, length_R, new_RN, steps_run = self.sample(params, prompts, step)
        sampled_s = time.perf_counter() - t0
        rewards_BG = self.scores(prompts["record"], new_RN)
        adv_R = grpo_loss.group_advantages(rewards_BG).reshape(-1)
        rows = grpo_loss.rollout_rows(
            prompt_RP, length_R, new_RN, adv_R, s.cfg.train.seq_len, self.data.eos
        )
        batch = self._place(rows)
        if post.updates_per_rollout > 1:  # pi_old: the sampling parameters' log-probabilities
            with (
                jax.set_mesh(s.mesh),
                axis_rules(s.rules),
                context.strategy(s.cfg.parallelism.context_strategy),
            ):
                batch["old_logp"] = self._old_logps(params, batch)
        figures = {
            "grpo/reward_mean": float(rewards_BG.mean()),
            "grpo/reward_std": float(rewards_BG.std()),
            "grpo/completion_tokens": float(
                grpo_loss.completion_lengths(new_RN, self.data.eos).mean()
            ),
            "grpo/rollout_tokens_per_sec": new_RN.size / max(sampled_s, 1e-9),
            "grpo/decode_steps": float(steps_run),
        }
        return batch, {**figures, "grpo/rollout_tokens": float(new_RN.size)}

    def __call__(self, state, prompts: dict):
        t0 = time.perf_counter()
        step = int(jax.device_get(state.step))  # the previous update is done: its params sample
        n = self.s.cfg.post.updates_per_rollout
        # a rollout starts at each multiple of N (or where a run starts off one: a fresh one)
        fresh = self._rollout is None or step % n == 0
        if fresh:
            self._rollout = self.rollout(state, prompts, step)
        batch, figures = self._rollout
        t1 = time.perf_counter()
        state, metrics = self.step_fn(state, batch)
        jax.block_until_ready(metrics["loss"])  # the next rollout waits for this update anyway
        total_s = time.perf_counter() - t0
        out = {
            k: v for k, v in metrics.items() if k not in ("post/clip_fraction", "post/ratio_mean")
        }
        return state, {
            **out,
            **figures,
            "grpo/rollout_tokens": figures["grpo/rollout_tokens"] if fresh else 0.0,
            "grpo/rollout_s": t1 - t0,
            "grpo/rollout_share": (t1 - t0) / max(total_s, 1e-9),
            "grpo/clip_fraction": metrics["post/clip_fraction"],
            "grpo/ratio_mean": metrics["post/ratio_mean"],
        }

    # ---------------------------------------------------------------- the held-out reward eval

    def held_out_rewards(self, params, held_out: list[dict]) -> dict[str, float]:
        """`eval/reward_mean` and `eval/pass_rate` (the share with reward >= 1) of one greedy
        completion (temperature 0: no key, the same completions for the same parameters) of each
        held-out prompt, all of them in one batch."""
        prompts = {k: np.concatenate([b[k] for b in held_out]) for k in held_out[0]}
        new_EN = self.greedy(params, prompts["prompt"], prompts["length"])
        rewards_E = self.scores(prompts["record"], new_EN, group=1).reshape(-1)
        return {
            "eval/reward_mean": float(rewards_E.mean()),
            "eval/pass_rate": float((rewards_E >= 1).mean()),
        }

    def greedy(self, params, prompt_EP: np.ndarray, length_E: np.ndarray) -> np.ndarray:
        """The greedy continuation [E, max_new] of each right-padded prompt, on the training mesh
        (the sampler of the rollouts, at temperature 0; the rows replicated: E need not divide
        over the devices)."""
        replicate_acts = {k: () for k in self.s.rules}
        key = jax.random.key(0)  # unused at temperature 0
        return self.complete(params, prompt_EP, length_E, key, 0.0, replicate_acts)[0]
