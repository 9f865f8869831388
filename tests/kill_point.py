"""Runs launch/train.py in this process and SIGKILLs it the moment it reaches a named point.

  python tests/kill_point.py POINT VERSION [CALL] -- [train.py flags]

POINT is where, with the sampler holding policy VERSION:
- `generate`: inside the CALL-th decode call (default 2) of that version, i.e. mid-generation
  (with asynchronous rollouts that is sampling ahead, while a step trains);
- `scoring`: on entering the wait for the verifiers after that version's decoding, with groups
  still with the verifier workers;
- `train`: the moment step VERSION + 1 (the update of version VERSION) was dispatched, its
  computation running;
- `sync`: inside the weight sync of version VERSION + 1, once the sampler holds the new weights
  and before the loop counts them;
- `checkpoint`: the moment Orbax's save of the checkpoint of step VERSION started, its write in
  flight (the step's metrics row is written by then);
- `agent`: inside the agent episodes of an agent run (`config.agent.entry`) that sample with
  VERSION, as the rollout server hands its CALL-th request of them to the engine: the requests
  before it were answered, so episodes are between turns.

The kill is a real SIGKILL of this process (nothing is flushed or saved); a run that never
reaches the point finishes normally, which the caller sees as exit code 0 instead of -9.
"""

import os
import pathlib
import runpy
import signal
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
  split = sys.argv.index("--")
  point, version, *rest = sys.argv[1:split]
  version, call = int(version), int(rest[0]) if rest else 2
  sys.path.insert(0, str(REPO))
  from reasoning_rl.agents.driver import EngineDriver
  from reasoning_rl.checkpointing import Checkpointer
  from reasoning_rl.loop.weight_sync import WeightSync
  from reasoning_rl.rl.step import TrainStep
  from reasoning_rl.sampler.engine import Engine
  from reasoning_rl.workers.scorer import Scorer

  seen = {"calls": 0, "version": None}
  generate, get = Engine.generate, Scorer.get

  def kill():
    os.kill(os.getpid(), signal.SIGKILL)

  def generate_then_kill(self, *args, **kwargs):
    seen["version"] = self.policy_version
    if self.policy_version == version:
      seen["calls"] += 1
      if point == "generate" and seen["calls"] == call:
        kill()
    return generate(self, *args, **kwargs)

  def get_then_kill(self, *args, **kwargs):
    if point == "scoring" and seen["version"] == version:
      kill()
    return get(self, *args, **kwargs)

  train_step, push, save = TrainStep.call_with_outputs, WeightSync.push, Checkpointer.save
  steps = {"dispatched": 0}

  def train_then_kill(self, *args, **kwargs):
    out = train_step(self, *args, **kwargs)  # dispatched: the update runs on
    steps["dispatched"] += 1
    if point == "train" and steps["dispatched"] == version + 1:
      kill()
    return out

  def push_then_kill(self, state, pushed_version):
    out = push(self, state, pushed_version)
    if point == "sync" and pushed_version == version + 1:
      kill()
    return out

  def save_then_kill(self, step, *args, **kwargs):
    started = save(self, step, *args, **kwargs)
    if point == "checkpoint" and step == version and started:
      kill()
    return started

  submit, requests = EngineDriver.submit, {"count": 0}

  def submit_then_kill(self, request):
    if self.engine.policy_version == version:
      requests["count"] += 1
      if point == "agent" and requests["count"] == call:
        kill()
    return submit(self, request)

  Engine.generate, Scorer.get = generate_then_kill, get_then_kill
  EngineDriver.submit = submit_then_kill
  TrainStep.call_with_outputs, WeightSync.push = train_then_kill, push_then_kill
  Checkpointer.save = save_then_kill
  sys.argv = [str(REPO / "launch" / "train.py"), *sys.argv[split + 1:]]
  runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
  main()
