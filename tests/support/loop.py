"""Pieces of the RL loop for tests that drive it without a model: scored batches, scripted stages, a
trainer over a fake run, a written run to replay. (From test_faults.py, test_loop.py,
test_replay.py, test_trainer_cadence.py.)"""

import json
import pathlib
import types

import jax
import jax.numpy as jnp
from flax import nnx

from reasoning_rl import stop_signals
from reasoning_rl.checkpointing import Checkpointer
from reasoning_rl.config import base_config
from reasoning_rl.loop.state import SampledBatch
from reasoning_rl.loop.weight_sync import WeightSync
from reasoning_rl.metrics import MetricsWriter
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.transformer import create_model
from reasoning_rl.multihost.cluster import local_cluster
from reasoning_rl.rl.train_state import TrainState
from reasoning_rl.trainer import Trainer
from reasoning_rl.verifiers.rewards import RewardFunction
from tests.support import rollouts
from tests.support.generation import write_word_tokenizer


def _run_workdir(directory: pathlib.Path, nan: bool):
  """A training run's layout: model/ (config + tokenizer) and one checkpoint of the policy."""
  hf = dict(model_type="qwen2", vocab_size=97, hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
  config = ModelConfig.from_hf_config(hf, source="test")
  (directory / "model").mkdir(parents=True)
  (directory / "model" / "config.json").write_text(json.dumps(config.to_hf_config()))
  write_word_tokenizer(directory / "model")
  params = nnx.state(create_model(config))
  if nan:
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x.at[0].set(jnp.nan) if "final_norm" in jax.tree_util.keystr(path) else x,
        params)
  with Checkpointer(directory / "checkpoints") as ckpt:
    ckpt.save(6, {"params": params, "step": jnp.int32(6)}, {}, force=True)
  return directory


def _batch():
  return SampledBatch(
      rollouts=rollouts.record(
          rollouts.group([1.0, 0.0], [3, 5], position=11, truncated=[False, True],
                         responses=("a", "b")),
          rollouts.group([0.5, 0.5], [2, 2], position=12, parts={"correct": [0.0, 0.0]},
                         responses=("c", "d"), status="timeout")),
      outcome={"groups/all_pass_frac": 0.0, "groups/all_fail_frac": 0.5}, groups_sampled=4,
      scoring={"ok": 2, "timeout": 1, "error": 1}, sample_s=2.0, verify_s=0.5, policy_version=3)


ORIGINAL = {"correct": {"weight": 1.0, "verifier": "math", "extract": "answer_or_boxed"},
            "format": {"weight": 0.5}}


# (step, completion, ground truth, changes under ANSWER_ONLY)
COMPLETIONS = [
    (1, "<think>2+2</think><answer>4</answer>", "4", False),
    (1, "so the result is \\boxed{4}", "4", True),
    (1, "\\boxed{5}", "4", False),
    (1, "<answer>3</answer> then \\boxed{4}", "4", False),
    (2, "<think>a</think><answer>\\boxed{7}</answer>", "7", False),
    (2, "clearly \\boxed{\\frac{14}{2}}", "7", True),
]


def write_run(workdir: pathlib.Path) -> None:
  reward_fn = RewardFunction(ORIGINAL)
  with MetricsWriter(workdir, tensorboard=False) as writer:
    for step in (1, 2):
      records = []
      for index, (s, completion, truth, _) in enumerate(COMPLETIONS):
        if s != step:
          continue
        record = {"completion": completion, "ground_truth": truth, "task": "math",
                  "metadata": {}, "tests": [], "num_tokens": 12, "truncated": False,
                  "prompt": "<templated> q", "task_prompt": "q",
                  "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 64, "seed": 0}}
        reward = reward_fn(record)
        records.append({**record, "step": step, "prompt_id": index // 2, "group_id": index // 2,
                        "sample_index": index % 2, "reward": reward.total,
                        **{f"reward/{k}": v for k, v in reward.parts.items()},
                        "advantage": 0.0, "policy_version": step,
                        "verifier_version": reward.verifier_version})
      writer.write_rollouts(step, records)


class ScriptedStage:
  """Each step adds 1 to the single parameter and reports `kl` = the step number / 100."""

  def __init__(self, preempt_at=None):
    self.preempt_at = preempt_at
    self.started = 0

  def start(self, loop):
    self.started += 1

  def step(self, step, state, loop):
    loop.data_position += 3
    loop.policy_version += 1
    if step == self.preempt_at:
      stop_signals._preemption_event.set()  # what the SIGTERM handler does
    state = state.replace(params={"w": state.params["w"] + 1.0}, step=state.step + 1)
    return state, {"loss": float(step), "kl": step / 100, "reward/mean": 0.5,
                   "data_position": loop.data_position, "policy_version": loop.policy_version}

  def rollout_records(self, step):
    return [{"step": step}]


def _fake_run(workdir, **overrides):
  config = base_config()
  config.workdir = str(workdir)
  config.total_steps = 10
  config.checkpoint.every_steps = 4
  config.checkpoint.async_save = False
  config.eval.every_steps = 5
  config.logging.progress_bar = False
  config.logging.tensorboard = False
  config.logging.rollouts_every_steps = 0
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  versions = []
  backend = types.SimpleNamespace(
      update_weights=lambda params, version, adapters_only: versions.append(version),
      stop=lambda: None)
  tokenizer = types.SimpleNamespace(save=lambda directory: None)
  model_config = types.SimpleNamespace(to_hf_config=lambda: {"model_type": "fake"})
  closed = []
  scorer = types.SimpleNamespace(close=lambda: closed.append(True))
  state = TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.zeros((2,))}, opt_state={},
                     skipped_updates=jnp.zeros((), jnp.int32))
  step_fn = types.SimpleNamespace(sampler_weights=lambda state: state.params,
                                  config=types.SimpleNamespace(trains_adapters=False))
  cluster = local_cluster()
  run = types.SimpleNamespace(
      config=config, state=state, backend=backend, tokenizer=tokenizer,
      template=None, scorer=scorer, sampling=None, model_config=model_config, cluster=cluster,
      step_fn=step_fn, weight_sync=WeightSync(step_fn, backend, cluster), episodes=None,
      teacher=None)
  return run, versions, closed


def _trainer(run, stage, evaluations):
  trainer = Trainer(run, stage=stage)

  def evaluate(step):
    evaluations.append(step)
    return {"accuracy": 0.5, "response_length/mean": 4.0, "step": step}

  trainer.evaluate = evaluate
  return trainer
