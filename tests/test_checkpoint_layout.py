"""checkpoint/layout.py: the format version a step records and the refusal of a newer one, the
parameters-only meta that export and the HF import write, and the per-replica layout read back
from a step's array list."""

import os

import numpy as np
import pytest

from checkpoint.layout import (
    FORMAT_VERSION,
    META_ITEM,
    STATE_ITEM,
    check_meta,
    is_params_only,
    params_only_meta,
    replica_layout,
)
from checkpoint.manager import Checkpointer
from errors import UserError
from train.core.config import build


def _params_only(tmp_path, **meta_changes) -> Checkpointer:
    config = build({"model.preset": "tiny"}).to_dict()
    ck = Checkpointer(str(tmp_path / "ck"), keep=0, async_save=False)
    ck.save(
        0,
        {"params": {"w": np.arange(4, dtype=np.float32)}},
        {**params_only_meta(0, config, exported_from="here"), **meta_changes},
    )
    ck.close()
    return Checkpointer(str(tmp_path / "ck"), keep=0, async_save=False)


def test_a_step_records_the_format_and_reads_back(tmp_path):
    ck = _params_only(tmp_path)
    step_dir = ck.step_dir(0)
    assert {STATE_ITEM, META_ITEM} <= set(os.listdir(step_dir))
    meta = ck.meta(0)
    assert (
        meta["format"] == FORMAT_VERSION
        and is_params_only(meta)
        and meta["exported_from"] == "here"
    )
    assert meta["model"]["n_layers"] == build({"model.preset": "tiny"}).model.n_layers


def test_a_newer_format_is_refused_in_one_line_and_never_set_aside(tmp_path):
    ck = _params_only(tmp_path, format=FORMAT_VERSION + 1)
    with pytest.raises(
        UserError, match=rf"format {FORMAT_VERSION + 1} was written by a newer Brigade.*upgrade"
    ):
        ck.meta(0)
    assert ck.all_steps() == [0]  # still there, untouched
    # a step without the field (written before it existed) is format 1
    assert check_meta({"step": 3}, "d") == {"step": 3}
    with pytest.raises(UserError, match=f"d: checkpoint format {FORMAT_VERSION + 1} "):
        check_meta({"step": 3, "format": FORMAT_VERSION + 1}, "d")


@pytest.mark.parametrize(
    "arrays, want",
    [
        ([("params/w", (4, 4), "float32"), ("opt_state/0/mu/w", (4, 4), "float32")], (None, False)),
        ([("params/w", (4, 4), "float32"), ("residual/w", (2, 4, 4), "float32")], (2, False)),
        ([("drift/w", (4, 4, 4), "float32"), ("drift/b", (4, 4), "float32")], (4, True)),
    ],
)
def test_replica_layout_reads_the_leading_dim_of_per_replica_arrays(arrays, want):
    assert replica_layout(arrays) == want


def _saved(tmp_path, name: str, params: dict, config: dict) -> Checkpointer:
    """A step 2 holding `params` (and the step), saved with `config` in its meta as a run saves."""
    ck = Checkpointer(str(tmp_path / name), keep=0, async_save=False)
    ck.save(2, {"step": np.int32(2), "params": params}, {"step": 2, "config": config})
    ck.close()
    return Checkpointer(str(tmp_path / name), create=False)


def _zeros(tree) -> dict:
    import jax

    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), tree)


def test_lora_adapters_and_whole_models_given_for_each_other_say_so(tmp_path):
    """A LoRA run's checkpoint (its params are the adapters) given to a whole model's resume or
    --init-from names the base and the flags, instead of listing every array that differs; a
    whole model's checkpoint given to a LoRA run says what it holds and how to adapt it."""
    import jax

    from models import model
    from train.core import lora

    lora_cfg = build(
        {
            "model.preset": "tiny",
            "lora.rank": 4,
            "lora.targets": "q,v",
            "checkpoint.init_from": "/bases/tiny-hf/0",
            "lora.base_fingerprint": "0123456789abcdef",
        }
    )
    adapters = lora.abstract_adapters(lora_cfg.model, lora_cfg.lora)
    ck = _saved(tmp_path, "lora", _zeros(adapters), lora_cfg.to_dict())
    whole = {
        "step": jax.ShapeDtypeStruct((), np.int32),
        "params": model.abstract_params(lora_cfg.model),
    }
    for read in (
        lambda: ck.check_compatible(2, whole),
        lambda: ck.restore_params(2, whole["params"]),
    ):
        with pytest.raises(UserError) as e:
            read()
        line = str(e.value)
        assert line.startswith(f"checkpoint {ck.step_dir(2)} holds LoRA adapters (rank 4"), line
        assert "trained on the base /bases/tiny-hf/0" in line and "arrays differ" not in line, line
        assert "--lora.rank 4 --lora.alpha 16.0 --lora.targets q,v" in line, line
        assert f"python -m checkpoint hf export {ck.step_dir(2)}" in line and "\n" not in line

    full = _saved(
        tmp_path, "full", _zeros(whole["params"]), build({"model.preset": "tiny"}).to_dict()
    )
    with pytest.raises(UserError) as e:
        full.check_compatible(2, {"step": whole["step"], "params": adapters})
    assert str(e.value) == (
        f"checkpoint {full.step_dir(2)} holds a whole model's training state, not LoRA adapters:"
        f" to train adapters on it as the frozen base, start a new run with --init-from"
        f" {full.step_dir(2)} and --lora.rank; to continue training it whole, leave --lora.rank"
        f" at 0"
    )

    rank8 = build({"model.preset": "tiny", "lora.rank": 8, "lora.targets": "q,v"})
    with pytest.raises(
        UserError, match=r"holds LoRA adapters of other shapes than this run's \(--lora.rank 4 "
    ):
        ck.check_compatible(
            2, {"step": whole["step"], "params": lora.abstract_adapters(rank8.model, rank8.lora)}
        )
    # a model of other dims (no LoRA on either side) still lists the arrays that differ
    wide = build({"model.preset": "tiny", "model.d_model": 128})
    with pytest.raises(UserError, match=r"does not match this model config \(\d+ arrays differ\)"):
        full.check_compatible(
            2, {"step": whole["step"], "params": model.abstract_params(wide.model)}
        )
