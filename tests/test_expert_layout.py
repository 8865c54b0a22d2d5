"""The MoE experts' layout over the FSDP axes (mesh/expert_layout.py): what auto picks by the bytes
each layout moves, a layout the user wrote kept, bad input named in one line; and the run's rules
and start line (the step's equivalence: tests/test_equivalence_moe.py; its collectives:
tests/test_plan.py)."""

import os
import subprocess
import sys

import pytest
from cpu_env import cpu_env

from errors import UserError
from mesh.expert_layout import describe, expert_layout, held_bytes, moved_bytes
from mesh.rules import make_rules

# peer.py's MoE shape: d 256, 8 experts of width 512, top-2, 128 tokens per device
MOE = dict(
    n_experts=8,
    k=2,
    tokens=128,
    d_model=256,
    d_ff=512,
    act_bytes=4,
    grad_bytes=4,
    exchange="fixed",
    capacity_factor=1.25,
    remat=True,
)
SIZES = {"fsdp": 4, "expert": 2}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_moved_bytes_count_the_exchange_and_the_weights():
    rules = make_rules()
    # sliced: 4 local experts' weights (3 x 256 x 512 each) gathered twice in float32 and reduced
    # once, 3/4 of them moving; tokens over expert=2: 2 x 128 x 2 rows, 2 directions x 3 passes
    weights = 4 * 3 * 256 * 512
    exchange = 2 * 3 * (2 * 128 * 2) * 256 * 4 / 2
    assert moved_bytes(rules, SIZES, **MOE) == exchange + weights * (2 * 4 + 4) * 3 / 4
    # whole: no weight moves; 8 x 128 x 1 rows over 8 devices
    whole = {**rules, "experts": ("expert", "fsdp"), "expert_embed": ("context",)}
    assert moved_bytes(whole, SIZES, **MOE) == 2 * 3 * (8 * 128) * 256 * 4 * 7 / 8
    # the ragged exchange moves the real rows only, whatever the group
    ragged = {**MOE, "exchange": "ragged"}
    assert moved_bytes(whole, SIZES, **ragged) == 2 * 3 * 128 * 2 * 256 * 4 * 7 / 8


def test_auto_takes_whole_experts_where_they_move_fewer_bytes():
    rules = make_rules()
    got = expert_layout(rules, "auto", SIZES, **MOE)
    assert got["experts"] == ("expert", "fsdp") and got["expert_embed"] == ("context",)
    # small experts, many tokens: gathering the weights moves less
    small = {**MOE, "d_ff": 64, "d_model": 64, "tokens": 2048}
    assert expert_layout(rules, "auto", SIZES, **small) == rules
    assert expert_layout(rules, "on", SIZES, **small)["experts"] == ("expert", "fsdp")
    assert expert_layout(rules, "off", SIZES, **MOE) == rules
    # no FSDP axis to spread over, or a dense model: unchanged
    assert expert_layout(rules, "on", {"expert": 8}, **MOE) == rules
    assert expert_layout(rules, "on", SIZES, **{**MOE, "n_experts": 0}) == rules
    # the devices would not divide the experts: auto keeps them sliced
    assert expert_layout(rules, "auto", {"fsdp": 8, "expert": 2}, **MOE) == rules


def test_auto_keeps_slices_where_whole_experts_would_hold_more():
    """DeepSeek-V3's layer (256 experts of width 2,048, top-8, d 7,168) on GPUs, 4,096 tokens per
    device, ragged exchange: over expert=8 x fsdp=32 whole experts move fewer bytes (no weight
    moves), but their worst-case receive buffer (256 devices x 4,096 tokens x 1 row) outweighs the
    sliced layout's (8 x 4,096 x 8 rows) plus its 32 gathered experts."""
    ds = dict(
        n_experts=256,
        k=8,
        tokens=4096,
        d_model=7168,
        d_ff=2048,
        act_bytes=2,
        grad_bytes=2,
        exchange="ragged",
        capacity_factor=1.0,
        remat=True,
    )
    sizes, rules = {"expert": 8, "fsdp": 32}, make_rules()
    whole = expert_layout(rules, "on", sizes, **ds)
    assert moved_bytes(whole, sizes, **ds) < moved_bytes(rules, sizes, **ds)
    assert held_bytes(whole, sizes, **ds) == 256 * 4096 * 7168 * 2
    assert held_bytes(rules, sizes, **ds) == (8 * 4096 * 8 * 7168 + 32 * 3 * 7168 * 2048) * 2
    assert expert_layout(rules, "auto", sizes, **ds) == rules
    # Mixtral's layer (8 experts of width 14,336, top-2, d 4,096) on fsdp=8: one whole expert per
    # GPU holds a buffer of 8 x 4,096 rows against 2 x 4,096 rows and 8 gathered experts
    mx = {**ds, "n_experts": 8, "k": 2, "d_model": 4096, "d_ff": 14336}
    assert expert_layout(rules, "auto", {"fsdp": 8}, **mx)["experts"] == ("expert", "fsdp")


def test_auto_keeps_a_layout_the_user_wrote():
    rules = make_rules("expert_embed=fsdp")
    assert expert_layout(rules, "auto", SIZES, **MOE) == rules


def test_on_names_what_does_not_divide():
    with pytest.raises(UserError) as e:
        expert_layout(make_rules(), "on", {"fsdp": 8, "expert": 2}, **MOE)
    msg = str(e.value)
    assert "model.n_experts=8" in msg and "expert=2 x fsdp=8 = 16" in msg and "\n" not in msg


def test_describe():
    rules = make_rules()
    whole = expert_layout(rules, "on", SIZES, **MOE)
    assert (
        describe(whole, "on", SIZES)
        == "experts whole over expert=2 x fsdp=4 (experts_over_fsdp on)"
    )
    assert (
        describe(rules, "off", SIZES)
        == "experts over expert=2, sliced over fsdp=4 (experts_over_fsdp off)"
    )
    assert describe(rules, "auto", {"expert": 8}) == ""


def test_cli_bad_value_is_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "train", "--parallelism.experts_over_fsdp", "maybe", "--steps", "1"],
        cwd=ROOT,
        env=cpu_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--parallelism.experts_over_fsdp 'maybe': valid: auto, on, off" in r.stderr
