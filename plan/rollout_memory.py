"""The per-device memory of GRPO's rollout (--objective grpo): the KV-cache sampler that the step
runs before its update (train/run/rollouts.py, train/core/inference.py continue_prompts), priced
from the formulas for `plan` and `plan --devices`.

The sampler holds R = B G rows (--batch-size prompts x --post.group_size completions), each P +
--post.max_new_tokens wide. plan has no data, so P is the longest prompt the run accepts, --seq-len
- --post.max_new_tokens, and every prompt that long: the prefill pass then covers P positions, the
most it can. The rows split over the training batch's devices when R divides by them
(inference.sampler_rules), every other activation replicated; the parameters stay sharded as they
train, each layer's gathered as it runs (a LoRA run's merged first: `merged_copy`). Per device,
r = R / split rows:

- the KV cache, model.init_cache(R, width) at the compute dtype, / split, held twice: the decode
  loop's carry and the layer scan's updated copy of it (both in the compiled program's buffers);
- the weights gathered: one layer of each layer stack and the unstacked weights (embedding, head)
  whole, at the compute dtype;
- the larger of the prefill's and one decode step's activations: the logits (float32) of every
  position [r, P, V], and the attention scores (float32) over the cache and the new keys
  [r, heads, P, width + P]; a decode step's are those at one position;
- the prompts [R, width] and their lengths, and the completions [r, max_new] (int32).

Checked against the compiled sampler program (argument + temp bytes, the parameters' shards the
argument) in tests/test_plan_rollout.py. The update's activations and gradients are not live
during the rollout, nor the rollout's during the update: the parameters and the optimizer state
(and a frozen reference or base) are, in both.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from models import model as model_lib
from models.config import ModelConfig
from train.core import lora, qlora
from train.core.inference import sampler_rules

KV_COPIES = 2  # the decode loop's carry and the layer scan's updated cache
STACKS = ("layers", "outer_layers", "tail_layers", "stages")  # a leading dim of stacked layers


def _nbytes(tree, dtype=None) -> int:
    return sum(
        math.prod(x.shape) * np.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def _gathered_weights(cfg: ModelConfig, dtype: str) -> int:
    """One layer of each layer stack and every unstacked weight, whole, at `dtype`."""
    params, axes = model_lib.abstract_params(cfg), model_lib.param_axes(cfg)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    total = 0
    for x, names in zip(jax.tree.leaves(params), flat_axes):
        layers = x.shape[0] if names and names[0] in STACKS else 1
        total += math.prod(x.shape) // layers * np.dtype(dtype).itemsize
    return total


def rollout_memory(
    cfg: ModelConfig, rows: int, seq_len: int, max_new: int, mesh, rules, dtype: str
) -> dict:
    """The sampler's bytes per device by part, and their `total`, beyond the parameters' shards:
    `rows` = B G, `seq_len` = --seq-len (the width), `max_new` = --post.max_new_tokens; `mesh`
    (real or abstract) and `rules`: the run's, `dtype`: the compute dtype."""
    _, split = sampler_rules(mesh, rules, rows)
    r, width, prefill = rows // split, seq_len, seq_len - max_new
    cache = jax.eval_shape(lambda: model_lib.init_cache(cfg, rows, width, dtype))
    f32, v, heads = 4, cfg.vocab_size, cfg.n_heads

    def activations(positions: int) -> int:
        logits = r * positions * v * f32
        scores = r * heads * positions * (width + positions) * f32
        return logits + scores

    parts = {
        "kv_cache": KV_COPIES * _nbytes(cache) // split,
        "weights": _gathered_weights(cfg, dtype),
        "activations": max(activations(prefill), activations(1)),
        "prompts": (rows * (width + 1) // split + r * max_new) * 4,
    }
    return {**parts, "total": sum(parts.values()), "rows": rows, "split": split}


def merged_copy(lora_cfg, base_bytes: float) -> float:
    """The merged weights the sampler reads in a LoRA run: the base with its adapters merged, one
    copy of the base's shards (train/run/loop.py model_params), live during the rollout; none for
    QLoRA, whose layers merge their own weights as they run, nor without LoRA."""
    if lora_cfg is None or not lora.enabled(lora_cfg) or qlora.enabled(lora_cfg):
        return 0.0
    return base_bytes
