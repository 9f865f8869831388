"""The rollout backend's interface (`sampler/api.py`): it loads without JAX, its records keep
their JSON form, a config that needs a capability its backend did not declare is refused at
validation, the loop reads each call's usage through the protocol, evaluations decode plainly,
and the one engine factory builds what its spec says."""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from reasoning_rl import config as config_lib
from reasoning_rl import registries
from reasoning_rl.errors import ConfigError
from reasoning_rl.loop.rollouts import RolloutCollector
from reasoning_rl.sampler import api
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.engine_backend import CAPABILITIES, EngineBackend
from reasoning_rl.sampler.engine_factory import EngineSpec, make_engine
from reasoning_rl.sampler.paged import PagedEngine
from reasoning_rl.sampler.rollout import generate_groups
from reasoning_rl.sampler.sampling import SamplingParams
from reasoning_rl.verifiers.rewards import Reward
from reasoning_rl.workers.scorer import ScoredItem
from tests.conftest import REPO


def _debug_config():
  spec = importlib.util.spec_from_file_location("debug_cpu", REPO / "configs" / "debug_cpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.workdir = "/nonexistent"  # validated only
  return config


# ---------------------------------------------------------------------------- no JAX


def test_the_interface_loads_without_jax_flax_or_numpy():
  program = (
      "import sys, json\n"
      "from reasoning_rl.sampler import api\n"
      "c = api.Completion(1, 0, [5], [6, 7], [-0.5, -1.0], None, 'stop_id', False, 3)\n"
      "back = api.Completion.from_json(json.loads(json.dumps(c.to_json())))\n"
      "assert back == c, back\n"
      "print(json.dumps(sorted(m for m in ('jax', 'flax', 'numpy') if m in sys.modules)))\n")
  out = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True,
                       check=True)
  assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ---------------------------------------------------------------------------- records


def test_a_completion_keeps_its_json_form_field_for_field():
  # a transposed (not C-contiguous) routing array: its bytes are written in C order
  experts = np.arange(12, dtype=np.uint8).reshape(3, 4).T[:, :, None]
  completion = api.Completion(
      prompt_id=7, sample_index=1, prompt_tokens=[1], completion_ids=[2, 3, 4],
      logprobs=[-0.25, -0.5, -1.0], sampling_logprobs=[-0.125, -0.25, -0.5],
      finish_reason="length", truncated=True, policy_version=2, token_versions=[1, 2, 2],
      experts=experts)
  expected_routing = {"shape": [4, 3, 1], "dtype": "uint8",
                      "data": base64.b64encode(bytes([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]))
                      .decode("ascii")}
  assert json.dumps(completion.to_json()) == json.dumps({
      "prompt_id": 7, "sample_index": 1, "prompt_tokens": [1], "completion_ids": [2, 3, 4],
      "logprobs": [-0.25, -0.5, -1.0], "sampling_logprobs": [-0.125, -0.25, -0.5],
      "finish_reason": "length", "truncated": True, "policy_version": 2, "loss_mask": None,
      "turns": None, "reward_parts": None, "episode_end": None, "scored_response": None,
      "token_versions": [1, 2, 2], "experts": expected_routing})
  back = api.Completion.from_json(json.loads(json.dumps(completion.to_json())))
  np.testing.assert_array_equal(back.experts, experts)
  assert back.experts.dtype == np.uint8
  unfinished = api.Unfinished(3, 0, [9], [-2.0], [-2.5], [4])
  assert list(unfinished.to_json()) == ["prompt_id", "sample_index", "completion_ids", "logprobs",
                                        "sampling_logprobs", "token_versions", "experts"]
  assert api.Unfinished.from_json(unfinished.to_json()) == unfinished


# ---------------------------------------------------------------------------- capabilities


@pytest.fixture
def bare_backend():
  """A backend registered without declaring any capability (it is never built here)."""
  name = "bare-test"
  registries.ROLLOUT_BACKENDS.add(name, lambda spec: None, summary="a test's plain backend")
  yield name
  registries.ROLLOUT_BACKENDS.remove(name)


def _needing(field: str):
  """The debug config with `field` set, and nothing else that the capability check reads."""
  config = _debug_config()
  if field == "partial_rollouts.enabled":
    config.partial_rollouts.enabled = True
  elif field == "environment.name":
    config.environment.name = "calculator"
  elif field == "rollout.exact_logprobs":
    config.rollout.exact_logprobs = True
  elif field == "rollout.kv_page_size":
    config.rollout.kv_page_size = 16
  elif field == "agent.entry":
    config.agent.entry = "tests.support.agents:two_turns"
  elif field == "rollout.weight_quantization":
    config.rollout.weight_quantization = "int8"
  else:
    config.algo.routing_replay = True
  return config


FIELDS = [(field, capability, off) for field, capability, _, off in api.CAPABILITY_FIELDS]


@pytest.mark.parametrize("field, capability, off", FIELDS)
def test_a_config_needing_a_capability_the_backend_did_not_declare_is_refused(
    bare_backend, field, capability, off):
  config = _needing(field)
  config_lib.validate(config)  # the engine declares every capability
  config.rollout.backend = bare_backend
  with pytest.raises(ConfigError) as error:
    config_lib.validate(config)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"config.{field}=")
  assert message.endswith(f"(Capabilities.{capability}), and rollout.backend='bare-test' does "
                          f"not declare it: use rollout.backend='engine', or set {field}={off}")


@pytest.mark.parametrize("field, capability, off", FIELDS)
def test_a_backend_declaring_just_that_capability_is_accepted(field, capability, off):
  del off
  name = "one-capability-test"
  registries.ROLLOUT_BACKENDS.add(name, lambda spec: None, summary="a test's backend",
                                  capabilities=api.Capabilities(**{capability: True}))
  try:
    config = _needing(field)
    config.rollout.backend = name
    config_lib.validate(config)
    assert api.capabilities_of(name).names() == (capability,)
  finally:
    registries.ROLLOUT_BACKENDS.remove(name)


def test_a_plain_config_runs_on_a_backend_without_capabilities(bare_backend):
  config = _debug_config()
  config.rollout.backend = bare_backend
  config_lib.validate(config)
  assert api.capabilities_of(bare_backend) == api.Capabilities()


def test_the_engine_declares_every_capability_and_unknown_names_name_the_field():
  assert api.capabilities_of("engine") == CAPABILITIES
  assert set(CAPABILITIES.names()) == {capability for _, capability, _ in FIELDS}
  with pytest.raises(ConfigError, match=r"config\.rollout\.backend='no-such': unknown"):
    api.capabilities_of("no-such")


# ---------------------------------------------------------------------------- usage


class _ReportingBackend:
  """Two completions per prompt, and the usage the test gives it as its last call's."""

  def __init__(self, usage):
    self.usage = usage
    self.policy_version = 0

  def generate(self, prompts, *, prompt_ids, num_samples, stop_ids, **unused):
    del unused
    for prompt, prompt_id in zip(prompts, prompt_ids):
      for g in range(num_samples):
        yield api.Completion(prompt_id, g, list(prompt), [stop_ids[0]], [-1.0], None, "stop_id",
                             False, 0)

  def last_usage(self):
    return self.usage


class _OneScorer:
  """Gives every completion reward 1, at once."""

  def __init__(self):
    self.items = []

  def submit(self, key, records):
    self.items.append(ScoredItem(key, [Reward(total=1.0, parts={}, verifier_version="v")
                                       for _ in records], "ok"))

  def get(self):
    return self.items.pop(0)


def _collector(backend):
  tokenizer = types.SimpleNamespace(eos_ids=(0,), decode=lambda ids, **kwargs: "x")
  template = types.SimpleNamespace(encode=lambda example: [1, 2])
  return RolloutCollector(backend, tokenizer, template, _OneScorer(), num_samples=2,
                          max_new_tokens=4, stop_strings=(), sampling=SamplingParams(), seed=0)


def _examples(n):
  example = types.SimpleNamespace(prompt="q", answer="1", task="math", metadata={}, tests=())
  return lambda count: [(index, example) for index in range(count)][:n]


def test_the_loop_reads_each_calls_usage_through_the_backend():
  decode = api.DecodeUsage(calls=3, steps=5, slot_steps=40, live_slot_steps=30, preempted=2)
  exact = api.ExactStats(sequences=4, tokens=10, repairs=1, draft_mismatch_mean=0.5,
                         draft_mismatch_max=0.75)
  batch = _collector(_ReportingBackend(api.CallUsage(decode=decode, exact=exact))).sample_batch(
      _examples(2), num_prompts=2, dynamic_sampling=False, max_rounds=1, policy_version=0)
  assert batch.decode == {"calls": 3, "steps": 5, "slot_steps": 40, "live_slot_steps": 30,
                          "preempted": 2}
  assert batch.exact["tokens"] == 10 and batch.exact["repairs"] == 1
  assert batch.exact["draft_mismatch_mean"] == 0.5 and batch.exact["draft_mismatch_max"] == 0.75
  nothing = _collector(_ReportingBackend(api.CallUsage())).sample_batch(
      _examples(2), num_prompts=2, dynamic_sampling=False, max_rounds=1, policy_version=0)
  assert nothing.decode is None and nothing.exact is None


# ---------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def tiny_model():
  from reasoning_rl.models.config import ModelConfig
  from reasoning_rl.models.transformer import create_model

  return create_model(ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=32,
                                  intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  head_dim=16), seed=1)


def test_an_evaluation_decodes_plainly_on_a_backend_with_exact_rollouts(tiny_model):
  engine = make_engine(tiny_model, EngineSpec(max_concurrent_decodes=4, max_prefill_length=16,
                                              max_decode_length=6, steps_per_call=6))
  # a scorer the evaluation must not touch: exact rollouts would call it and fail
  backend = EngineBackend(engine, scorer=object())
  prompts = [[5, 6, 7], [8, 9]]
  kwargs = dict(num_samples=2, sampling=SamplingParams(temperature=1.0), max_new_tokens=5,
                stop_ids=(), seed=3)
  held_out = sorted(backend.generate(prompts, prompt_ids=[0, 1], stop_strings=(), tokenizer=None,
                                     for_training=False, **kwargs),
                    key=lambda c: (c.prompt_id, c.sample_index))
  direct = generate_groups(engine, prompts, **kwargs)
  assert [c.completion_ids for c in held_out] == [c.completion_ids for c in direct]
  usage = backend.last_usage()
  assert usage.exact is None and usage.decode.calls >= 1 and usage.decode.steps >= 5


def test_the_engine_factory_builds_what_the_spec_says(tiny_model):
  spec = EngineSpec(max_concurrent_decodes=3, max_prefill_length=16, max_decode_length=8,
                    steps_per_call=4, seed=5, truncation="left", live_length_attention=False)
  contiguous = make_engine(tiny_model, spec)
  assert type(contiguous) is Engine
  assert (contiguous.max_concurrent_decodes, contiguous.max_prefill_length,
          contiguous.max_decode_length, contiguous.steps_per_call) == (3, 16, 8, 4)
  # truncation="left" keeps a too-long prompt's end instead of refusing it
  padded, length = contiguous.prepare_prompt(list(range(1, 21)))
  assert length == 16 and list(padded[:length]) == list(range(5, 21))
  paged = make_engine(tiny_model, EngineSpec(max_concurrent_decodes=2, max_prefill_length=16,
                                             max_decode_length=8, steps_per_call=4,
                                             kv_page_size=8, kv_pages=6))
  assert isinstance(paged, PagedEngine) and paged.page_size == 8
