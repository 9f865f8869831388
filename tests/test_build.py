"""reasoning_rl.build: the one place configs and checkpoints become objects."""

import ast
import dataclasses
import pathlib

import pytest

from reasoning_rl.build import build_sized_engine, load_checkpoint
from reasoning_rl.errors import SamplingError
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / "launch"
# What a launcher must get from reasoning_rl.build rather than assemble itself.
WIRING = {("reasoning_rl.models", "load"), ("reasoning_rl.models.transformer", "create_model"),
          ("reasoning_rl.sampler", "Engine"), ("reasoning_rl.sampler.engine", "Engine")}


@pytest.mark.parametrize("launcher", ["train", "evaluate", "generate", "replay", "redteam"])
def test_launchers_wire_through_build(launcher):
  tree = ast.parse((LAUNCH / f"{launcher}.py").read_text())
  imported = {(node.module, alias.name) for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) for alias in node.names}
  assert not imported & WIRING, f"launch/{launcher}.py builds {imported & WIRING} itself"


def test_sized_engine_fits_the_prompts_it_was_built_for():
  model = create_model(ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=32,
                                   intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
                                   head_dim=16, max_position_embeddings=256), seed=0)
  engine = build_sized_engine(model, longest_prompt=70, max_new_tokens=40, num_sequences=6,
                              max_concurrent_decodes=16, steps_per_call=64)
  assert engine.max_concurrent_decodes == 6  # never more slots than sequences
  assert engine.max_prefill_length == 128  # the power-of-two bucket holding 70 tokens
  assert engine.max_decode_length == 40
  assert engine.steps_per_call == 40  # a chunk never outruns the decode budget
  capped = build_sized_engine(model, longest_prompt=230, max_new_tokens=40, num_sequences=64,
                              max_concurrent_decodes=16, steps_per_call=8)
  assert capped.max_concurrent_decodes == 16
  assert capped.max_prefill_length == 216  # the context minus the decode budget caps the bucket
  assert capped.steps_per_call == 8
  # a short cache (128 + 40 entries) is attended whole: one decode-loop compile, not one per
  # live-length bucket; a long one keeps the buckets
  assert not engine.live_length_attention
  long_context = create_model(dataclasses.replace(model.config, max_position_embeddings=4096),
                              seed=0)
  assert build_sized_engine(long_context, longest_prompt=70, max_new_tokens=1024,
                            num_sequences=6, max_concurrent_decodes=16,
                            steps_per_call=64).live_length_attention


def test_a_checkpoint_without_tokenizer_is_refused_by_name(tmp_path, monkeypatch):
  monkeypatch.setattr("reasoning_rl.build.load_model",
                      lambda path, dtype, mesh: (object(), None))
  with pytest.raises(SamplingError, match=f"--checkpoint {tmp_path}: has no tokenizer files"):
    load_checkpoint(str(tmp_path), dtype="float32")
