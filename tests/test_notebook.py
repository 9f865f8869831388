"""The Colab notebook runs end to end (debug config) from the repository, as CI executes it."""

import os
import pathlib
import shutil

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


def test_first_cell_finds_the_project_with_no_edit(tmp_path):
  """Opened outside a checkout with nothing set (a fresh Colab runtime): the first cell finds an
  archive of the repository uploaded next to it and unpacks it, finds that the second time, asks
  for an upload on Colab (a stand-in google.colab here), uses an installed checkout where there
  is one, and says in one line what to do when there is nothing."""
  import subprocess
  import sys

  notebook = nbformat.read(REPO / "colab" / "reasoning_rl_demo.ipynb", as_version=4)
  first_cell = notebook.cells[1].source
  if pathlib.Path("/content").is_dir():
    pytest.skip("this machine has /content: the cell would unpack there")
  archive = tmp_path / "upload.tar.gz"
  subprocess.run(["git", "archive", "--format=tar.gz", "--prefix=reasoning_rl-main/",
                  "-o", str(archive), "HEAD"], cwd=REPO, check=True)
  home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
  home.mkdir()
  elsewhere.mkdir()
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("REASONING_RL_", "PYTHON"))} | {"HOME": str(home)}

  def run_cell(environment, *flags):
    # -S: no site-packages, so no installed reasoning_rl (a fresh runtime's Python)
    return subprocess.run([sys.executable, *flags, "-c", first_cell], cwd=elsewhere,
                          env=environment, capture_output=True, text=True, timeout=120)

  missing = run_cell(env, "-S")
  assert missing.returncode != 0
  assert missing.stderr.strip().splitlines()[-1].startswith(
      "RuntimeError: no reasoning_rl project here: open the notebook from a checkout")
  shutil.copy(archive, home / "reasoning_rl-main.tar.gz")  # uploaded beside the notebook
  result = run_cell(env, "-S")
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == (f"project at {home / 'reasoning_rl'} (fetched from "
                                   f"{home / 'reasoning_rl-main.tar.gz'})")
  assert (home / "reasoning_rl" / "reasoning_rl" / "trainer.py").exists()
  again = run_cell(env, "-S")
  assert again.returncode == 0
  assert again.stdout.strip() == f"project at {home / 'reasoning_rl'} (found)"

  shutil.rmtree(home / "reasoning_rl")
  (home / "reasoning_rl-main.tar.gz").unlink()
  colab = tmp_path / "fake_colab" / "google" / "colab"
  colab.mkdir(parents=True)
  (colab / "__init__.py").write_text("")
  (colab / "files.py").write_text(
      f"def upload():\n  print('upload dialog')\n"
      f"  return {{'mine.tar.gz': open({str(archive)!r}, 'rb').read()}}\n")
  on_colab = {**env, "PYTHONPATH": str(tmp_path / "fake_colab"),
              "REASONING_RL_NOTEBOOK_INSTALL": "0"}
  uploaded = run_cell(on_colab, "-S")
  assert uploaded.returncode == 0, uploaded.stderr
  assert "upload dialog" in uploaded.stdout and "(fetched from " in uploaded.stdout
  assert (home / "reasoning_rl" / "setup.cfg").exists()

  shutil.rmtree(home / "reasoning_rl")
  installed = run_cell({**env, "PYTHONPATH": str(REPO)})  # an installed (editable) checkout
  assert installed.returncode == 0, installed.stderr
  assert installed.stdout.strip() == f"project at {REPO} (found)"
