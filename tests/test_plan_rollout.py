"""`plan` with --objective grpo prices the rollout (plan/rollout_memory.py): its figure against the
compiled sampler program's memory (argument + temp bytes: the parameters' shards, the prompts, the
KV cache and the activations) on fsdp=4 and data=2,fsdp=2; the compiled report and the formula
estimate carry it and count it into the peak as the larger of the update and the rollout, and it
grows linearly with --post.group_size; --search prices it on every mesh. Fake CPU devices."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

from mesh.build import start_mesh
from mesh.rules import axis_rules
from models import model
from plan import search
from plan.estimate import evaluate
from plan.hardware import get as hardware
from plan.render import render
from plan.report import analyze
from plan.rollout_memory import merged_copy, rollout_memory
from plan.run_spec import local_bytes
from train.core import inference
from train.core.config import build
from train.core.setup import setup

# plan over the compiled sampler: measured 1.03-1.22 on tiny variants (d 64-256, V 264-4096,
# float32 and bfloat16, fsdp, data x fsdp, fsdp x model); XLA reuses some of what the formula adds
LOW, HIGH = 0.95, 1.3


def grpo_cfg(mesh: str, group: int = 4, seq: int = 64, new: int = 16, **over):
    return build(
        {
            "model.preset": "tiny",
            "parallelism.mesh": mesh,
            "train.batch_size": 4,
            "train.seq_len": seq,
            "post.objective": "grpo",
            "post.group_size": group,
            "post.max_new_tokens": new,
            "checkpoint.init_from": "unused",
            **over,
        }
    )


def compiled_sampler(s, rows: int, width: int, new: int):
    """continue_prompts compiled as the rollout runs it, at plan's shapes: every prompt width -
    new tokens long, the parameters sharded as they train."""
    params = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        model.abstract_params(s.model_cfg),
        s.state_shardings.params,
    )
    rules, _ = inference.sampler_rules(s.mesh, s.rules, rows)
    fn = jax.jit(
        functools.partial(inference.continue_prompts.__wrapped__),
        static_argnames=("cfg", "prefill", "steps", "temperature", "top_k", "eos"),
    )
    tokens = jax.ShapeDtypeStruct((rows, width), np.int32)
    lengths = jax.ShapeDtypeStruct((rows,), np.int32)
    kw = dict(prefill=width - new, steps=new, temperature=1.0, top_k=0, eos=0)
    with jax.set_mesh(s.mesh), axis_rules(rules):
        lowered = fn.lower(s.model_cfg, params, tokens, lengths, jax.random.key(0), **kw)
    return lowered.compile(), sum(local_bytes(x) for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "mesh,over",
    [("fsdp=4", {}), ("data=2,fsdp=2", {"model.d_model": 128, "train.seq_len": 128})],
)
def test_rollout_figure_matches_the_compiled_sampler(mesh, over):
    cfg = grpo_cfg(mesh, **over)
    n = math.prod(int(p.partition("=")[2]) for p in mesh.split(","))
    s = setup(cfg, start_mesh(cfg.parallelism, jax.devices()[:n]))
    t, post = cfg.train, cfg.post
    rows = t.batch_size * post.group_size
    compiled, params_b = compiled_sampler(s, rows, t.seq_len, post.max_new_tokens)
    mem = compiled.memory_analysis()
    got = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    parts = rollout_memory(
        cfg.model, rows, t.seq_len, post.max_new_tokens, s.mesh, s.rules, s.compute_dtype
    )
    assert parts["split"] == 4
    ratio = (params_b + parts["total"]) / got
    assert LOW <= ratio <= HIGH, (mesh, ratio, parts, got)


def test_grpo_plan_includes_the_rollout_and_its_peak():
    cfg = grpo_cfg("fsdp=4")
    s = setup(cfg, start_mesh(cfg.parallelism, jax.devices()[:4]))
    m = analyze(s)["memory"]
    assert m["rollout_bytes"] == m["rollout_parts"]["total"] > 0
    held = m["params_bytes"] + m["optimizer_bytes"]
    assert m["rollout_live_bytes"] == held + m["rollout_bytes"]
    assert m["peak_with_rollout_bytes"] == max(m["update_live_bytes"], m["rollout_live_bytes"])
    text = render(analyze(s), False)
    assert "  rollout " in text and "peak+rollout" in text
    # LoRA: the sampler reads the base with the adapters merged, one more copy of the base's
    lora_cfg = grpo_cfg("fsdp=4", **{"lora.rank": 4, "lora.alpha": 8.0})
    m = analyze(setup(lora_cfg, start_mesh(lora_cfg.parallelism, jax.devices()[:4])))["memory"]
    held = m["params_bytes"] + m["optimizer_bytes"] + 2 * m["base_bytes"]
    assert m["base_bytes"] > 0 and m["rollout_live_bytes"] == held + m["rollout_bytes"]
    nf4 = dataclasses.replace(lora_cfg.lora, base_dtype="nf4", block_size=32)
    assert merged_copy(nf4, m["base_bytes"]) == 0  # QLoRA merges per layer as it runs
    lm = build({"model.preset": "tiny", "parallelism.mesh": "fsdp=4", "train.seq_len": 64})
    lm_report = analyze(setup(lm, start_mesh(lm.parallelism, jax.devices()[:4])))
    assert "rollout_bytes" not in lm_report["memory"]


def test_the_rollout_grows_linearly_with_the_group_and_counts_into_the_total():
    hw = hardware("h100", 8, "bfloat16")

    def memory(group: int, objective: str = "grpo") -> dict:
        over = {"post.objective": objective, "train.batch_size": 8}
        cfg = grpo_cfg("fsdp=8", group, seq=256, new=64, **over)
        t = cfg.train
        row = evaluate(
            cfg.model, {"fsdp": 8}, hw, t.batch_size, t.seq_len, train_cfg=t, post_cfg=cfg.post
        )
        return row["memory"]

    r2, r4, r8 = (memory(g)["rollout"] for g in (2, 4, 8))
    assert r2 < r4 < r8
    assert r8 - r4 == 2 * (r4 - r2)  # the gathered weights fixed, every other part per row
    m, lm = memory(8), memory(8, "lm")
    assert "rollout" not in lm
    held = lm["params"] + lm["optimizer"]
    assert m["total"] == max(lm["total"], held + m["rollout"])
    # --search prices every mesh with it
    cfg = grpo_cfg("fsdp=8", 8, seq=256, new=64, **{"train.batch_size": 8})
    t = cfg.train
    rows = search.search(cfg.model, 8, hw, t.batch_size, t.seq_len, train_cfg=t, post_cfg=cfg.post)
    assert rows and all(r["memory"]["rollout"] > 0 for r in rows)
    fsdp8 = next(r for r in rows if r["mesh"] == "fsdp=8")
    assert fsdp8["memory"]["rollout"] == m["rollout"]
