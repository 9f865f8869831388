"""The loop's pieces on their own: loop state ↔ checkpoint metadata, telemetry as pure functions,
and the rollout collector on a tiny random policy with an inline scorer."""

import collections
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl import guards as guards_lib
from reasoning_rl.config import base_config
from reasoning_rl.loop import compile_clock, telemetry
from reasoning_rl.loop.state import LoopState
from tests.support.loop import _batch


def test_loop_state_round_trips_through_checkpoint_metadata():
  guards = guards_lib.Guards(base_config().guards)
  state = LoopState(guards=guards, data_position=17, policy_version=4,
                    queue=collections.deque([_batch()]))
  meta = json.loads(json.dumps(state.to_meta()))  # what the checkpoint stores
  restored = LoopState(guards=guards_lib.Guards(base_config().guards))
  restored.load_meta(meta)
  assert restored.data_position == 17 and restored.policy_version == 4
  assert list(restored.queue) == [_batch()]
  assert restored.to_meta() == state.to_meta()


def test_rl_metrics_are_computed_from_the_batch_and_the_step_statistics():
  stats = {"loss": 0.25, "entropy": 1.5, "clip_frac": 0.0, "skipped_update": 0.0,
           "grad_norm": 3.0}
  row = telemetry.rl_metrics(_batch(), stats, reward_parts=["correct"], policy_version=5,
                             data_position=13)
  assert row["loss"] == 0.25 and row["entropy"] == 1.5 and np.isnan(row["kl"])
  assert row["train/grad_norm"] == 3.0 and "train/loss" not in row
  assert row["reward/mean"] == pytest.approx(0.5)
  assert row["reward/std"] == pytest.approx(np.std([1.0, 0.0, 0.5, 0.5]))
  assert row["reward/correct"] == pytest.approx(0.25)
  assert row["response_length/mean"] == pytest.approx(3.0)
  assert row["response_length/max"] == 5
  assert row["response_length/truncated_frac"] == pytest.approx(0.25)
  assert row["verifier/timeout_rate"] == pytest.approx(0.25)
  assert row["verifier/error_rate"] == pytest.approx(0.25)
  assert row["verifier/timeouts"] == 1 and row["verifier/errors"] == 1
  assert row["dynamic_sampling/groups_sampled"] == 4
  assert row["dynamic_sampling/groups_kept"] == 2
  assert row["policy_version"] == 5 and row["policy_lag"] == 1 and row["data_position"] == 13
  assert row["groups/all_fail_frac"] == 0.5


def test_timing_and_throughput():
  times = telemetry.StepTimes(train_s=4.0, sync_s=0.5, sample_ahead_s=0.0, step_s=8.0,
                              compile_s=1.5)
  sync = telemetry.rl_timing(_batch(), times, asynchronous=False)
  assert sync["time/compile_s"] == 1.5  # a share of the phases, not a phase of its own
  assert sync["time/idle_s"] == pytest.approx(8.0 - 2.5 - 4.0 - 0.5)
  assert telemetry.rl_timing(_batch(), times, asynchronous=True)["time/idle_s"] == \
      pytest.approx(8.0 - 4.0 - 0.5)
  seen = {}

  def flops(**counts):
    seen.update(counts)
    return 1e9

  out = telemetry.rl_throughput(_batch(), times, trained_tokens=40, step_flops=flops,
                                peak_flops=1e9, asynchronous=False)
  # a group's prompt is prefilled once, whatever G
  assert seen == {"prompts": 2, "prompt_tokens": 6, "generated_tokens": 12, "trained_tokens": 40}
  assert out["throughput/generated_tokens_per_s"] == pytest.approx(12 / 2.0)
  assert out["throughput/trained_tokens_per_s"] == pytest.approx(40 / 10.5)
  assert out["throughput/rl_mfu"] == pytest.approx(1 / 10.5)
  # shared prompts: the MFU counts the positions computed, tokens/s the sequences' tokens
  out = telemetry.rl_throughput(_batch(), times, trained_tokens=40, computed_tokens=31,
                                step_flops=flops, peak_flops=1e9, asynchronous=False)
  assert seen["trained_tokens"] == 31
  assert out["throughput/trained_tokens_per_s"] == pytest.approx(40 / 10.5)


def test_rollout_records_carry_the_task_prompt_the_verifier_saw():
  example = collections.namedtuple("Example", "prompt answer task metadata tests")(
      "What is 2+3?", "5", "math", {"k": 1}, ())
  batch = _batch()
  batch = dataclasses.replace(batch, rollouts=batch.rollouts.with_advantages(
      np.array([[0.5, -0.5], [0.0, 0.0]])))
  records = telemetry.rollout_records(
      7, batch, examples=lambda position: example,
      decode=lambda ids: "<templated>" + ",".join(map(str, ids)), verifier_version="v1",
      sampling={"temperature": 1.0})
  assert len(records) == 4
  first, last = records[0], records[-1]
  assert first["prompt"] == "<templated>5,6,7" and first["task_prompt"] == "What is 2+3?"
  assert (first["step"], first["prompt_id"], first["group_id"], first["sample_index"]) == \
      (7, 11, 0, 0)
  assert first["advantage"] == 0.5 and records[1]["advantage"] == -0.5
  assert records[1]["truncated"] and records[1]["num_tokens"] == 5
  assert last["scoring_status"] == "timeout" and last["completion"] == "d"
  assert first["reward/correct"] == 1.0 and first["policy_version"] == 3


# ------------------------------------------------------------------------ the rollout collector


@pytest.fixture(scope="module")
def debug_run_pieces():
  """Policy, tokenizer, template, engine and data of configs/debug_cpu.py."""
  from reasoning_rl import build
  from tests.conftest import REPO
  import importlib.util

  spec = importlib.util.spec_from_file_location("debug_cpu", REPO / "configs" / "debug_cpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  model, tokenizer = build.build_policy(config)
  return dict(config=config, tokenizer=tokenizer, template=build.build_template(config, tokenizer),
              engine=build.build_engine(config, model), data=build.build_data(config),
              sampling=build.sampling_params(config))


class _FailsOnAnswer:
  """A reward function whose verifier raises on one ground truth (a bug in a verifier)."""

  def __init__(self, reward_fn, bad_answer):
    self._inner, self.bad_answer = reward_fn, bad_answer
    self.parts, self.verifier_version = reward_fn.parts, reward_fn.verifier_version
    self.needs_group = reward_fn.needs_group

  def score_group(self, records):
    if records[0].ground_truth == self.bad_answer:
      raise ZeroDivisionError("verifier bug")
    return self._inner.score_group(records)


def test_collector_scores_each_group_and_isolates_a_failing_verifier(debug_run_pieces):
  from reasoning_rl.loop.rollouts import RolloutCollector
  from reasoning_rl.sampler import EngineBackend
  from reasoning_rl.verifiers.rewards import RewardFunction
  from reasoning_rl.workers.scorer import InlineScorer

  p = debug_run_pieces
  reward_fn = RewardFunction(p["config"].rewards)
  examples = [(i, p["data"].train_source.example(i)) for i in (3, 4, 5)]
  bad = examples[1][1].answer
  assert all(example.answer != bad for _, example in (examples[0], examples[2]))
  scorer = InlineScorer(_FailsOnAnswer(reward_fn, bad))
  collector = RolloutCollector(EngineBackend(p["engine"]), p["tokenizer"], p["template"], scorer,
                               num_samples=3, max_new_tokens=8, stop_strings=("</answer>",),
                               sampling=p["sampling"], seed=0)
  start = time.perf_counter()
  rollouts, sample_s, verify_s = collector.collect(examples)
  elapsed = time.perf_counter() - start
  assert rollouts.data_position.tolist() == [3, 4, 5]
  assert rollouts.status == ("ok", "error", "ok")
  assert rollouts.group_rewards()[1].tolist() == [0.0] * 3
  assert all((values[3:6] == 0.0).all() for values in rollouts.parts.values())
  # the collector's clocks time parts of the call, in seconds (not milliseconds, not a total)
  assert 0 < sample_s <= elapsed and 0 <= verify_s <= elapsed
  assert rollouts.group_size == 3 and len(rollouts.responses) == 9
  for g, (_, example) in enumerate(examples):
    assert rollouts.prompt_tokens[g].tolist() == list(p["template"].encode(example))
  assert [p["tokenizer"].decode(ids.tolist(), skip_special_tokens=True)
          for ids in rollouts.completion_ids.rows()] == list(rollouts.responses)
  assert (rollouts.logprobs.lengths == rollouts.completion_ids.lengths).all()
  # rewards of the good groups are exactly what the reward function gives the same records
  from reasoning_rl.evaluation import completion_record

  for index in (0, 2):
    example, samples = examples[index][1], range(3 * index, 3 * index + 3)
    records = [completion_record(example, rollouts.responses[s],
                                 num_tokens=int(rollouts.completion_ids.lengths[s]),
                                 truncated=bool(rollouts.truncated[s]), max_new_tokens=8)
               for s in samples]
    assert rollouts.group_rewards()[index].tolist() == [
        r.total for r in reward_fn.score_group(records)]
  assert scorer.counts() == {"ok": 2, "timeout": 0, "error": 1}


def test_dynamic_sampling_keeps_only_groups_with_signal(debug_run_pieces):
  from reasoning_rl.loop.rollouts import RolloutCollector
  from reasoning_rl.sampler import EngineBackend
  from reasoning_rl.verifiers.rewards import RewardFunction
  from reasoning_rl.workers.scorer import InlineScorer

  p = debug_run_pieces
  scorer = InlineScorer(RewardFunction({"correct": {"weight": 1.0, "verifier": "math",
                                                    "extract": "answer"}}))
  collector = RolloutCollector(EngineBackend(p["engine"]), p["tokenizer"], p["template"], scorer,
                               num_samples=2, max_new_tokens=6, stop_strings=(),
                               sampling=p["sampling"], seed=0)
  taken = []

  def take(count):
    start = sum(taken)
    taken.append(count)
    return [(i, p["data"].train_source.example(i)) for i in range(start, start + count)]

  batch = collector.sample_batch(take, num_prompts=3, dynamic_sampling=True, max_rounds=2,
                                 policy_version=7)
  assert batch.policy_version == 7
  assert batch.groups_sampled == sum(taken) and taken[0] == 3
  assert batch.rollouts.has_signal().all()
  assert sum(batch.scoring.values()) == batch.groups_sampled
  assert len(taken) == 2 or batch.rollouts.num_groups >= 3
  off = collector.sample_batch(take, num_prompts=3, dynamic_sampling=False, max_rounds=2,
                               policy_version=7)
  assert off.rollouts.num_groups == 3 and off.groups_sampled == 3


def test_telemetry_flops_equal_the_dry_run_plan_at_the_padded_shapes(debug_run_pieces):
  """One FLOP model: the step's rl_mfu numerator and the planner agree when every prompt and
  completion fills its padded length."""
  import copy
  import types

  from reasoning_rl import build, memory_plan, planning
  from reasoning_rl.loop.rl_stage import RLStage

  config = copy.deepcopy(debug_run_pieces["config"])
  model_config = build.build_policy(config)[0].config
  memory_plan.resolve_layout(config, model_config=model_config)  # as build() does
  stage = types.SimpleNamespace(run=types.SimpleNamespace(
      config=config, model_config=model_config,
      step_fn=types.SimpleNamespace(config=build.step_config(config))))
  r = config.rollout
  rows = r.num_prompts * r.num_samples
  measured = RLStage._step_flops(  # pylint: disable=protected-access
      stage, prompts=r.num_prompts, prompt_tokens=r.num_prompts * r.max_prefill_length,
      generated_tokens=rows * r.max_new_tokens,
      trained_tokens=rows * (r.max_prefill_length + r.max_new_tokens))
  assert measured == pytest.approx(planning.step_flops(config, model_config).total, rel=1e-12)


def test_compile_clock_counts_a_compilation_once():
  before = compile_clock.seconds()
  program = jax.jit(lambda x: jnp.cos(x) * 3.0 + jnp.arange(x.shape[0]))
  program(jnp.ones(11))
  compiled = compile_clock.seconds()
  assert compiled > before
  program(jnp.ones(11))  # the same signature: no compilation
  assert compile_clock.seconds() == compiled
  program(jnp.ones(12))  # a new shape compiles again
  assert compile_clock.seconds() > compiled
