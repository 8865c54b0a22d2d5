"""The preference step's objective (--objective dpo|ipo|orpo|simpo): the loss of a batch of pairs
and its logged sums; the frozen reference model it reads (the --init-from checkpoint).

A batch of B pairs holds the chosen sequences as `inputs`, `targets`, `weights` [B, T] and the
rejected ones as `rejected_inputs`, ... [B, T] (train/data/pairs.py): row i of each is pair i, so
splitting rows into micro-batches and over data-parallel replicas keeps every pair whole. Both
sequences go through the model in one forward: stacked [B, 2, T] and viewed as [2B, T] (row 2i
chosen, 2i + 1 rejected: on a batch-sharded mesh each device's rows stay its own, no resharding).
A sequence's log-probability is the sum of its target tokens' log-probabilities weighted by the
loss mask, which covers the response only (`prepare --format preference`).

The reference. With LoRA it is the base with the adapters off, the step's frozen third argument
already: no second copy. Without LoRA it is a frozen copy of the --init-from parameters, the
step's third argument, held as the parameters are sharded; its log-probabilities are computed in
the same step (a forward without a backward, about a third of the step's work; docs/post-training.md
has the measurement): a precomputed table would save that forward but must be recomputed whenever
the data, the sequence length or the reference changes, and resumes and epochs need nothing
extra this way.

The objective is the sum of the pairs' losses (and the MoE balance terms weighted by the pair
count): the step divides by the pair count once every micro-batch and replica is summed
(train/core/step.py), so gradient accumulation and data parallelism give one big batch's mean.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from checkpoint import finite
from checkpoint.layout import fingerprint
from checkpoint.manager import open_checkpoint
from errors import UserError
from mesh.rules import axis_rules
from models import context, model, registry
from models.config import ModelConfig
from models.loss import token_xent
from models.pipeline import with_stat_terms
from models.quant import QuantizedWeight
from models.transformer import default_positions
from train.core import preference
from train.core.batch_loss import moe_sums
from train.core.post_sections import PostConfig

REJECTED = "rejected_"  # the prefix of the rejected sequences' keys in a batch of pairs
LOGGED = ("chosen_logp", "rejected_logp", "chosen_reward", "rejected_reward", "margin", "accuracy")


def check_run(cfg, mesh, loss) -> None:
    """One line for a preference run the step cannot take: on a pipeline axis (the step runs the
    model's plain forward), with a custom per-token loss (Trainer(loss=)) it would not use."""
    post = cfg.post
    if post.objective == "lm":
        return
    if mesh.shape.get("pipeline", 1) > 1:
        raise UserError(
            f"--objective {post.objective}: not on a pipeline axis (mesh pipeline="
            f"{mesh.shape['pipeline']}); put those devices on fsdp or data"
        )
    if loss is not None:
        raise UserError(
            f"Trainer(loss=...): a per-token loss replaces cross-entropy; --objective"
            f" {post.objective} has its own loss: use --objective lm with loss="
        )


def both(batch: dict) -> dict:
    """A batch of pairs -> one batch of 2B rows, row 2i pair i's chosen, 2i + 1 its rejected."""
    out = {}
    for key in ("inputs", "targets", "weights", "segment_ids", "positions"):
        if key in batch:
            pair_B2T = jnp.stack([batch[key], batch[REJECTED + key]], axis=1)
            out[key] = pair_B2T.reshape(-1, pair_B2T.shape[-1])
    return out


def sequence_logps_per_token(cfg: ModelConfig, params, rows: dict):
    """-> (each target's log-probability [R, T] float32, MoE stats, the rows in the layout of the
    log-probabilities) of rows [R, T]: a context axis's zigzag order permutes every [R, T] array
    of the rows alike (weights, advantages), so per-row sums and means do not change."""
    n_context = context.context_size()
    registry.check_sequence_order(cfg, n_context)
    rows = context.to_layout(rows, n_context, default_positions)
    logits_RTV, stats = model.forward(
        cfg, params, rows["inputs"], rows.get("positions"), rows.get("segment_ids")
    )
    return -token_xent(logits_RTV, rows["targets"]), stats, rows


def sequence_logps(cfg: ModelConfig, params, rows: dict):
    """-> (the sum of each row's target log-probabilities under the loss mask [R], the mask's
    token count [R], MoE stats) of rows [R, T], float32."""
    logp_RT, stats, rows = sequence_logps_per_token(cfg, params, rows)
    weights_RT = rows["weights"]
    return jnp.sum(logp_RT * weights_RT, -1), jnp.sum(weights_RT, -1), stats


def pair_losses(post: PostConfig, logp_w, logp_l, n_w, n_l, ref_w=None, ref_l=None):
    """The objective's per-pair (loss, chosen reward, rejected reward), train/core/preference.py."""
    beta = post.beta_or_default()
    if post.objective == "dpo":
        return preference.dpo(
            logp_w, logp_l, ref_w, ref_l, beta=beta, label_smoothing=post.label_smoothing
        )
    if post.objective == "ipo":
        return preference.ipo(logp_w, logp_l, ref_w, ref_l, tau=beta)
    if post.objective == "orpo":
        return preference.orpo(logp_w, logp_l, n_w, n_l, lam=post.orpo_lambda, beta=beta)
    return preference.simpo(logp_w, logp_l, n_w, n_l, beta=beta, gamma=post.gamma)


def pair_terms(cfg: ModelConfig, post: PostConfig, params, batch: dict, ref=None):
    """-> (objective sum, (loss sum, pair count, sums)) of a batch of pairs, float32, as
    train/core/batch_loss.py's loss_terms returns them for tokens: `sums` holds the MoE sums and
    `post/NAME` sums over the pairs (LOGGED: log-probabilities, rewards, their margin, whether the
    chosen reward is higher), which the step divides by the pair count. `ref`: the reference's
    parameters (dpo, ipo), never differentiated."""
    rows = both(batch)
    ref_w = ref_l = None
    if post.needs_reference:
        ref_R, _, _ = sequence_logps(cfg, jax.lax.stop_gradient(ref), rows)
        ref_R = jax.lax.stop_gradient(ref_R)
        # the reference's forward first, then the policy's: two independent forwards may otherwise
        # run at once, each device with two sets of collectives in flight (XLA:CPU runs independent
        # work concurrently and deadlocked on a LoRA run over data=2,fsdp=2,model=2); one at a time
        # also keeps one forward's activations live, not two
        ref_R, params = jax.lax.optimization_barrier((ref_R, params))
        ref_w, ref_l = ref_R[0::2], ref_R[1::2]
    logp_R, n_R, stats = sequence_logps(cfg, params, rows)
    logp_w, logp_l = logp_R[0::2], logp_R[1::2]
    n_w, n_l = jnp.maximum(n_R[0::2], 1.0), jnp.maximum(n_R[1::2], 1.0)
    loss_B, reward_w, reward_l = pair_losses(post, logp_w, logp_l, n_w, n_l, ref_w, ref_l)
    n = jnp.float32(loss_B.shape[0])
    loss_sum = jnp.sum(loss_B)
    weights = {"aux": n * cfg.aux_loss_coef, "z": n * cfg.z_loss_coef} if cfg.n_experts else {}
    logged = {
        "chosen_logp": logp_w,
        "rejected_logp": logp_l,
        "chosen_reward": reward_w,
        "rejected_reward": reward_l,
        "margin": reward_w - reward_l,
        "accuracy": (reward_w > reward_l).astype(jnp.float32),
    }
    sums = {**moe_sums(stats, n), **{f"post/{k}": jnp.sum(v) for k, v in logged.items()}}
    return with_stat_terms(loss_sum, stats, weights), (loss_sum, n, sums)


# the held-out figures of a preference run: the objective's loss and these `post/` means
HELD_OUT = ("accuracy", "margin", "chosen_logp", "rejected_logp")


def held_out_sums(cfg: ModelConfig, post: PostConfig, params, batch: dict, ref=None):
    """-> (loss sum, pair count, {name: sum over the pairs} of HELD_OUT) of a batch of pairs."""
    _, (loss_sum, n, sums) = pair_terms(cfg, post, params, batch, ref)
    return loss_sum, n, {k: sums[f"post/{k}"] for k in HELD_OUT}


class HeldOutPairs:
    """A preference run's eval on held-out pairs (whole: train/data/pairs.py): the objective's
    own loss (`eval/loss`, the mean over pairs) and `eval/accuracy`, `eval/margin`,
    `eval/chosen_logp`, `eval/rejected_logp` as the step logs them, on the run's mesh, jitted once.
    `reference`: the frozen reference's parameters (dpo, ipo), else None."""

    def __init__(self, s, reference=None):
        self.setup, self.reference = s, reference
        self.step = jax.jit(functools.partial(held_out_sums, s.model_cfg, s.cfg.post))

    def __call__(self, params, batches: list[dict]) -> dict[str, float]:
        s = self.setup
        with (
            jax.set_mesh(s.mesh),
            axis_rules(s.rules),
            context.strategy(s.cfg.parallelism.context_strategy),
        ):
            out = jax.device_get([self.step(params, b, self.reference) for b in batches])
        n = max(float(sum(o[1] for o in out)), 1.0)
        figures = {"eval/loss": float(np.sum([o[0] for o in out])) / n}
        for k in HELD_OUT:
            figures[f"eval/{k}"] = float(np.sum([o[2][k] for o in out])) / n
        return figures


def reference_params(cfg, frozen):
    """The reference's parameters from the step's frozen argument: a LoRA run's base (the adapters
    off: the same arrays, in the model's param dtype; a QLoRA base's quantised weights as they
    are, dequantised per layer where the layer runs), else the reference copy itself."""
    dtype = cfg.model.param_dtype

    def cast(x):
        return x if isinstance(x, QuantizedWeight) or x.dtype == dtype else x.astype(dtype)

    return jax.tree.map(cast, frozen, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def load_reference(cfg, shardings: dict, meta: dict) -> tuple[dict, str, str]:
    """The frozen reference of a dpo/ipo run without LoRA, read into `shardings` -> (params, its
    fingerprint, a line for the log). From --init-from, else the pointer the resumed checkpoint's
    config (`meta`) holds; refused in one line when its fingerprint differs from the one recorded
    (by the checkpoint, or --post.ref_fingerprint)."""
    saved = meta.get("config", {})
    path = cfg.checkpoint.init_from or saved.get("checkpoint", {}).get("init_from", "")
    want = saved.get("post", {}).get("ref_fingerprint", "") or cfg.post.ref_fingerprint
    abstract = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        model.abstract_params(cfg.model),
        shardings,
    )
    src, step = open_checkpoint(path)
    where = src.step_dir(step)
    params = src.restore_params(step, abstract)
    finite.check_params(params, f"--init-from {where}")
    got = fingerprint(params)
    if want and got != want:
        raise UserError(
            f"--objective {cfg.post.objective}: the reference {where} has fingerprint {got}, not"
            f" the {want} this run was trained against; pass --init-from the original model, or"
            " start a new --run-dir"
        )
    return params, got, f"reference model: {where}, frozen (fingerprint {got})"
