"""Weights holding NaN or infinity entering from elsewhere: an HF import (`hf import`,
`from_pretrained`) refuses them in one line naming the tensor (exit 2, nothing written) unless
--allow-nonfinite; `--init-from` refuses such a checkpoint naming the parameter. Before, both
went through silently and the run or `eval` printed `loss nan`."""

import os

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")

from safetensors.numpy import load_file, save_file

from checkpoint import hf
from checkpoint.__main__ import main as checkpoint_main
from checkpoint.hf_files import SAFETENSORS
from errors import UserError
from models import model
from models.config import ModelConfig
from models.hf import Model

CFG = ModelConfig(
    vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64
).validate()
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama in HF layout, written by Brigade itself (no torch needed)."""
    root = tmp_path_factory.mktemp("hf")
    params = jax.device_get(model.init(CFG, jax.random.key(0)))
    hf.save_pretrained(Model(CFG, params), str(root / "good"))
    return root / "good"


def _damaged(hf_dir, tmp_path, name: str, value: float) -> str:
    """A copy of `hf_dir` whose tensor `name` holds `value` at one place."""
    out = tmp_path / "hf"
    out.mkdir()
    for f in os.listdir(hf_dir):
        (out / f).write_bytes((hf_dir / f).read_bytes())
    tensors = load_file(str(out / SAFETENSORS))
    tensors[name] = tensors[name].copy()
    tensors[name][1, 2] = value
    save_file(tensors, str(out / SAFETENSORS), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize(
    "name, value, dtype",
    [
        (Q_PROJ, np.nan, "float32"),
        ("model.embed_tokens.weight", -np.inf, "float32"),
        # finite in the file, infinite once cast: float32's top beyond bfloat16's
        (Q_PROJ, 3.4e38, "bfloat16"),
    ],
    ids=["nan", "inf", "overflows-bfloat16"],
)
def test_import_refuses_nonfinite_weights_naming_the_tensor(
    hf_dir, tmp_path, capsys, name, value, dtype
):
    src, out = _damaged(hf_dir, tmp_path, name, value), str(tmp_path / "ckpt")
    assert checkpoint_main(["hf", "import", src, "--out", out, "--dtype", dtype]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert f"tensor {name}: 1 of " in err and "NaN or infinite" in err, err
    assert "--allow-nonfinite" in err and not os.path.exists(out)
    with pytest.raises(UserError, match=f"tensor {name}: 1 of"):
        hf.from_pretrained(src, dtype)


def test_allowed_import_then_init_from_refuses_naming_the_parameter(hf_dir, tmp_path):
    from train.core.config import build
    from train.core.setup import abstract_state
    from train.run import resume
    from train.run.loop import Trainer

    src, out = _damaged(hf_dir, tmp_path, Q_PROJ, np.nan), str(tmp_path / "ckpt")
    assert checkpoint_main(["hf", "import", src, "--out", out, "--allow-nonfinite"]) == 0
    assert np.isnan(
        hf.from_pretrained(src, allow_nonfinite=True).params["blocks"]["attn"]["wq_DNH"]
    ).any()
    cfg = build(
        {
            "parallelism.mesh": "fsdp=2",
            "train.seq_len": 32,
            "train.batch_size": 2,
            "checkpoint.init_from": out,
            "logging.run_dir": str(tmp_path / "run"),
        },
        os.path.join(out, "model.yaml"),
    )
    with pytest.raises(
        UserError, match=r"--init-from .*: parameter blocks/attn/wq_DNH holds NaN or infinity"
    ):
        s = Trainer(cfg, devices=jax.devices()[:2]).setup
        resume.init_from(s, abstract_state(s).params, out)


def test_lora_base_with_nonfinite_weights_is_refused(hf_dir, tmp_path):
    """A LoRA run reads its frozen --init-from base itself (train/core/lora.py), not through the
    --init-from restore: the same check applies there."""
    from train.core import lora
    from train.core.config import build
    from train.run.loop import Trainer

    src, out = _damaged(hf_dir, tmp_path, Q_PROJ, np.nan), str(tmp_path / "ckpt")
    assert checkpoint_main(["hf", "import", src, "--out", out, "--allow-nonfinite"]) == 0
    cfg = build(
        {
            "parallelism.mesh": "fsdp=2",
            "train.seq_len": 32,
            "train.batch_size": 2,
            "checkpoint.init_from": out,
            "lora.rank": 4,
            "logging.run_dir": str(tmp_path / "run"),
        },
        os.path.join(out, "model.yaml"),
    )
    with pytest.raises(
        UserError, match=r"--init-from .*: parameter blocks/attn/wq_DNH holds NaN or infinity"
    ):
        s = Trainer(cfg, devices=jax.devices()[:2]).setup
        lora.load_base(cfg, s.mesh, s.rules, s.base_shardings, {})
