"""examples/quickstart.ipynb runs top to bottom (so it cannot rot), and shows what it promises."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.ipynb")


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream" and o.name == "stdout":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            out.append(o.data.get("text/plain", ""))
    return "".join(out)


@pytest.mark.slow
def test_quickstart_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "CpuDevice(id=7)" in text                                        # 8 fake devices
    assert "embed_VD                 (264, 64)" in text and "(132, 16)" in text  # the sharding table
    assert text.count("identical: True") == 2 and "(132, 64)" in text       # restored onto data=4,model=2
    assert "resumed from step 40 on data=4,model=2" in text
    pngs = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(pngs) == 2                                                    # the two loss plots
    assert len(_text(nb.cells[-2]).strip()) > 50                            # the sample
