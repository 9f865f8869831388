"""The trainer's cadence on its own, in process: a scripted stage stands in for sampling and
training, so the test sees only when the trainer logs, checkpoints, evaluates, stops and resumes."""

import jax
import numpy as np
import pytest

from reasoning_rl import checkpointing, stop_signals
from reasoning_rl import guards as guards_lib
from reasoning_rl.errors import ExitCode, PhaseInterrupted
from reasoning_rl.metrics import read_metrics
from tests.support.loop import ScriptedStage, _fake_run, _trainer


@pytest.fixture(autouse=True)
def no_pending_preemption():
  stop_signals.clear_preemption_request()
  yield
  stop_signals.clear_preemption_request()


def test_cadence_of_logging_checkpoints_and_evaluations(tmp_path):
  run, _, closed = _fake_run(tmp_path)
  evaluations = []
  trainer = _trainer(run, ScriptedStage(), evaluations)
  assert trainer.run() == ExitCode.DONE
  assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 11))
  assert checkpointing.Checkpointer(tmp_path / "checkpoints").all_steps() == [8, 10]  # keep = 2
  assert evaluations == [0, 5, 10]  # before, every 5 steps, after (not twice at the end)
  assert closed == [True]
  assert (tmp_path / "report.md").exists() and (tmp_path / "model" / "config.json").exists()
  np.testing.assert_array_equal(trainer.state.params["w"], [10.0, 10.0])
  assert trainer.loop.data_position == 30 and trainer.loop.policy_version == 10


def test_time_based_saves_land_on_the_steps_the_clock_picks(tmp_path, monkeypatch):
  """checkpoint.every_minutes = 1 with 25 s steps on a fake clock: saves after steps 3, 6 and 9
  (75 s each) and the last step's, on every process alike (process 0's clock decides); the
  every_steps cadence (100) never comes."""
  import functools

  from reasoning_rl import trainer as trainer_lib

  now = [0.0]
  monkeypatch.setattr(trainer_lib, "SaveCadence",
                      functools.partial(trainer_lib.SaveCadence, clock=lambda: now[0]))
  # these steps take milliseconds: a save's checksums may still be written at the next due step,
  # which would skip it (test_gcs_deadlines tests the skip); here every due save happens
  monkeypatch.setattr(checkpointing.Checkpointer, "saving", lambda self: False)

  class TimedStage(ScriptedStage):
    def step(self, step, state, loop):
      now[0] += 25.0
      return super().step(step, state, loop)

  run, _, _ = _fake_run(tmp_path, **{"checkpoint.every_steps": 100,
                                     "checkpoint.every_minutes": 1.0, "checkpoint.keep": 10})
  assert _trainer(run, TimedStage(), []).run() == ExitCode.DONE
  assert checkpointing.Checkpointer(tmp_path / "checkpoints").all_steps() == [3, 6, 9, 10]


def test_guard_trip_saves_writes_stopped_md_and_exits_3(tmp_path):
  run, _, _ = _fake_run(tmp_path, **{"beta": 0.1, "guards.max_kl": 0.065})
  trainer = _trainer(run, ScriptedStage(), [])
  assert trainer.run() == ExitCode.GUARD
  assert read_metrics(tmp_path / "metrics.jsonl")[-1]["step"] == 7  # kl 0.07 > 0.065
  assert checkpointing.Checkpointer(tmp_path / "checkpoints").latest_step() == 7
  assert "max_kl" in (tmp_path / guards_lib.STOPPED_FILE).read_text()


def test_preemption_saves_then_a_rerun_resumes_the_loop_state(tmp_path):
  run, _, _ = _fake_run(tmp_path)
  evaluations = []
  assert _trainer(run, ScriptedStage(preempt_at=3), evaluations).run() == \
      ExitCode.PREEMPTED
  assert checkpointing.Checkpointer(tmp_path / "checkpoints").latest_step() == 3
  stop_signals.clear_preemption_request()
  run, versions, _ = _fake_run(tmp_path)
  stage = ScriptedStage()
  trainer = _trainer(run, stage, evaluations)
  assert trainer.run() == ExitCode.DONE
  assert versions[0] == 3  # the restored params were published as version 3
  assert trainer.loop.data_position == 30 and trainer.loop.policy_version == 10
  np.testing.assert_array_equal(trainer.state.params["w"], [10.0, 10.0])
  assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 11))
  assert evaluations == [0, 5, 10]  # step 0 is not evaluated again on resume
  assert stage.started == 1


class InterruptedStage(ScriptedStage):
  """Step `interrupt_at` is cut short while sampling, as `RLStage` is by a stop request: the loop
  state is left as after the previous step and PhaseInterrupted is raised."""

  def __init__(self, interrupt_at):
    super().__init__()
    self.interrupt_at = interrupt_at

  def step(self, step, state, loop):
    if step == self.interrupt_at:
      stop_signals._preemption_event.set()
      raise PhaseInterrupted("sampling stopped on request after 2 decode calls")
    return super().step(step, state, loop)


def _uninterrupted(tmp_path):
  run, _, _ = _fake_run(tmp_path / "reference")
  evaluations = []
  trainer = _trainer(run, ScriptedStage(), evaluations)
  assert trainer.run() == ExitCode.DONE
  return read_metrics(tmp_path / "reference" / "metrics.jsonl"), evaluations


@pytest.mark.parametrize("interrupt_at", [3, 4, 1])
def test_a_stop_while_sampling_saves_the_previous_step_and_the_rerun_redoes_the_step(
    tmp_path, interrupt_at):
  """Step 4 follows a scheduled checkpoint; step 3 does not (its save is the stop's own);
  step 1 has nothing to save."""
  reference, reference_evaluations = _uninterrupted(tmp_path)
  run, _, _ = _fake_run(tmp_path / "run")
  evaluations = []
  assert _trainer(run, InterruptedStage(interrupt_at), evaluations).run() == \
      ExitCode.PREEMPTED
  steps = checkpointing.Checkpointer(tmp_path / "run" / "checkpoints").all_steps()
  assert steps == ([interrupt_at - 1] if interrupt_at > 1 else [])
  assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == \
      list(range(1, interrupt_at))
  stop_signals.clear_preemption_request()
  run, _, _ = _fake_run(tmp_path / "run")
  trainer = _trainer(run, ScriptedStage(), evaluations)
  assert trainer.run() == ExitCode.DONE
  def untimed(rows):
    return [{k: v for k, v in row.items() if k != "time/unix"} for row in rows]

  assert untimed(read_metrics(tmp_path / "run" / "metrics.jsonl")) == untimed(reference)
  # with nothing trained there is no checkpoint: the rerun starts afresh, step-0 evaluation too
  assert evaluations == ([0] if interrupt_at == 1 else []) + reference_evaluations
  np.testing.assert_array_equal(trainer.state.params["w"], [10.0, 10.0])


@pytest.mark.parametrize("interrupted_eval", [5, 10])
def test_a_stop_during_an_evaluation_saves_the_step_and_the_rerun_evaluates_first(
    tmp_path, interrupted_eval):
  """The evaluation of step 5 (every 5 steps) or of the final step 10: the step's checkpoint
  records the evaluation as pending, and the rerun does it before anything else."""
  run, _, _ = _fake_run(tmp_path)
  evaluations = []
  trainer = _trainer(run, ScriptedStage(), evaluations)
  evaluate = trainer.evaluate

  def interrupted(step):
    if step == interrupted_eval:
      stop_signals._preemption_event.set()
      raise PhaseInterrupted("sampling stopped on request after 1 decode calls")
    return evaluate(step)

  trainer.evaluate = interrupted
  assert trainer.run() == ExitCode.PREEMPTED
  checkpointer = checkpointing.Checkpointer(tmp_path / "checkpoints")
  assert checkpointer.latest_step() == interrupted_eval
  stop_signals.clear_preemption_request()
  run, _, _ = _fake_run(tmp_path)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), run.state)
  assert checkpointer.restore(interrupted_eval, abstract)[1]["pending_eval"] == interrupted_eval
  stage = ScriptedStage()
  trainer = _trainer(run, stage, evaluations)
  assert trainer.run() == ExitCode.DONE
  assert evaluations == [0, 5, 10]
  assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 11))
  assert trainer.loop.pending_eval is None
