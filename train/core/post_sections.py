"""The `post` section: the training objective (`--objective`) and the fields of the
post-training objectives (preference optimisation, train/core/preference.py and pair_loss.py;
GRPO, train/core/grpo_loss.py and train/run/rollouts.py). Dataclasses only, so that parsing flags
needs no JAX."""

from __future__ import annotations

import dataclasses
import re

from errors import UserError
from models.fields import check_ranges, option, ranged
from train.core import rewards
from train.core.flags import public_flag

# lm: next-token cross-entropy (pre-training, SFT); the others train on preference pairs
# grpo: reinforcement learning on prompts with rewards (rollouts from the policy itself)
OBJECTIVES = ("lm", "dpo", "ipo", "orpo", "simpo", "grpo")
PREFERENCE = ("dpo", "ipo", "orpo", "simpo")
# the objectives whose loss reads a frozen reference model (the --init-from checkpoint)
WITH_REFERENCE = ("dpo", "ipo")
# --post.beta 0: the objective's own default (the papers' and TRL's)
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "orpo": 0.1, "simpo": 2.0}


@dataclasses.dataclass(frozen=True)
class PostConfig:
    """The `post` section: which objective the step differentiates and its coefficients."""

    objective: str = option(
        "lm",
        f"{' | '.join(OBJECTIVES)} (flag --objective): lm = next-token cross-entropy; dpo, ipo,"
        " orpo, simpo = preference optimisation on pairs prepared with `prepare --format"
        " preference` (docs/post-training.md); dpo and ipo need --init-from, the frozen reference;"
        " grpo = group-relative policy optimisation on prompts prepared with `prepare --format"
        " prompts`, completions sampled from the policy and scored by --post.reward",
    )
    beta: float = ranged(
        0.0,
        ">=0",
        help="dpo: the KL coefficient beta; ipo: tau (the target margin is 1/(2 tau)); simpo: the"
        " reward scale beta; orpo: the scale of the logged rewards; 0 = the objective's"
        " default: 0.1, simpo 2.0",
    )
    label_smoothing: float = ranged(
        0.0,
        "[0, 0.5)",
        help="dpo: the assumed share of flipped preference labels (conservative DPO); 0 = plain",
        why="at 0.5 the labels carry no preference",
    )
    gamma: float = ranged(1.0, ">=0", help="simpo: the target reward margin gamma")
    orpo_lambda: float = ranged(
        0.1, ">=0", help="orpo: the weight lambda of the odds-ratio term next to the chosen NLL"
    )
    group_size: int = ranged(
        4,
        ">=2",
        help="grpo: G, the completions sampled per prompt",
        why="the advantage is relative to the group: G = 1 has no group baseline",
    )
    max_new_tokens: int = ranged(16, ">=1", help="grpo: the tokens sampled per completion")
    temperature: float = ranged(1.0, ">0", help="grpo: the sampling temperature of the rollouts")
    clip: float = ranged(
        0.2, "(0, 1)", help="grpo: epsilon of the clipped ratio, clip(ratio, 1 - eps, 1 + eps)"
    )
    updates_per_rollout: int = ranged(
        1,
        ">=1",
        help="grpo: optimizer steps on each rollout (mu of the paper, TRL's num_iterations): the"
        " rollout's log-probabilities under the sampling policy are computed once, then each"
        " step is a full-batch update on the same completions; checkpoints fall at rollout"
        " boundaries (--checkpoint.every and --train.steps multiples of it)",
        why="each rollout is trained on at least once",
    )
    kl_beta: float = ranged(
        0.0,
        ">=0",
        help="grpo: the weight of the KL term to the reference (the k3 estimator); > 0 needs"
        " --init-from, the frozen reference; 0 = no KL term, no reference",
    )
    reward: str = option(
        "exact_match",
        "grpo: the reward, by name (train/core/rewards.py): exact_match (the completion's final"
        " answer equals the record's answer), format (the completion matches"
        " --post.reward_pattern), or one registered with train.core.rewards.register",
    )
    reward_pattern: str = option(
        r"(?s)<think>.*</think>\s*<answer>.*</answer>",
        "grpo, --post.reward format: the regular expression the whole stripped completion must"
        " match for reward 1",
    )
    ref_fingerprint: str = option(
        "",
        "the reference model's fingerprint (dpo, ipo without LoRA); empty = recorded from the"
        " --init-from checkpoint when the run starts; a resume refuses a reference that changed",
    )

    def validate(self) -> PostConfig:
        check_ranges(self, lambda field: public_flag("post", field))
        if self.objective not in OBJECTIVES:
            raise UserError(f"--objective '{self.objective}': valid: {', '.join(OBJECTIVES)}")
        try:
            re.compile(self.reward_pattern)
        except re.error as e:
            raise UserError(f"--post.reward_pattern {self.reward_pattern!r}: {e}") from None
        return self

    @property
    def preference(self) -> bool:
        return self.objective in PREFERENCE

    @property
    def grpo(self) -> bool:
        return self.objective == "grpo"

    @property
    def needs_reference(self) -> bool:
        return self.objective in WITH_REFERENCE or (self.grpo and self.kl_beta > 0)

    def beta_or_default(self) -> float:
        return self.beta or DEFAULT_BETA.get(self.objective, 0.0)


def check_config(cfg) -> None:
    """The rules between `post` and the other sections of a Config: a reference needs --init-from;
    the preference step syncs every step (no DiLoCo). The mesh's (no pipeline axis: the step runs
    the model's plain forward) are train/core/pair_loss.py's check_mesh."""
    post = cfg.post
    if post.objective == "lm":
        return
    if post.needs_reference and not cfg.checkpoint.init_from:
        raise UserError(
            f"--objective {post.objective} without --init-from: the reference model is the"
            " --init-from checkpoint (frozen); pass --init-from PATH (the SFT model), or use"
            + (" --post.kl_beta 0 (no KL term)" if post.grpo else " --objective orpo or simpo")
            + ", which need no reference"
        )
    if post.grpo:  # an unknown reward: one line before anything is built
        rewards.resolve(post.reward, post.reward_pattern)
    if post.grpo and post.updates_per_rollout > 1:
        check_rollout_boundaries(cfg)
    if cfg.comm.sync_every > 1:
        raise UserError(
            f"--objective {post.objective}: not with --comm.sync_every {cfg.comm.sync_every}"
            " (DiLoCo); use --comm.sync_every 1"
        )


def check_rollout_boundaries(cfg) -> None:
    """With N = --post.updates_per_rollout > 1 a checkpoint holds no rollout: the saves and the end
    of the run fall at rollout boundaries (steps that are multiples of N), so that a resume samples
    the rollout the uninterrupted run sampled, from the same parameters."""
    n = cfg.post.updates_per_rollout
    named = {
        "--train.steps": cfg.train.steps,
        "--checkpoint.every": cfg.checkpoint.every,
    }
    if cfg.checkpoint.local_dir:
        named["--checkpoint.local_every"] = cfg.checkpoint.local_every
    for flag, value in named.items():
        if value % n:
            raise UserError(
                f"{flag} {value} with --post.updates_per_rollout {n}: checkpoints and the run's"
                f" end fall at rollout boundaries; pass a multiple of {n}"
            )
