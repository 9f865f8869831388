"""The calculator as an agent program (reasoning_rl/agents/examples/calculator_agent.py) against
the same episodes played in process (environments/calculator.py): equal training batches on the
debug model, the agent's settings equal to its in-process configs', and a SIGKILL inside an
episode then a rerun reproducing the uninterrupted run."""

import importlib.util
import signal
import subprocess
import sys

import numpy as np
import pytest

from reasoning_rl import build as build_lib
from reasoning_rl import guards as guards_lib
from reasoning_rl.agents.examples import calculator_agent
from reasoning_rl.loop.rl_stage import take_examples
from reasoning_rl.loop.state import LoopState
from reasoning_rl.metrics import read_metrics
from reasoning_rl.rl import advantages as advantages_lib
from reasoning_rl.rl import batching
from tests.conftest import REPO
from tests.support import agents
from tests.support.runs import stable


def config_module(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def first_step_batch(config):
  """Step 1's training batch of `config` (the arrays `TrainStep` gets) and its rollouts."""
  run = build_lib.build(config)
  loop = build_lib.build_loop(run)
  try:
    state = LoopState(guards=guards_lib.Guards({}))
    c = config.rollout
    sampled = loop.collector.sample_batch(
        lambda count: take_examples(run, state, count), num_prompts=c.num_prompts,
        dynamic_sampling=False, max_rounds=1, policy_version=0)
    rollouts = sampled.rollouts
    advantages = advantages_lib.batch_advantages(
        rollouts.group_rewards(), num_groups=c.num_prompts, group_size=c.num_samples,
        estimator=config.algo.estimator)
    rollouts = rollouts.with_advantages(advantages[:rollouts.num_groups])
    batch = batching.build_batch(
        rollouts, num_groups=c.num_prompts, group_size=c.num_samples,
        prompt_length=c.max_prefill_length, completion_length=c.max_new_tokens,
        pad_id=run.tokenizer.pad_id, with_behavior_logprobs=True)
    return batch, rollouts, sampled
  finally:
    getattr(loop.collector, "close", lambda: None)()
    run.backend.stop()
    run.scorer.close()


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
  """Step 1 of the debug calculator in process and as the agent, under a budget some episodes
  reach (the server then refuses the request that sends their value), with a seed whose first
  prompts call the calculator often."""
  configs = config_module("debug_calculator_agent")
  out = []
  for config in (configs.in_process(), configs.get_config()):
    config.workdir = str(tmp_path_factory.mktemp("run"))
    config.seed = 1
    config.rollout.max_new_tokens = agents.TIGHT_BUDGET
    if config.agent.entry:
      config.agent.entry = "tests.support.agents:tight_calculator"
    out.append(first_step_batch(config))
  return out


def test_the_agent_and_the_in_process_environment_give_equal_training_batches(batches):
  (want, in_process, _), (got, agent, sampled) = batches
  assert sampled.agent["failed"] == 0 and sampled.agent["split_segments_dropped"] == 0
  assert set(got) == set(want)
  for name in sorted(set(want) - {"behavior_logprobs"}):
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  # The sampler's log-probs agree up to float32 rounding, not bit for bit: a token's log-prob
  # comes out of a decode step batched with whatever decodes at that moment, and the agent's
  # requests reach the engine at other moments than the in-process episodes (each waits for an
  # HTTP round trip) on an engine with another cache length (agent runs prefill conversations),
  # so the same token is computed in batches of other sizes and over other attention lengths,
  # which sum in another order. Measured: 5 to 12 of 384 differ, by one or two ulps (4.8e-7 at
  # most), also with slot compaction and live-length attention off.
  np.testing.assert_allclose(got["behavior_logprobs"], want["behavior_logprobs"], rtol=0,
                             atol=2e-6)
  # Each row's first token comes from a prefill of the same prompt in both, but not from a call
  # of the same row count: the in-process episodes prefill their prompts together (4 or 8 rows),
  # the agent's first request arrives alone (1 row). XLA:CPU may tile the products of other row
  # counts differently: exact on an AVX-512 AMD, one of 16 one ulp apart on an Intel Xeon.
  np.testing.assert_array_max_ulp(got["behavior_logprobs"][:, 0], want["behavior_logprobs"][:, 0],
                                  maxulp=2)
  # the rows themselves, before the batch pads or cuts them to rollout.max_new_tokens: an
  # episode the budget ended holds no value after its last model token
  for name in ("completion_ids", "loss_mask", "token_versions"):
    assert getattr(agent, name) == getattr(in_process, name), name
  np.testing.assert_array_equal(agent.logprobs.lengths, in_process.logprobs.lengths)
  np.testing.assert_array_equal(agent.rewards, in_process.rewards)
  np.testing.assert_array_equal(agent.advantages, in_process.advantages)
  for part in ("correct", "length"):
    np.testing.assert_array_equal(agent.parts[part], in_process.parts[part])
  # the check covered episodes that called the calculator, the budget ending some, and rewards
  # that differ within groups
  turns = [len(e["turns"]) for e in in_process.episodes]
  ends = [e["episode_end"] for e in in_process.episodes]
  assert sum(t > 1 for t in turns) >= 4 and "token_budget" in ends, (turns, ends)
  assert np.any(in_process.advantages != 0)


@pytest.mark.parametrize("agent, in_process, agent_config", [
    (calculator_agent.DEBUG, "debug_calculator", "debug_calculator_agent"),
    (calculator_agent.SMOLLM2, "smollm2_calculator", "smollm2_calculator_agent")])
def test_each_agent_plays_its_in_process_configs_episode(agent, in_process, agent_config):
  """The agent's turn budgets, calculator calls and rewards are the in-process config's, and
  its agent config is the in-process config with the agent instead of the environment."""
  want = config_module(in_process).get_config()
  got = config_module(agent_config).get_config()
  e = want.environment
  assert (agent.max_calls, agent.max_turns, agent.turn_tokens, agent.max_new_tokens) == (
      e.settings["max_calls"], e.max_turns, e.turn_tokens, want.rollout.max_new_tokens)
  assert agent.rewards == want.rewards.to_dict()
  assert got.agent.entry.endswith(":debug_run" if agent is calculator_agent.DEBUG else ":run")
  assert got.environment.name == "" and e.name == "calculator"
  for section in ("rollout", "algo", "optim", "rewards"):
    assert got[section].to_dict() == want[section].to_dict(), section
  assert got.data.train == want.data.train and got.total_steps == want.total_steps


# ------------------------------------------------------------------------------ resume

CONFIG = "configs/debug_calculator_agent.py"
RUN = ("--config.total_steps=3", "--config.checkpoint.every_steps=2",
       "--config.eval.every_steps=0", "--config.logging.progress_bar=False")


def train_py(workdir, *, kill_at=None):
  """launch/train.py on the debug calculator agent; `kill_at` (version, request): SIGKILLed
  inside the agent episodes sampling with that version, at that request (tests/kill_point.py)."""
  script = ([str(REPO / "launch" / "train.py")] if kill_at is None else
            [str(REPO / "tests" / "kill_point.py"), "agent", *map(str, kill_at), "--"])
  return subprocess.run([sys.executable, *script, f"--config={CONFIG}",
                         f"--config.workdir={workdir}", *RUN],
                        cwd=REPO, capture_output=True, text=True, timeout=600)


def test_a_sigkill_inside_an_episode_then_a_rerun_ends_with_the_uninterrupted_metrics(tmp_path):
  baseline = train_py(tmp_path / "baseline")
  assert baseline.returncode == 0, baseline.stderr[-3000:]
  workdir = tmp_path / "killed"
  # step 3 samples with version 2 (the checkpoint holds step 2): 16 episodes, their first
  # turns are requests 1-16, so request 17 comes while episodes are between turns
  killed = train_py(workdir, kill_at=(2, 17))
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  assert [r["step"] for r in read_metrics(workdir / "metrics.jsonl")] == [1, 2]
  resumed = train_py(workdir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  want = stable(read_metrics(tmp_path / "baseline" / "metrics.jsonl"))
  got = stable(read_metrics(workdir / "metrics.jsonl"))
  assert [r["step"] for r in got] == [1, 2, 3]
  assert got == want
