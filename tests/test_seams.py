"""The loop's seams (architecture §1): the rollout backend, the verifier registry, the advantage
stage, the weight sync and the policy version, and the loop's independence from `build`."""

from __future__ import annotations

import dataclasses
import importlib.util
import types

import jax
import numpy as np
import pytest

from reasoning_rl import build, evaluation, registries
from reasoning_rl.errors import ConfigError, SamplingError
from reasoning_rl.loop import telemetry
from reasoning_rl.loop.rl_stage import RLStage
from reasoning_rl.loop.rollouts import RolloutCollector
from reasoning_rl.loop.state import LoopState
from reasoning_rl.loop.weight_sync import WeightSync, abstract_payload, mode_of
from reasoning_rl.multihost.cluster import local_cluster
from reasoning_rl.rl import batching
from reasoning_rl.rl.advantages import batch_advantages, group_advantages
from reasoning_rl.sampler import EngineBackend
from reasoning_rl.sampler.api import CallUsage, Completion, DecodeUsage
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction, _route
from tests.conftest import REPO
from tests.support import rollouts
from tests.support.import_graph import import_edges


def _debug_config():
  spec = importlib.util.spec_from_file_location("debug_cpu", REPO / "configs" / "debug_cpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# ---------------------------------------------------------------------------- rollout backend


class ScriptedBackend:
  """A rollout backend without a model: sample g of every prompt is g + 1 tokens of `token`, then
  the stop id, each at log-prob −(g + 1). Records what the loop asked of it; every call reports
  the same decode usage (a quarter of its slot-steps idle)."""

  def __init__(self, spec):
    self.spec = spec
    self.version = 0
    self.calls, self.updates, self.stopped = [], [], False
    self.usage = CallUsage()

  @property
  def policy_version(self) -> int:
    return self.version

  def last_usage(self):
    return self.usage

  def generate(self, prompts, *, prompt_ids, num_samples, sampling, max_new_tokens, stop_ids,
               stop_strings, tokenizer, seed, should_stop=None, for_training=True):
    del stop_strings, tokenizer, should_stop
    self.calls.append(dict(prompt_ids=list(prompt_ids), num_samples=num_samples, seed=seed,
                           temperature=sampling.temperature, for_training=for_training))
    self.usage = CallUsage(decode=DecodeUsage(calls=1, steps=2, slot_steps=8, live_slot_steps=6))
    token = self.spec.config.scripted_token
    for prompt, prompt_id in zip(prompts, prompt_ids):
      for g in reversed(range(num_samples)):  # any order: the collector regroups
        ids = ([token] * (g + 1) + [stop_ids[0]])[:max_new_tokens]
        yield Completion(prompt_id=prompt_id, sample_index=g, prompt_tokens=list(prompt),
                         completion_ids=ids, logprobs=[-(g + 1.0)] * len(ids),
                         sampling_logprobs=None, finish_reason="stop_id", truncated=False,
                         policy_version=self.version)

  def update_weights(self, weights, *, version, adapters_only=False):
    self.updates.append((version, adapters_only, jax.tree.structure(weights)))
    self.version = version

  def stop(self):
    self.stopped = True


@pytest.fixture
def scripted_backend_name():
  name = "scripted-test"
  registries.ROLLOUT_BACKENDS.add(name, ScriptedBackend, summary="a test's scripted completions")
  yield name
  registries.ROLLOUT_BACKENDS.remove(name)


def test_a_backend_registered_by_name_drives_a_real_rl_step(scripted_backend_name):
  config = _debug_config()
  config.workdir = "/nonexistent"  # nothing is written: the stage is driven directly
  run = build.build(config)
  assert isinstance(run.backend, EngineBackend)  # the built-in default
  # the same config naming the registered backend (build_backend reads `rollout.backend`)
  named = config.copy_and_resolve_references()
  named.rollout.backend = scripted_backend_name
  named.scripted_token = run.tokenizer.encode("7", add_special_tokens=False)[0]
  backend = build.build_backend(named, None)
  assert isinstance(backend, ScriptedBackend)
  run.backend = backend
  run.weight_sync = WeightSync(run.step_fn, backend, run.cluster)
  r = config.rollout
  collector = RolloutCollector(backend, run.tokenizer, run.template, run.scorer,
                               num_samples=r.num_samples, max_new_tokens=r.max_new_tokens,
                               stop_strings=r.stop_strings, sampling=run.sampling, seed=config.seed)
  stage = RLStage(run, collector, staleness=0, with_sampler_logprobs=False)
  loop = LoopState(guards=None)
  before = jax.tree.map(np.asarray, run.state.params)
  try:
    state, row = stage.step(1, run.state, loop)
    # held-out evaluation samples through the same backend
    result = evaluation.run_evaluation(
        backend, run.tokenizer, run.template, run.data.eval_examples[:2], run.scorer,
        max_new_tokens=r.max_new_tokens, seed=config.seed)
  finally:
    run.scorer.close()
  # the evaluation asked for completions nothing trains on
  assert backend.calls[-1]["prompt_ids"] == [0, 1] and result["num_examples"] == 2
  assert backend.calls[-1]["for_training"] is False
  # the loop asked the backend for the stream's first prompts, G samples each, with the run's seed
  assert backend.calls[0] == dict(prompt_ids=list(range(r.num_prompts)),
                                 num_samples=r.num_samples, seed=config.seed,
                                 temperature=r.temperature, for_training=True)
  # the step's decode figures are the backend's own, read through `last_usage`
  assert row["throughput/decode_idle_slot_frac"] == 0.25
  # the scripted completions were trained on: lengths g + 2 tokens, a real update happened
  assert row["response_length/mean"] == pytest.approx(np.mean(np.arange(r.num_samples) + 2))
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.params)
  assert any(jax.tree.leaves(changed))
  # the weight sync published version 1 to the backend, whole weights (no LoRA)
  assert loop.policy_version == row["policy_version"] == 1 == backend.policy_version
  [(version, adapters_only, structure)] = backend.updates
  assert (version, adapters_only) == (1, False)
  assert structure == jax.tree.structure(run.step_fn.sampler_weights(state))
  # the records show the advantages the batch carried: the stage's, from the scored rewards
  records = stage.rollout_records(1)
  rewards = np.array([rec["reward"] for rec in records]).reshape(r.num_prompts, r.num_samples)
  expected = batch_advantages(rewards, num_groups=r.num_prompts, group_size=r.num_samples,
                              estimator=config.algo.estimator)
  np.testing.assert_array_equal([rec["advantage"] for rec in records], expected.reshape(-1))
  assert np.any(expected != 0)  # the length part spreads the rewards: a real signal


def test_engine_backend_stops_and_takes_adapters_only_on_a_lora_model():
  config = _debug_config()
  model, _ = build.build_policy(config)
  backend = build.build_backend(config, model)
  assert isinstance(backend, EngineBackend)
  with pytest.raises(SamplingError, match="no LoRA adapters"):
    backend.update_weights(backend.engine.params, version=4, adapters_only=True)
  backend.update_weights(backend.engine.params, version=4)
  assert backend.policy_version == 4
  backend.stop()
  with pytest.raises(SamplingError, match="stopped"):
    backend.generate([[1, 2]], prompt_ids=[0], num_samples=1, sampling=None, max_new_tokens=2,
                     stop_ids=(), stop_strings=(), tokenizer=None, seed=0)


def test_an_unknown_backend_name_is_a_config_error_naming_the_field():
  config = _debug_config()
  config.rollout.backend = "no-such-engine"
  with pytest.raises(ConfigError, match=r"config\.rollout\.backend='no-such-engine'"):
    build.build_backend(config, None)


# ---------------------------------------------------------------------------- verifiers


def _record(task="math", **fields):
  return CompletionRecord(**{"prompt": "q", "response": "<answer>2</answer>",
                             "ground_truth": "2", "task": task, **fields})


def test_auto_routes_by_task_kind_then_by_what_the_record_carries():
  assert _route(_record("countdown", metadata={"numbers": [1], "target": 1})) == "countdown"
  assert _route(_record("mbpp")) == "code"
  assert _route(_record("anything", tests=("assert True",))) == "code"
  assert _route(_record("gym", metadata={"source_dataset": "leg_counting"})) == "reasoning_gym"
  assert _route(_record("gsm8k")) == "math"


def test_a_registered_verifier_is_chosen_by_name_and_by_task_kind():
  from reasoning_rl.verifiers.rewards import Verifier

  def shouted(record, settings):
    del settings
    return float(record.response.isupper())

  registries.VERIFIERS.add("shout-test", Verifier(shouted, "shout-1", tasks=("shout",)),
                           summary="a test's verifier")
  try:
    by_name = RewardFunction({"correct": {"weight": 1.0, "verifier": "shout-test"}})
    assert [r.total for r in by_name.score_group([_record(), _record(response="YES")])] == [0, 1]
    assert "correct=shout-1" in by_name.verifier_version
    auto = RewardFunction({"correct": {"weight": 1.0, "verifier": "auto"}})
    assert auto.score_group([_record("shout", response="NO")])[0].total == 1.0
    assert auto.score_group([_record("math")])[0].total == 1.0  # still math-verify: "2" == "2"
    assert "shout-1" in auto.verifier_version  # auto's version names every verifier it routes to
  finally:
    registries.VERIFIERS.remove("shout-test")
  with pytest.raises(ConfigError,
                     match="config.rewards.correct.verifier='shout-test': unknown verifier"):
    RewardFunction({"correct": {"weight": 1.0, "verifier": "shout-test"}})


# ---------------------------------------------------------------------------- advantages


def _group(rewards, position=0):
  g = len(rewards)
  return rollouts.group(rewards, [[3, 4]] * g, position=position, prompt=[1, 2], parts={},
                        responses=("a", "b")[:g] if g <= 2 else None)


def test_the_advantage_stage_pads_missing_groups_with_zeros():
  rewards = [[0.0, 1.0, 1.0], [0.2, 0.2, 0.2]]
  out = batch_advantages(rewards, num_groups=3, group_size=3, estimator="rloo")
  assert out.dtype == np.float32 and out.shape == (3, 3)
  np.testing.assert_array_equal(out[:2], np.asarray(group_advantages(
      np.asarray(rewards, np.float32).astype(np.float64), estimator="rloo"), np.float32))
  np.testing.assert_array_equal(out[1:], 0.0)
  with pytest.raises(ValueError, match="group 1 has 2 samples"):
    batch_advantages([[0.0, 1.0, 1.0], [0.0, 1.0]], num_groups=2, group_size=3,
                     estimator="grpo")


def test_the_batch_carries_the_records_advantages_and_none_means_the_step_computes_them():
  record = rollouts.record(_group([0.0, 1.0]), _group([1.0, 1.0], position=1))
  given = np.array([[0.25, -0.75], [1.5, 2.5]], np.float32)  # not any estimator's output
  batch = batching.build_batch(record.with_advantages(given), num_groups=2, group_size=2,
                               prompt_length=2, completion_length=2, pad_id=0, with_rewards=True)
  np.testing.assert_array_equal(batch["advantages"], given.reshape(-1))
  np.testing.assert_array_equal(batch["rewards"], [0.0, 1.0, 1.0, 1.0])
  ppo = batching.build_batch(record, num_groups=2, group_size=2, prompt_length=2,
                             completion_length=2, pad_id=0, with_rewards=True)
  np.testing.assert_array_equal(ppo["advantages"], 0.0)
  with pytest.raises(ValueError, match="2 advantages for 4 samples"):
    record.with_advantages(given[:1])
  # a short batch (dynamic sampling came up short): the missing group's rows are masked
  short = batching.build_batch(record.take_groups([1]).with_advantages(given[1]), num_groups=2,
                               group_size=2, prompt_length=2, completion_length=2, pad_id=0)
  np.testing.assert_array_equal(short["advantages"], [1.5, 2.5, 0.0, 0.0])
  np.testing.assert_array_equal(short["attention_mask"].sum(1), [4, 4, 0, 0])


def test_records_without_group_or_token_advantages_show_null_not_made_up_numbers():
  from reasoning_rl.loop.state import SampledBatch

  sampled = SampledBatch(rollouts=_group([0.0, 1.0]), outcome={}, groups_sampled=1, scoring={},
                         sample_s=0.0, verify_s=0.0, policy_version=0)
  example = types.SimpleNamespace(prompt="q", answer="1", task="math", metadata={}, tests=())
  kwargs = dict(examples=lambda i: example, decode=lambda ids: "p", verifier_version="v",
                sampling={})
  ppo = telemetry.rollout_records(1, sampled, **kwargs)
  assert [rec["advantage"] for rec in ppo] == [None, None]
  grpo = telemetry.rollout_records(1, dataclasses.replace(
      sampled, rollouts=sampled.rollouts.with_advantages([-1.0, 1.0])), **kwargs)
  assert [rec["advantage"] for rec in grpo] == [-1.0, 1.0]


# ---------------------------------------------------------------------------- weight sync


@dataclasses.dataclass
class _Lora:
  enabled: bool = True
  sampler_weights: str = "adapters"


def _step_config(lora=None, compute_dtype=None):
  return types.SimpleNamespace(lora=lora, trains_adapters=lora is not None and lora.enabled,
                               compute_dtype=compute_dtype)


def test_one_decision_of_what_the_sampler_receives():
  assert mode_of(_step_config()) == "full"
  assert mode_of(_step_config(_Lora(sampler_weights="adapters"))) == "adapters"
  assert mode_of(_step_config(_Lora(sampler_weights="merged"))) == "merged"
  params = {"w": np.zeros((2, 3), np.float32), "i": np.zeros((2,), np.int32)}
  abstract = abstract_payload(_step_config(compute_dtype="bfloat16"), params)
  assert abstract["w"].dtype == jax.numpy.bfloat16 and abstract["i"].dtype == np.int32


def test_publish_advances_the_policy_version_once_and_push_does_not():
  received = []
  backend = types.SimpleNamespace(
      update_weights=lambda w, version, adapters_only: received.append((version, adapters_only)))
  step_fn = types.SimpleNamespace(config=_step_config(_Lora(sampler_weights="adapters")),
                                  sampler_weights=lambda state: {"a": np.ones(3, np.float32)})
  sync = WeightSync(step_fn, backend, local_cluster())
  loop = LoopState(guards=None, policy_version=4)
  published = sync.publish(state=None, loop=loop)
  assert loop.policy_version == published.version == 5 and published.num_bytes == 12
  sync.push(None, loop.policy_version)  # a resume re-sends the restored version
  assert loop.policy_version == 5
  assert received == [(5, True), (5, True)]


# ---------------------------------------------------------------------------- dependencies


def test_the_loop_depends_on_interfaces_not_on_the_composition_root():
  into_build = [str(e) for e in import_edges() if e.importer.startswith("reasoning_rl.loop")
                and e.imported == "reasoning_rl.build"]
  assert not into_build, into_build
