"""The `post` section: the training objective (`--objective`) and the fields of the
post-training objectives (preference optimisation, train/core/preference.py and pair_loss.py).
Dataclasses only, so that parsing flags needs no JAX."""

from __future__ import annotations

import dataclasses

from errors import UserError
from models.fields import check_ranges, option, ranged
from train.core.flags import public_flag

# lm: next-token cross-entropy (pre-training, SFT); the others train on preference pairs
OBJECTIVES = ("lm", "dpo", "ipo", "orpo", "simpo")
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
        " preference` (docs/post-training.md); dpo and ipo need --init-from, the frozen reference",
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
    ref_fingerprint: str = option(
        "",
        "the reference model's fingerprint (dpo, ipo without LoRA); empty = recorded from the"
        " --init-from checkpoint when the run starts; a resume refuses a reference that changed",
    )

    def validate(self) -> PostConfig:
        check_ranges(self, lambda field: public_flag("post", field))
        if self.objective not in OBJECTIVES:
            raise UserError(f"--objective '{self.objective}': valid: {', '.join(OBJECTIVES)}")
        return self

    @property
    def preference(self) -> bool:
        return self.objective in PREFERENCE

    @property
    def needs_reference(self) -> bool:
        return self.objective in WITH_REFERENCE

    def beta_or_default(self) -> float:
        return self.beta or DEFAULT_BETA.get(self.objective, 0.0)


def check_config(cfg) -> None:
    """The rules between `post` and the other sections of a Config: a reference needs --init-from;
    the preference step syncs every step (no DiLoCo). The mesh's (no pipeline axis: the step runs
    the model's plain forward) are train/core/pair_loss.py's check_mesh."""
    post = cfg.post
    if not post.preference:
        return
    if post.needs_reference and not cfg.checkpoint.init_from:
        raise UserError(
            f"--objective {post.objective} without --init-from: the reference model is the"
            " --init-from checkpoint (frozen); pass --init-from PATH (the SFT model), or use"
            " --objective orpo or simpo, which need no reference"
        )
    if cfg.comm.sync_every > 1:
        raise UserError(
            f"--objective {post.objective}: not with --comm.sync_every {cfg.comm.sync_every}"
            " (DiLoCo); use --comm.sync_every 1"
        )
