"""scripts/colab_demo.ipynb runs top to bottom on the CPU in its reduced mode
(JAXSERVE_DEMO_TINY=1: a tiny random model, few tokens), executed by nbclient, and prints the
attention path and dtype the device selection took."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "scripts" / "colab_demo.ipynb"

nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[dev]' (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[dev]' (nbclient)")
pytest.importorskip("ipykernel", reason="pip install -e '.[dev]' (ipykernel)")
pytest.importorskip("matplotlib", reason="pip install -e '.[dev]' (matplotlib)")


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_notebook_runs_top_to_bottom_in_reduced_mode(monkeypatch):
    monkeypatch.setenv("JAXSERVE_DEMO_TINY", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "the checked-in notebook must carry no outputs"
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "reduced mode: True" in text
    assert "backend: cpu" in text
    assert "attention: reference (" in text and "dtype: float32 (" in text, \
        "the device selection and its reasons are printed"
    assert "path taken: reference attention, float32, cpu (cpu)" in text
    assert "health: SERVING" in text
    assert text.count("concurrency ") == 2, text[-2000:]
    assert "server stopped" in text
    images = [o for c in nb.cells for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 1, "the benchmark plot is missing"
