"""The new families through the commands a user runs: `hf import` of a tiny random transformers
checkpoint writes a Brigade checkpoint whose arrays are the params of the model.yaml it writes (the
dense first layers, the MTP modules, the tail layers after a layer pattern's last repeat), and
`hf export` of that checkpoint gives back the source's tensors bit for bit, which transformers
loads to the source's logits (DeepSeek-V3 with its MTP layer, Gemma 3 with two tail layers)."""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# the imports below wait for the skips above (E402): without transformers and torch nothing runs
from hf_moe_models import make_deepseek  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from test_hf import tokens, torch_logits  # noqa: E402
from test_hf_gemma import CASES as GEMMA_CASES  # noqa: E402
from test_hf_gemma import make_gemma  # noqa: E402

from checkpoint.__main__ import describe  # noqa: E402
from checkpoint.__main__ import main as checkpoint_main  # noqa: E402
from checkpoint.hf_files import SAFETENSORS  # noqa: E402
from mesh.shard import path_names  # noqa: E402
from models import model as model_lib  # noqa: E402
from train.core.config import build  # noqa: E402


def make(family, path):
    if family == "deepseek_v3":
        return make_deepseek(path)[0]
    return make_gemma(path, family, **GEMMA_CASES[family][0])


@pytest.mark.parametrize(
    "family,stacks",
    [("deepseek_v3", {"first_blocks", "moe_blocks", "mtp"}), ("gemma3_text", {"tail_blocks"})],
)
def test_hf_import_then_export_gives_the_source_back(tmp_path, capsys, family, stacks):
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    ref_model = make(family, src)
    assert checkpoint_main(["hf", "import", str(src), "--out", str(ckpt)]) == 0
    assert "--init-from" in capsys.readouterr().out
    info = describe(str(ckpt))
    cfg = build({"train.seq_len": 32}, yaml_path=str(ckpt / "model.yaml")).model
    want = {
        f"params/{n}": list(s.shape)
        for n, s in path_names(
            model_lib.abstract_params(cfg), is_leaf=lambda x: hasattr(x, "shape")
        )
    }
    assert {a["name"]: a["shape"] for a in info["arrays"]} == want
    assert stacks <= {n.split("/")[1] for n in want}, sorted(want)

    assert checkpoint_main(["hf", "export", str(ckpt), "--out", str(out)]) == 0
    theirs, ours = load_file(str(src / SAFETENSORS)), load_file(str(out / SAFETENSORS))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(reloaded) is type(ref_model)
    toks = tokens()
    np.testing.assert_allclose(torch_logits(reloaded, toks), torch_logits(ref_model, toks))
