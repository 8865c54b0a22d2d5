"""GRPO's step (--objective grpo): rollouts from the current policy, then the update on them.

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

Logged with every step: `grpo/reward_mean`, `grpo/reward_std` (over the B G completions),
`grpo/completion_tokens` (the mean completion length, its EOS included), `grpo/rollout_tokens`
(the tokens sampled, B G x --post.max_new_tokens), `grpo/rollout_tokens_per_sec`,
`grpo/rollout_s` and `grpo/rollout_share` (of the step's wall time, the update included),
`grpo/decode_steps` (the sampler's decode steps run: fewer than the prompts' spread plus
--post.max_new_tokens when every row ends early), and `post/kl` (with --post.kl_beta > 0) from the
step.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from errors import UserError
from mesh.rules import axis_rules
from train.core import grpo_loss, rewards
from train.core.inference import continue_prompts, sampler_rules
from train.core.setup import RunSetup
from train.core.shapes import batch_shards


class Rollouts:
    """The step of a grpo run: (state, a batch of prompts) -> (state, metrics)."""

    def __init__(self, s: RunSetup, step_fn, model_params, data):
        post = s.cfg.post
        if jax.process_count() > 1:
            raise UserError(
                f"--objective grpo: one process only (this run has {jax.process_count()}); the"
                " rollouts are scored on the host that samples them"
            )
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
        rows, devices = s.cfg.train.batch_size * post.group_size, batch_shards(s.mesh, s.rules)
        self.sampler_rules, split = sampler_rules(s.mesh, s.rules, rows)
        if split < devices and jax.process_index() == 0:
            print(
                f"grpo: the sampler's {rows} rows (--batch-size x --post.group_size) do not split"
                f" over the batch's {devices} devices: each samples them all",
                flush=True,
            )
        self.sample_metrics: dict[str, float] = {}

    def texts(self, d: int) -> tuple[str, str]:
        """Record d's (prompt, answer) as text."""
        if d not in self._texts:
            prompt = self.data.tokens(d)[: int(self.data.docs.prompt[d])]
            self._texts[d] = (
                self.tokenizer.decode(prompt),
                self.tokenizer.decode(self.data.answer_ids(d)),
            )
        return self._texts[d]

    def sample(self, params, prompts: dict, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (prompts [R, P], their lengths [R], G completions of each [R, max_new]), R = B G, row
        b G + g prompt b's completion g, sampled with the key of (seed, step)."""
        s, post = self.s, self.s.cfg.post
        prompt_RP = np.repeat(prompts["prompt"], post.group_size, 0)
        length_R = np.repeat(prompts["length"], post.group_size).astype(np.int32)
        tokens_RW = np.full((len(prompt_RP), self.width), self.data.eos, np.int32)
        tokens_RW[:, : prompt_RP.shape[1]] = prompt_RP
        key = jax.random.fold_in(jax.random.key(s.cfg.train.seed), step)
        with jax.set_mesh(s.mesh), axis_rules(self.sampler_rules):
            out_RS, steps_run = continue_prompts(
                s.model_cfg,
                params,
                tokens_RW,
                length_R,
                key,
                prefill=self.prefill,
                steps=self.width - self.prefill,
                temperature=float(post.temperature),
                top_k=0,
                eos=self.data.eos,
            )
        self.sample_metrics = {"grpo/decode_steps": float(steps_run)}
        full_RW = np.concatenate([tokens_RW[:, : self.prefill], np.asarray(out_RS)], 1)
        at_RN = length_R[:, None] + np.arange(post.max_new_tokens)
        return prompt_RP, length_R, np.take_along_axis(full_RW, at_RN, 1)

    def scores(self, records_B: np.ndarray, new_RN: np.ndarray) -> np.ndarray:
        """The reward of each completion [B, G] (its text up to the EOS)."""
        post, eos = self.s.cfg.post, self.data.eos
        kept_R = grpo_loss.completion_lengths(new_RN, eos)
        out = np.zeros(len(new_RN), np.float64)
        for r, (tokens, k) in enumerate(zip(new_RN, kept_R)):
            d = int(records_B[r // post.group_size])
            prompt, answer = self.texts(d)
            text = self.tokenizer.decode(tokens[: k - 1] if tokens[k - 1] == eos else tokens[:k])
            where = f"record {d + 1} of --data {self.data.name}"
            out[r] = rewards.score(post.reward, self.reward, text, answer, prompt, where)
        return out.reshape(-1, post.group_size)

    def __call__(self, state, prompts: dict):
        s, t0 = self.s, time.perf_counter()
        step = int(jax.device_get(state.step))  # the previous update is done: its params sample
        prompt_RP, length_R, new_RN = self.sample(self.model_params(state), prompts, step)
        sampled_s = time.perf_counter() - t0
        rewards_BG = self.scores(prompts["record"], new_RN)
        adv_R = grpo_loss.group_advantages(rewards_BG).reshape(-1)
        rows = grpo_loss.rollout_rows(
            prompt_RP, length_R, new_RN, adv_R, s.cfg.train.seq_len, self.data.eos
        )
        batch = jax.device_put(rows, s.batch_sharding)
        t1 = time.perf_counter()
        state, metrics = self.step_fn(state, batch)
        jax.block_until_ready(metrics["loss"])  # the next rollout waits for this update anyway
        total_s = time.perf_counter() - t0
        n_sampled = new_RN.size
        return state, {
            **metrics,
            "grpo/reward_mean": float(rewards_BG.mean()),
            "grpo/reward_std": float(rewards_BG.std()),
            "grpo/completion_tokens": float(
                grpo_loss.completion_lengths(new_RN, self.data.eos).mean()
            ),
            "grpo/rollout_tokens": float(n_sampled),
            "grpo/rollout_tokens_per_sec": n_sampled / max(sampled_s, 1e-9),
            "grpo/rollout_s": t1 - t0,
            "grpo/rollout_share": (t1 - t0) / max(total_s, 1e-9),
            **self.sample_metrics,
        }
