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
from train.config import build


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
