"""EleutherAI lm-evaluation-harness on a Brigade checkpoint: `python -m train.harness --model_args
ckpt=CKPT[,tokenizer=SPEC,mesh=SPEC,...] --tasks T [--include_path DIR] [lm_eval's other flags]`.

`BrigadeLM` is lm_eval's model "brigade" (registered when this module is imported). lm-eval 0.4.x
finds models only in its own registry (no entry points), so the `lm_eval` command does not know
"brigade": the launcher (train/cli/harness_launcher.py) imports the adapter and hands its arguments
to lm_eval's own command line (`--model brigade` is added when no --model is given). From Python:
`import train.harness` (or this module), then
`lm_eval.simple_evaluate(model="brigade", model_args={...}, ...)`, or pass a BrigadeLM instance.

CKPT is what `python -m train eval` and `sample` take (train/cli/checkpoint_model.py open_model: a
run, a checkpoint or a step directory, an HF import), rebuilt on `mesh` (default: every local device
on the data axis); the tokenizer is the one the checkpoint records (or `tokenizer=SPEC`).

Batching: requests are sorted by length, longest first (as lm_eval's HF model does), cut into
batches of `batch_size` rows (lm_eval's --batch_size; rounded up to the data-parallel degree, the
last batch padded with dummy rows) and the results returned in the requests' order. Each batch is
right-padded to a grid of lengths (multiples of 8 below 128, then 8 per power of two: 128, 144, ...,
256, 288, ...), so jit compiles a few shapes per task, not one per request; causal attention makes
right padding exact for the real tokens.

Generation uses the model's KV cache (models/model.py init_cache), whose write position is shared
by the rows: the batch's prompts are prefilled up to a grid length at most the shortest prompt,
then every row steps one token at a time, fed its own prompt's next token while it has one and its
sampled token after that (train/core/inference.py continue_prompts), so each row sees exactly its
own prompt.
"""

from __future__ import annotations

import re
import types

import jax
import numpy as np

from errors import UserError, check_number
from mesh.rules import axis_rules
from models import model
from train.cli.checkpoint_model import checkpoint_tokenizer, open_model
from train.core.inference import continue_prompts, token_logprobs
from train.data import chat, tokenizers

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
# without the `eval` extra the module still imports; main() says what to install
except ImportError:
    TemplateLM, register_model = object, None

MODEL_ARGS = (
    "ckpt",
    "tokenizer",
    "mesh",
    "dtype",
    "batch_size",
    "max_length",
    "max_gen_toks",
    "seed",
)
# lm_eval's own flags: devices and batches are ours
PASSED_BY_LM_EVAL = ("max_batch_size", "device")
# rows per call; tokens generated when a task names no max_gen_toks
DEFAULT_BATCH, DEFAULT_GEN = (8, 256)
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
# stages and sequence shards: the scoring forward and the KV cache here lay out neither
UNSUPPORTED_AXES = ("pipeline", "context")


def grid(n: int, up: bool) -> int:
    """`n` rounded up (or down, never below 1) to the length grid: multiples of 8 below 128, then 8
    lengths per power of two (128, 144, ..., 240, 256, 288, ...), so that padding adds at most 1/8
    of a long sequence and few shapes are compiled."""
    step = max(8, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step if up else max(1, n // step * step)


def _int_arg(name: str, value, low: int) -> int:
    """A model arg that is an integer >= low (lm_eval passes model args as text)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, str))
        or not re.fullmatch(r"-?\d+", str(value).strip())
    ):
        raise UserError(f"harness: model arg {name}={value!r}: expected an integer >= {low}")
    return check_number(f"harness: model arg {name}", int(value), int, f">={low}")


def _tokenizer(spec, meta: dict) -> tokenizers.Tokenizer:
    """tokenizer=SPEC, else the checkpoint's own (as `sample` reads it); refused when it records
    none."""
    return checkpoint_tokenizer(
        spec, meta, who="harness", how="model arg tokenizer=SPEC", required=True
    )


class BrigadeLM(TemplateLM):
    """lm_eval's LM over a Brigade checkpoint; model args as the module docstring and MODEL_ARGS
    say."""

    def __init__(
        self,
        ckpt=None,
        tokenizer=None,
        mesh=None,
        dtype=None,
        batch_size=None,
        max_length=None,
        max_gen_toks=DEFAULT_GEN,
        seed=0,
        **other,
    ):
        super().__init__()
        unknown = sorted(k for k in other if k not in PASSED_BY_LM_EVAL)
        if unknown:
            raise UserError(
                f"harness: unknown model arg {', '.join(unknown)}; valid: {', '.join(MODEL_ARGS)}"
            )
        if not ckpt:
            raise UserError(
                "harness: no checkpoint; give model arg ckpt=CKPT (a run, checkpoint or step"
                " directory, or an HF import)"
            )
        flags = {"parallelism.mesh": str(mesh).replace(";", ",")} if mesh else {}
        flags.update({"model.dtype": str(dtype)} if dtype else {})
        opened = open_model(str(ckpt), types.SimpleNamespace(**flags))
        self.tok = _tokenizer(tokenizer, opened.meta)
        self.cfg = opened.cfg.model
        self.setup = opened.setup()
        shape = dict(self.setup.mesh.shape)
        if any(shape.get(axis, 1) > 1 for axis in UNSUPPORTED_AXES):
            raise UserError(
                f"harness: mesh={mesh}: the {' and '.join(UNSUPPORTED_AXES)} axes are for training;"
                f" evaluate on data, fsdp, expert and model"
            )
        n = self.setup.mesh.size  # the batch sharding splits n rows into n / dp per shard
        dp = n // self.setup.batch_sharding.shard_shape((n, 1))[0]
        rows = (
            DEFAULT_BATCH
            if batch_size in (None, "auto") or str(batch_size).startswith("auto:")
            else _int_arg("batch_size", batch_size, 1)
        )
        self.rows = -(-rows // dp) * dp  # every data-parallel shard gets whole rows
        self._max_length = (
            _int_arg("max_length", max_length, 2)
            if max_length is not None
            else self.cfg.max_seq_len
        )
        if self._max_length > self.cfg.max_seq_len:
            raise UserError(
                f"harness: model arg max_length={self._max_length}: above the model's max_seq_len"
                f" {self.cfg.max_seq_len}"
            )
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        self.seed, self.draws = _int_arg("seed", seed, 0), 0
        self.params = opened.params(self.setup)
        self.checkpoint = opened.src.step_dir(opened.step)

    # -- what lm_eval's TemplateLM asks of a model --------------------------------------------
    @property
    def eot_token_id(self) -> int:
        # Brigade's documents end with it, so it also stands before a first token
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.describe()["id"]

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return [int(i) for i in self.tok.encode([string])[0]]

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    def chat_template(self, chat_template=False) -> str | None:
        return self.tok.chat_template

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt=True) -> str:
        if not self.tok.chat_template:
            raise UserError(
                "harness: --apply_chat_template: the tokenizer has no chat template (an HF model"
                " directory's chat_template.jinja or tokenizer_config.json holds one)"
            )
        return chat.render(
            self.tok, chat_history, add_generation_prompt, where="the harness's prompt"
        )

    # -- scoring ---------------------------------------------------------------------------------
    def _batches(self, items: list, length) -> list[tuple[list[int], list]]:
        """(original indices, items) in batches of self.rows, longest first (ties by content)."""
        order = sorted(range(len(items)), key=lambda i: (-length(items[i]), str(items[i])))
        return [
            (order[i : i + self.rows], [items[j] for j in order[i : i + self.rows]])
            for i in range(0, len(order), self.rows)
        ]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum of the continuation's log-probs, all greedy). A
        sequence longer than max_length + 1 loses its oldest context tokens."""
        out: list = [None] * len(pairs)
        windows = [(ctx + cont)[-(self.max_length + 1) :] for ctx, cont in pairs]
        for idx, batch in self._batches(windows, len):
            t = min(grid(max(len(w) - 1 for w in batch), up=True), self.max_length)
            tokens_BT, targets_BT = (
                np.zeros((self.rows, t), np.int32),
                np.zeros((self.rows, t), np.int32),
            )
            for r, w in enumerate(batch):
                tokens_BT[r, : len(w) - 1], targets_BT[r, : len(w) - 1] = w[:-1], w[1:]
            with jax.set_mesh(self.setup.mesh), axis_rules(self.setup.rules):
                logp_BT, greedy_BT = jax.device_get(
                    token_logprobs(self.cfg, self.params, tokens_BT, targets_BT)
                )
            for r, (i, w) in enumerate(zip(idx, batch)):
                n = len(w) - 1
                k = min(len(pairs[i][1]), n)  # the continuation: the last k targets
                out[i] = (float(logp_BT[r, n - k : n].sum()), bool(greedy_BT[r, n - k : n].all()))
        return out

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        results = self._score([(list(ctx), list(cont)) for _, ctx, cont in requests])
        for (strings, _, _), r in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document in disjoint windows of max_length tokens (lm_eval's rolling windows: every
        token predicted once, after the end-of-document token), the windows of all documents
        batched."""
        pairs, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
                ),
            ):
                pairs.append((ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._score(pairs)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------
    def _gen_settings(self, gen_kwargs: dict) -> tuple[list[str], int, float, int]:
        """A task's generation kwargs -> (stop strings, max_gen_toks, temperature, top_k)."""
        # lm_eval's names for max_gen_toks
        aliases = ("max_new_tokens", "max_tokens", "max_completion_tokens")
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS) - set(aliases))
        if gen_kwargs.get("top_p") not in (None, 1, 1.0):
            unknown.append(f"top_p={gen_kwargs['top_p']}")
        if unknown:
            raise UserError(
                f"harness: generation kwargs {', '.join(unknown)} are not supported; valid: "
                f"{', '.join(GEN_KWARGS)} (top_p only 1) and the aliases of max_gen_toks"
            )
        kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
        max_gen = int(kw["max_gen_toks"])
        if max_gen >= self.max_length:
            raise UserError(
                f"harness: max_gen_toks {max_gen} leaves no room for a prompt in max_length"
                f" {self.max_length}"
            )
        return (
            handle_stop_sequences(kw.get("until"), eos=None),
            max_gen,
            temperature,
            int(kw.get("top_k") or 0),
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not model.decodes(self.cfg):
            raise UserError(
                f"harness: model '{self.cfg.arch}' has no decoding cache (init_cache): it cannot"
                f" run generate_until tasks"
            )
        out: list = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # the requests of each distinct gen_kwargs, in order
            by_kwargs.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for members in by_kwargs.values():
            until, max_gen, temperature, top_k = self._gen_settings(requests[members[0]].args[1])
            prompts = [
                self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen) :]
                or [self.eot_token_id]
                for i in members
            ]
            for idx, batch in self._batches(prompts, len):
                texts = self._generate(batch, max_gen, temperature, top_k)
                for j, text in zip(idx, texts):
                    i = members[j]
                    out[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _generate(
        self, prompts: list[list[int]], max_gen: int, temperature: float, top_k: int
    ) -> list[str]:
        """Prompts of one batch -> their continuations' text, cut at the end-of-document token."""
        lengths = [len(p) for p in prompts]
        prefill = grid(min(lengths), up=False)
        spread = max(lengths) - prefill
        steps = min(
            (grid(spread, up=True) if spread else 0) + max_gen, self.cfg.max_seq_len - prefill
        )
        tokens_BT = np.zeros((self.rows, prefill + steps), np.int32)
        # dummy rows: generate from zeros, unread
        lengths_B = np.full((self.rows,), prefill, np.int32)
        for r, p in enumerate(prompts):
            tokens_BT[r, : len(p)], lengths_B[r] = p, len(p)
        # a fresh key per batch: the same seed and the same calls give the same text
        self.draws += 1
        key = jax.random.fold_in(jax.random.key(self.seed), self.draws)
        with jax.set_mesh(self.setup.mesh), axis_rules(self.setup.rules):
            toks_BN = np.asarray(
                jax.device_get(
                    continue_prompts(
                        self.cfg,
                        self.params,
                        tokens_BT,
                        lengths_B,
                        key,
                        prefill=prefill,
                        steps=steps,
                        temperature=temperature,
                        top_k=top_k,
                    )[0]
                )
            )
        texts = []
        for r, n in enumerate(lengths):
            new = [int(t) for t in toks_BN[r, n - prefill : n - prefill + max_gen]]
            texts.append(
                self.tok_decode(
                    new[: new.index(self.eot_token_id)] if self.eot_token_id in new else new
                )
            )
        return texts


if register_model is not None:
    register_model("brigade")(BrigadeLM)
