"""The model on a run's setup without training: the mean held-out loss of parameters over batches
(the eval step, jitted once), a prompt continued with the KV cache, and for batches of requests
(the harness) each token's log-probability and right-padded prompts continued row by row. The
loop's evals and its closing sample, `python -m train eval`, `python -m train sample` and the
harness all run these, so what they report is what a run reports."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mesh.rules import axis_rules, logical_to_spec
from mesh.shard import entry_axes
from models import context, model
from models.sample import decode, generate
from train.core.batch_loss import eval_step
from train.core.setup import RunSetup
from train.core.shapes import batch_shards
from train.data.tokenizers import ByteTokenizer, Tokenizer


class Evaluator:
    """The mean loss of parameters over held-out batches on `s`'s mesh: train/core/batch_loss.py's
    eval_step (the run's own loss function, token losses weighted by the batch's loss mask), jitted
    once here: a fresh jax.jit per evaluation would retrace and recompile every time."""

    def __init__(self, s: RunSetup):
        self.setup = s
        self.step = jax.jit(
            functools.partial(eval_step, s.model_cfg, pipeline=s.cfg.pipeline, loss_fn=s.loss_fn)
        )

    def loss(self, params, batches) -> float:
        s = self.setup
        with (
            jax.set_mesh(s.mesh),
            axis_rules(s.rules),
            context.strategy(s.cfg.parallelism.context_strategy),
        ):
            sums = [self.step(params, b) for b in batches]
        total, count = np.sum([jax.device_get(x) for x in sums], axis=0)
        return float(total / max(count, 1.0))


def generate_on_mesh(s: RunSetup, params, prompt_BT: np.ndarray, key, **sampling) -> jax.Array:
    """models/sample.py's generate on `s`'s mesh -> the new tokens [B, max_new]; `sampling`:
    max_new, temperature, top_k."""
    replicate_acts = {k: () for k in s.rules}  # a batch of one cannot be split over devices
    with jax.set_mesh(s.mesh), axis_rules(replicate_acts):
        return generate(s.model_cfg, params, prompt_BT, key, **sampling)


def sampler_rules(mesh, rules: dict, rows: int) -> tuple[dict, int]:
    """The sampler's logical-axis rules for `rows` rows, and the devices the rows split over: the
    training batch's mesh axes (data, fsdp, ...) when `rows` divides by their devices, else none
    (1: every device samples every row). Every other activation is replicated: a decode step's are
    [rows, 1, ...], nothing else worth splitting. The parameters stay sharded as they train."""
    replicated = {k: () for k in rules}
    shards = batch_shards(mesh, rules)
    if rows % shards:
        return replicated, 1
    axes = entry_axes(logical_to_spec(("batch",), rules)[0])
    return {**replicated, "batch": axes, "logits_batch": axes}, shards


def sample_text(
    s: RunSetup,
    params,
    prompt: str,
    n_tokens: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> str:
    """`prompt` continued by `n_tokens` tokens, decoded (the byte tokenizer by default); what a run
    prints at its end."""
    tokenizer = tokenizer or ByteTokenizer()
    prompt_BT = tokenizer.encode([prompt or "\n"])[0][None, :].astype(np.int32)
    out_BN = generate_on_mesh(s, params, prompt_BT, jax.random.key(seed), max_new=n_tokens)
    return tokenizer.decode(np.asarray(jax.device_get(out_BN))[0])


@functools.partial(jax.jit, static_argnames=("cfg",))
def token_logprobs(cfg, params, tokens_BT, targets_BT):
    """-> (log p(target | the tokens up to it) [B,T] float32, whether the target is the argmax
    [B,T])."""
    logits_BTV, _ = model.apply(cfg, params, tokens_BT)
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return logp_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT


@functools.partial(
    jax.jit, static_argnames=("cfg", "prefill", "steps", "temperature", "top_k", "eos")
)
def continue_prompts(
    cfg,
    params,
    tokens_BT,
    lengths_B,
    key,
    *,
    prefill: int,
    steps: int,
    temperature: float,
    top_k: int,
    eos: int | None = None,
):
    """Right-padded prompts [B, prefill + steps] of `lengths_B` tokens (each >= prefill) -> (the
    tokens at positions prefill .. prefill + steps - 1 [B, steps]: the row's prompt while it lasts,
    then picked ones; the decode steps run). One prefill pass fills the cache; each step is one
    single-position pass (models/sample.py decode). With `eos`, the loop stops once every row has
    picked it, and a row's tokens after its first picked `eos` are `eos`. jax keys the trace by the
    function and its arguments, not by the axis rules in context: a process samples under one table
    (sampler_rules, or the run's), or jits a wrapper of its own per table."""
    b = tokens_BT.shape[0]
    cache = model.init_cache(cfg, b, prefill + steps)
    logits_BTV, cache = model.apply(
        cfg,
        params,
        tokens_BT[:, :prefill],
        jnp.broadcast_to(jnp.arange(prefill), (b, prefill)),
        cache,
    )
    return decode(
        cfg,
        params,
        logits_BTV[:, -1],
        cache,
        key,
        start=prefill,
        steps=steps,
        temperature=temperature,
        top_k=top_k,
        forced_BT=tokens_BT,
        lengths_B=lengths_B,
        eos=eos,
    )
