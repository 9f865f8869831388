"""The Colab notebook runs end to end (debug config) from the repository, as CI executes it."""

import os
import pathlib

import nbclient
import nbformat
import pytest

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


def test_first_cell_fetches_the_project_on_a_fresh_runtime(tmp_path):
  """Opened outside a checkout (a fresh Colab runtime), the first cell unpacks the project from
  an uploaded archive named by SOURCE and works from there; without SOURCE it says what to set."""
  import subprocess
  import sys

  notebook = nbformat.read(REPO / "colab" / "reasoning_rl_demo.ipynb", as_version=4)
  first_cell = notebook.cells[1].source
  archive = tmp_path / "upload.tar.gz"
  subprocess.run(["git", "archive", "--format=tar.gz", "--prefix=reasoning_rl-main/",
                  "-o", str(archive), "HEAD"], cwd=REPO, check=True)
  home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
  home.mkdir()
  elsewhere.mkdir()
  env = {**os.environ, "HOME": str(home), "REASONING_RL_SOURCE": str(archive)}
  env.pop("REASONING_RL_NOTEBOOK_INSTALL", None)

  def run_cell(environment):
    return subprocess.run([sys.executable, "-c", first_cell], cwd=elsewhere, env=environment,
                          capture_output=True, text=True, timeout=120)

  if pathlib.Path("/content").is_dir():
    pytest.skip("this machine has /content: the cell would unpack there")
  result = run_cell(env)
  assert result.returncode == 0, result.stderr
  assert f"project at {home / 'reasoning_rl'} (fetched from SOURCE)" in result.stdout
  assert (home / "reasoning_rl" / "reasoning_rl" / "trainer.py").exists()
  again = run_cell(env)  # the second time it finds the unpacked project
  assert again.returncode == 0 and "project at" in again.stdout
  env.pop("REASONING_RL_SOURCE")
  (home / "reasoning_rl" / "setup.cfg").unlink()
  missing = run_cell(env)
  assert missing.returncode != 0 and "set SOURCE" in missing.stderr
