"""The decode benchmarks measure launch/generate.py as a user runs it: importing them must leave
the environment (which the processes they start inherit) as it was."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

CHECK = """
import json, os
before = dict(os.environ)
import benchmarks.generate_cli, benchmarks.profile_decode, benchmarks.installed
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps(changed))
"""


def test_importing_the_decode_benchmarks_changes_no_environment_variable():
  """tests.conftest forces 8 simulated CPU devices and a 16-thread XLA pool; a generate.py that
  inherited them decoded 14-24 % slower than a user's, which once skewed the comparison."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
  result = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=True)
  assert json.loads(result.stdout.splitlines()[-1]) == []


def test_a_missing_model_package_is_one_clear_error():
  from benchmarks.installed import package_dir, smollm2_gguf

  assert smollm2_gguf().is_file()
  with pytest.raises(SystemExit, match="'no_such_package' is not installed"):
    package_dir("no_such_package")
