"""The Colab notebook runs end to end (debug config) from the repository, as CI executes it."""

import os

import nbclient
import nbformat

from tests.conftest import REPO


def test_notebook_runs_with_the_debug_config(tmp_path, monkeypatch):
  monkeypatch.setenv("REASONING_RL_NOTEBOOK_CONFIG", "debug_cpu")
  monkeypatch.setenv("REASONING_RL_NOTEBOOK_WORKDIR", str(tmp_path / "run"))
  # A fresh kernel sees one CPU device unless told otherwise; keep the test process's flags.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  notebook = nbformat.read(REPO / "colab" / "reasoning_rl_demo.ipynb", as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(REPO / "colab")}}).execute()
  text = "\n".join(output.get("text", "") for cell in notebook.cells
                   for output in cell.get("outputs", []))
  assert "exit code 0" in text
  assert "step    0: held-out accuracy" in text and "step   10: held-out accuracy" in text
  images = [o for cell in notebook.cells for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert len(images) >= 6
