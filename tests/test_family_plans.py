"""`plan` on the published family presets at a mesh a user would run them on: each is priced
(formulas, no compile), fits the device, and (where every weight is sharded over every axis but
`data`) holds its parameters once across the devices: parameters per device x devices / data =
the model's count. For DeepSeek-V3 on its mesh that product is 652B against the model's 671B
without its MTP modules (683B with them), a gap not explained yet: it is only priced here."""

from __future__ import annotations

import json

import pytest

from models import flops
from models.presets import preset as build_preset
from plan.cli import main as plan_main

# preset, mesh, devices, global batch, sequence, whether the parameter product is checked
CASES = [
    ("gemma3-4b", "fsdp=8", 8, 32, 4096, True),
    ("gemma3-27b", "fsdp=8,model=8", 64, 64, 4096, True),
    ("qwen3-30b-a3b", "fsdp=8,expert=8", 64, 64, 4096, True),
    ("deepseek-v3", "expert=64,pipeline=2,fsdp=8,data=2", 2048, 2048, 4096, False),
]


@pytest.mark.parametrize("preset,mesh,devices,batch,seq,count_checked", CASES)
def test_plan_prices_each_family_preset(capsys, preset, mesh, devices, batch, seq, count_checked):
    argv = ["--model", preset, "--mesh", mesh, "--devices", str(devices), "--hardware", "h100"]
    argv += ["--batch-size", str(batch), "--seq-len", str(seq), "--json"]
    assert plan_main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["fits"] and r["devices"] == devices, r["memory"]
    assert r["t_flops_s"] > 0
    if not count_checked:
        return
    # `data` replicates the parameters; every other axis of these meshes shards them
    copies = r["sizes"]["data"]
    params = r["memory"]["params"] * devices / copies / 4  # float32 parameters
    want = flops.param_count(build_preset(preset))
    assert params == pytest.approx(want, rel=0.02), (params, want)
