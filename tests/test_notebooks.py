"""Every notebook runs top to bottom in a real Jupyter kernel (this venv's Python) without an error."""

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


@pytest.fixture
def execute(tmp_path, monkeypatch):
    # The kernel inherits this environment (CPU, 8 fake devices from conftest); its runs go to tmp_path.
    monkeypatch.setenv("JAXLM_RUNS_DIR", str(tmp_path))

    def run(name: str) -> nbformat.NotebookNode:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                         resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
        return nb

    return run


def outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", "") or "".join(out.get("data", {}).get("text/plain", "")))
            text.append("".join(out.get("data", {}).get("text/markdown", "")))
    return "\n".join(text)


def test_the_committed_notebooks_have_no_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code"), path


@pytest.mark.slow
def test_quickstart_notebook(execute, tmp_path):
    nb = execute("01_quickstart.ipynb")
    text = outputs(nb)
    assert "loaded step 60 of" in text
    assert (tmp_path / "notebook-quickstart" / "checkpoints" / "60").is_dir()
    assert any(o.get("data", {}).get("image/png") for c in nb.cells for o in c.get("outputs", []))  # the loss plot


@pytest.mark.slow  # about 25 s; the API it shows is tested in test_explore.py
def test_sharding_notebook(execute):
    nb = execute("02_sharding.ipynb")
    text = outputs(nb)
    assert "8 CPU devices" in text and "difference 0.0e+00" in text
    assert "fits: " in text and "does not fit: " in text and "--config.optim.micro_batches=8" in text


def test_ablation_notebook(execute):
    nb = execute("03_ablation.ipynb")
    assert sum(bool(o.get("data", {}).get("image/png")) for c in nb.cells for o in c.get("outputs", [])) >= 3
