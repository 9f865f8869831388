"""The launchers' persistent compilation cache (reasoning_rl/compile_cache.py): where it lives, how
it is turned off, and that a launcher really fills it and a second run really reads it."""

import json
import os
import subprocess
import sys

import pytest

from reasoning_rl import compile_cache
from tests.conftest import REPO


def test_one_directory_per_machine_under_the_chosen_root(tmp_path):
  key = compile_cache.machine_key()
  assert key.startswith(os.uname().machine) and len(key.split("-")[-1]) == 12
  assert compile_cache.cache_dir({compile_cache.ENV_VAR: str(tmp_path)}) == str(tmp_path / key)
  assert compile_cache.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(
      tmp_path / "reasoning_rl" / "jax" / key)
  for off in ("off", "0", "false", "OFF"):
    assert compile_cache.cache_dir({compile_cache.ENV_VAR: off}) is None
  # a cache the user configured for JAX itself is left alone
  assert compile_cache.cache_dir({"JAX_COMPILATION_CACHE_DIR": "/x"}) is None


@pytest.fixture
def prompts_file(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ("2 + 2 =", "Name a colour.")))
  return path


def test_generate_fills_the_cache_and_a_second_run_reads_it(tmp_path, prompts_file,
                                                            smollm2_gguf_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  env[compile_cache.ENV_VAR] = str(tmp_path / "cache")
  env["JAX_LOG_COMPILES"] = "1"
  runs = []
  for attempt in range(2):
    output = tmp_path / f"out{attempt}.jsonl"
    result = subprocess.run(
        [sys.executable, "launch/generate.py", "--checkpoint", str(smollm2_gguf_path),
         "--prompts_file", str(prompts_file), "--max_new_tokens", "4", "--temperature", "0",
         "--output", str(output)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    runs.append((result.stderr, [json.loads(line)["completion_ids"]
                                 for line in output.read_text().splitlines()]))
  entries = sorted(p.name for p in (tmp_path / "cache" / compile_cache.machine_key()).iterdir())
  assert any(name.startswith("jit_generate") for name in entries), entries
  # small programs too (a PRNG seed compiles in milliseconds): JAX's own threshold skips them
  assert any(name.startswith("jit__threefry_seed") for name in entries), entries
  assert runs[0][1] == runs[1][1]  # the same completions from the loaded programs
  # the second process compiled the decode loop no more: it came from disk
  assert "jit(generate)" in runs[0][0].split("Persistent compilation cache hit")[0]
  assert "Persistent compilation cache hit for 'jit_generate'" in runs[1][0]
