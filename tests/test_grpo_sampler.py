"""GRPO's sampler (train/core/inference.py continue_prompts on models/sample.py decode): the R rows
split over the batch's devices (sampler_rules) sample what replicated rows sample, greedy and with
temperature, on fsdp=4 and data=2,fsdp=2, and the compiled program's KV cache holds R / split rows
a device; the decode loop stopped at EOS gives the full-length loop's tokens up to each row's first
picked EOS and EOS after it, in fewer steps when every row ends early. Fake CPU devices."""

from __future__ import annotations

import functools
import math
import re

import jax
import numpy as np
import pytest

from mesh.build import start_mesh
from mesh.rules import axis_rules
from models import model
from train.core import inference
from train.core.config import build
from train.core.setup import setup

R, WIDTH, PREFILL = 16, 24, 4
VOCAB = 32  # small: some token ends every row early
STATIC = ("cfg", "prefill", "steps", "temperature", "top_k", "eos")


def fresh_sampler():
    """continue_prompts jitted anew: jax keys its traces by the function, not by the axis rules in
    context, so a comparison of two rule tables needs two functions."""
    return jax.jit(
        functools.partial(inference.continue_prompts.__wrapped__), static_argnames=STATIC
    )


@functools.lru_cache(maxsize=4)
def run_setup(mesh: str):
    over = {
        "model.preset": "tiny",
        "model.dtype": "float32",
        "model.param_dtype": "float32",
        "model.vocab_size": VOCAB,
        "parallelism.mesh": mesh,
        "train.batch_size": 4,
        "train.seq_len": 32,
        "post.objective": "grpo",
        "post.group_size": 4,
        "checkpoint.init_from": "unused",
    }
    cfg = build(over)
    n = math.prod(int(part.partition("=")[2]) for part in mesh.split(","))
    s = setup(cfg, start_mesh(cfg.parallelism, jax.devices()[:n]))
    params = model.init(cfg.model, jax.random.key(0))
    params["lm_head_DV"] = params["lm_head_DV"] * 20.0  # clear margins: no near-tie argmaxes
    return s, jax.device_put(params, s.state_shardings.params)


def prompts(seed: int = 0, group: int = 1):
    """R right-padded prompts of PREFILL to PREFILL + 3 tokens, each repeated `group` times (as
    GRPO's groups are)."""
    rng = np.random.default_rng(seed)
    tokens_RW = rng.integers(0, VOCAB, (R // group, WIDTH)).astype(np.int32)
    lengths_R = rng.integers(PREFILL, PREFILL + 4, R // group).astype(np.int32)
    return np.repeat(tokens_RW, group, 0), np.repeat(lengths_R, group)


def sample(s, params, rules, tokens_RW, lengths_R, temperature, eos=None, fn=None):
    """-> (tokens [R, steps], decode steps run, the compiled program)."""
    fn = fn or fresh_sampler()
    args = (s.model_cfg, params, tokens_RW, lengths_R, jax.random.key(7))
    kw = dict(prefill=PREFILL, steps=WIDTH - PREFILL, temperature=temperature, top_k=0, eos=eos)
    with jax.set_mesh(s.mesh), axis_rules(rules):
        compiled = fn.lower(*args, **kw).compile()
        out_RS, steps = fn(*args, **kw)
    return np.asarray(out_RS), int(steps), compiled


def cache_rows(compiled, s) -> set[int]:
    """The row counts of the KV-cache buffers [L, rows, WIDTH, K, H] in the compiled program."""
    m = s.model_cfg
    shape = rf"f32\[{m.n_layers},(\d+),{WIDTH},{m.n_kv_heads},{m.head_dim}\]"
    return {int(x) for x in re.findall(shape, compiled.as_text())}


@pytest.mark.parametrize("mesh", ["fsdp=4", "data=2,fsdp=2"])
def test_rows_split_over_the_batch_sample_what_replicated_rows_do(mesh):
    s, params = run_setup(mesh)
    split_rules, split = inference.sampler_rules(s.mesh, s.rules, R)
    assert split == 4
    replicated = {k: () for k in s.rules}
    tokens_RW, lengths_R = prompts()
    for temperature in (0.0, 1.0):
        want, _, whole = sample(s, params, replicated, tokens_RW, lengths_R, temperature)
        got, _, split_prog = sample(s, params, split_rules, tokens_RW, lengths_R, temperature)
        np.testing.assert_array_equal(got, want, err_msg=f"{mesh}, temperature {temperature}")
        assert cache_rows(whole, s) == {R} and cache_rows(split_prog, s) == {R // split}
        # the cache is the program's largest buffer here: a device's temp shrinks by at least 3/4
        # of one copy of it
        m = s.model_cfg
        cache = 2 * m.n_layers * R * WIDTH * m.n_kv_heads * m.head_dim * 4
        saved = whole.memory_analysis().temp_size_in_bytes
        saved -= split_prog.memory_analysis().temp_size_in_bytes
        assert saved >= cache * (1 - 1 / split), (saved, cache)
    # with temperature the draws differ by row: not one token repeated down the column
    assert len({tuple(row) for row in got}) == R


def test_sampler_rules_replicate_rows_that_do_not_divide():
    s, _ = run_setup("fsdp=4")
    rules, split = inference.sampler_rules(s.mesh, s.rules, 6)
    assert split == 1 and all(v == () for v in rules.values())
    rules, split = inference.sampler_rules(s.mesh, s.rules, 8)
    assert split == 4 and rules["batch"] == ("data", "fsdp", "expert")
    assert all(v == () for k, v in rules.items() if k not in ("batch", "logits_batch"))


def first_picked(out_RS, lengths_R, token: int) -> np.ndarray:
    """Each row's first column holding `token` at or after its prompt's end (S: none)."""
    s = out_RS.shape[1]
    picked_RS = PREFILL + np.arange(s)[None, :] >= lengths_R[:, None]
    hit_RS = picked_RS & (out_RS == token)
    return np.where(hit_RS.any(1), hit_RS.argmax(1), s)


def common_early_token(out_RS, lengths_R) -> int:
    """The token every row picks soonest (the smallest last first-occurrence)."""
    candidates = np.unique(out_RS)
    return int(min(candidates, key=lambda t: first_picked(out_RS, lengths_R, t).max()))


@pytest.mark.parametrize("mesh", ["fsdp=4", "data=2,fsdp=2"])
def test_stopping_at_eos_keeps_the_tokens(mesh):
    """16 distinct prompts: with EOS set, each row's tokens are the full-length loop's up to its
    first picked EOS, EOS after; an EOS inside a prompt does not end the row; the loop runs until
    the last row's EOS."""
    s, params = run_setup(mesh)
    rules, _ = inference.sampler_rules(s.mesh, s.rules, R)
    tokens_RW, lengths_R = prompts(1)
    steps, fn = WIDTH - PREFILL, fresh_sampler()
    for temperature in (0.0, 1.0):
        full_RS, n, _ = sample(s, params, rules, tokens_RW, lengths_R, temperature, fn=fn)
        assert n == steps
        eos = common_early_token(full_RS, lengths_R)
        long = int(np.argmax(lengths_R))
        tokens_RW[long, PREFILL] = eos  # in the prompt: kept, and not an end
        full_RS, _, _ = sample(s, params, rules, tokens_RW, lengths_R, temperature, fn=fn)
        got_RS, n, _ = sample(s, params, rules, tokens_RW, lengths_R, temperature, eos, fn)
        first_R = first_picked(full_RS, lengths_R, eos)
        assert n == min(steps, first_R.max() + 1), (n, first_R)
        want_RS = np.where(np.arange(steps)[None, :] > first_R[:, None], eos, full_RS)
        np.testing.assert_array_equal(got_RS, want_RS, err_msg=f"temperature {temperature}")
        assert got_RS[long, 0] == eos


@pytest.mark.parametrize("mesh", ["fsdp=4", "data=2,fsdp=2"])
def test_the_loop_stops_once_every_row_has_ended(mesh):
    """Greedy, two prompts eight times each (GRPO's groups), EOS a token both continuations pick
    at different steps: the loop stops after the later one, fewer steps than the full length."""
    s, params = run_setup(mesh)
    rules, _ = inference.sampler_rules(s.mesh, s.rules, R)
    steps, fn = WIDTH - PREFILL, fresh_sampler()
    for seed in range(20):  # the first prompts whose continuations share a token (seed 2)
        tokens_RW, lengths_R = prompts(seed, group=8)
        full_RS, _, _ = sample(s, params, rules, tokens_RW, lengths_R, 0.0, fn=fn)
        eos = common_early_token(full_RS, lengths_R)
        first_R = first_picked(full_RS, lengths_R, eos)
        if first_R.max() < steps - 1 and first_R.min() < first_R.max():
            break
    else:
        raise AssertionError("no two prompts of 20 share a token in their continuations")
    got_RS, n, _ = sample(s, params, rules, tokens_RW, lengths_R, 0.0, eos, fn)
    assert n == first_R.max() + 1 < steps
    want_RS = np.where(np.arange(steps)[None, :] > first_R[:, None], eos, full_RS)
    np.testing.assert_array_equal(got_RS, want_RS)
