"""examples/quickstart.ipynb and examples/extensions.ipynb run top to bottom (so they cannot rot),
and show what they promise."""

import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
NOTEBOOK = os.path.join(EXAMPLES, "quickstart.ipynb")


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream" and o.name == "stdout":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            out.append(o.data.get("text/plain", ""))
    return "".join(out)


def _run(path: str) -> tuple:
    """Execute the notebook at `path` -> (the executed notebook, its code cells' text output)."""
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    # the installed package (pip install -e .), not a path hack
    assert not any("sys.path" in c.source for c in nb.cells if c.cell_type == "code")
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure
    return nb, "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
def test_quickstart_notebook_runs():
    nb, text = _run(NOTEBOOK)
    assert "CpuDevice(id=7)" in text  # 8 fake devices
    # the sharding table
    assert "embed_VD                 (264, 64)" in text and "(132, 16)" in text
    # restored onto data=4,model=2
    assert text.count("identical: True") == 2 and "(132, 64)" in text
    assert "resumed from step 40 on data=4,model=2" in text
    pngs = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(pngs) == 2  # the two loss plots
    assert len(_text(nb.cells[-2]).strip()) > 50  # the sample


@pytest.mark.slow
def test_extensions_notebook_runs():
    _, text = _run(os.path.join(EXAMPLES, "extensions.ipynb"))
    assert "8 devices" in text
    assert "registered mlp-lm: d_model 64" in text
    # the registered model's axes, sharded
    assert re.search(r"layers/0/up_DF +\(\('fsdp', 'context', 'expert'\), 'model'\)", text)
    assert "momentum sharded like its parameter: True" in text  # the optax optimizer's state
    assert "resumed from step 4; losses:" in text  # the iterable's position restored
    assert "params; collectives:" in text  # plan compiled it
