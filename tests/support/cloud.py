"""Fakes for the cloud tools: the uv installer, the gcloud launcher run as a tool, and the GCS
emulator's fixtures. (From test_gcp_install.py, test_gcp_launch.py, test_storage.py.)"""

import importlib.util
import pathlib
import subprocess
import sys
import time

import pytest

from tests import gcs_emulator
from tests.conftest import REPO


def fake_uv_script(calls: pathlib.Path, venv_ok: bool) -> str:
  """A `uv` that makes "environments" running this test's Python and installs nothing (its
  arguments appended to `calls`), so that install_worker.sh's own steps run in a second."""
  make_venv = (f'mkdir -p "$target/bin"; printf "#!/bin/sh\\nexec {sys.executable} \\"\\$@\\"\\n" '
               f'> "$target/bin/python"; chmod +x "$target/bin/python"; exit 0')
  return f"""#!/bin/bash
echo "$@" >> {calls}
for target; do :; done  # the last argument
if [ "$1" = venv ]; then
  {make_venv if venv_ok else 'echo "error: No interpreter found" >&2; exit 2'}
fi
exit 0
"""


# launch/gcp/commands.py loaded as a module (it is a script, not in a package)
spec = importlib.util.spec_from_file_location("gcp_commands",
                                              REPO / "launch" / "gcp" / "commands.py")
gcp = importlib.util.module_from_spec(spec)
sys.modules["gcp_commands"] = gcp  # dataclasses look their module up there
spec.loader.exec_module(gcp)


def run_tool(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "launch/gcp/commands.py", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


BUCKET = "rrl-tests"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  with gcs_emulator.serving(tmp_path_factory.mktemp("gcs"), BUCKET) as server:
    yield server


@pytest.fixture
def remote(emulator, request):
  """A fresh gs:// directory per test."""
  return f"gs://{BUCKET}/{request.node.name.replace('[', '_').replace(']', '')}-{time.time_ns()}"
