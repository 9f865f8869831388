"""benchmarks/isa_cap.py: a capped process computes with YNNPACK held at the AVX2 feature set."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO

RUN = """
import json, sys
import numpy as np
from benchmarks import isa_cap
if sys.argv[1] == "cap":
  isa_cap.cap_at_avx2()
import jax, jax.numpy as jnp
a = np.arange(96 * 80, dtype=np.float32).reshape(96, 80) / 1000
b = np.cos(np.arange(80 * 112, dtype=np.float32)).reshape(80, 112)
product = np.asarray(jax.jit(jnp.matmul)(a, b))
flags, chosen = isa_cap.ynnpack_features()
again = None
if sys.argv[1] == "cap":
  try:
    isa_cap.cap_at_avx2()
  except SystemExit as refusal:
    again = str(refusal)
print(json.dumps(dict(flags=flags, chosen=chosen, error=float(np.max(np.abs(product - a @ b))),
                      again=again)))
"""


def run(mode: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
  result = subprocess.run([sys.executable, "-c", RUN, mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=True)
  return json.loads(result.stdout.splitlines()[-1])


def test_a_capped_process_runs_its_matmuls_on_avx2_kernels_and_refuses_a_late_cap():
  capped, native = run("cap"), run("native")
  assert capped["chosen"] and native["chosen"]  # the matmul went through YNNPACK
  assert capped["flags"] == 0x7f
  avx2 = 1 << 5
  assert native["flags"] & avx2  # every machine this project runs on has AVX2
  assert capped["error"] < 1e-4 and native["error"] < 1e-4
  assert "already chosen its kernels" in capped["again"]
