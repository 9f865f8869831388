"""The training loop's cadence: steps, logging, guards, evaluations, checkpoints, signals.

Everything else has one owner elsewhere: `reasoning_rl.build` turns the config into objects, the
stage (`loop.rl_stage.RLStage`, `loop.sft_stage.SFTStage`) does one step's work,
`loop.rollouts.RolloutCollector` samples and scores, `loop.state.LoopState` is the bookkeeping that
goes into checkpoints, and `loop.telemetry` turns a step's outputs into its metrics row.

A run is a function of its config: the data position is an integer, each completion's random
stream derives from (seed, data position of its prompt, sample index), and the loop state is
checkpointed, so a restart on the same workdir continues bit for bit.

Exit codes of `run()`: 0 finished, 3 a guard stopped the run (STOPPED.md), 130 interrupted (SIGINT)
or 143 preempted (SIGTERM), both after saving a checkpoint (see reasoning_rl.stop_signals).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pathlib
import tempfile
import time
from typing import Any

import jax

from reasoning_rl import checkpointing
from reasoning_rl import deadlines
from reasoning_rl import evaluation
from reasoning_rl import guards as guards_lib
from reasoning_rl import lora
from reasoning_rl import metrics as metrics_lib
from reasoning_rl import stop_signals
from reasoning_rl import storage
from reasoning_rl.build import Run, build, build_loop, eval_max_new_tokens
from reasoning_rl.errors import CheckpointError, ExitCode, PhaseInterrupted
from reasoning_rl.loop.state import LoopState
from reasoning_rl.multihost.bulk import BulkChannel
from reasoning_rl.run_checkpoint import LORA_FILE, LORA_FILE_FORMAT_VERSION

log = logging.getLogger("reasoning_rl")


def write_model_files(workdir, model_config, tokenizer, *, lora_record=None) -> None:
  """workdir/model/: config.json + tokenizer files (+ lora.json for a LoRA run: its format_version,
  settings, base, base fingerprint), so checkpoints load without the run's config
  (`run_checkpoint` reads them).

  Written to a local directory first (tokenizer libraries write local files only), then copied.
  """
  with tempfile.TemporaryDirectory(prefix="reasoning_rl-model-") as staging:
    local = pathlib.Path(staging)
    (local / "config.json").write_text(json.dumps(model_config.to_hf_config(), indent=2))
    if lora_record is not None:
      (local / LORA_FILE).write_text(json.dumps(lora_record, indent=2))
    tokenizer.save(local)
    storage.copy_tree(local, storage.path(workdir) / "model")


class Trainer:
  """Runs a built `Run` (RL or an SFT stage) on its workdir; `run()` returns the exit code."""

  def __init__(self, run: Run, *, stage=None):
    """`stage` replaces the one the config names (`RLStage` / `SFTStage`); tests use it."""
    self.run_parts = run
    self.config = run.config
    deadlines.apply_config(run.config)
    self.workdir = storage.path(run.config.workdir)
    self.state = run.state
    run.state = None  # the trainer owns the (donated) train state from here on
    # LoRA: checkpoints hold adapters, and the fingerprint of the base they belong to
    frozen = getattr(self.state, "frozen_params", None)
    self.lora_base = lora.base_fingerprint(frozen) if frozen is not None else None
    self.loop = LoopState(guards=guards_lib.Guards(
        run.config.guards, max_failed_episode_frac=run.config.agent.max_failed_frac))
    self.cluster = run.cluster
    loop = build_loop(run, stage=stage)
    self.collector, self.stage = loop.collector, loop.stage
    # eval.instruction_variants: the held-out set is also evaluated under these templates
    self.variant_templates = loop.variant_templates

  @classmethod
  def from_config(cls, config) -> "Trainer":
    return cls(build(config))

  # ---------------------------------------------------------------------------- checkpoints

  def _checkpoint_tree(self):
    """The train state without the frozen reference and (LoRA) the frozen base: both are
    rebuilt identically at start-up."""
    return self.state.replace(ref_params=None, frozen_params=None)

  def _lora_record(self) -> dict | None:
    """model/lora.json of a LoRA run: what loading its adapters without the config needs."""
    settings = lora.LoraSettings.from_config(self.config)
    if not settings.enabled:
      return None
    m = self.config.model
    return {"format_version": LORA_FILE_FORMAT_VERSION, "lora": dataclasses.asdict(settings),
            "fingerprint": self.lora_base,
            "base": {"path": m.path, "dtype": m.dtype,
                     "random_seed": None if m.path else self.config.seed}}

  def _checkpoint_meta(self) -> dict:
    meta = self.loop.to_meta()
    if self.lora_base is not None:
      meta["lora_base"] = self.lora_base
    return meta

  def _restore(self, checkpointer) -> int:
    """Trainer processes restore the newest checkpoint; every process gets its step from process
    0, and the sampler replicas the restored policy. Each trainer process loads the loop state
    it restored itself; sampler-only processes get process 0's, its queued batches (bulk data)
    summarized (`LoopState.summary_meta`): the broadcast stays a small control message.

    Multi-process: the bulk channel is attached here, and process 0 clears the files a previous
    run left in it before the broadcast (no process writes any before it)."""
    step, meta, problem = 0, None, None
    if self.cluster.multi_process:
      self.cluster.bulk = BulkChannel(self.cluster.exchange, self.workdir)
      if self.cluster.is_primary:
        self.cluster.bulk.clear()
    if self.cluster.is_trainer:
      abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
          self._checkpoint_tree())
      restored = checkpointer.restore_latest(abstract)
      if restored is not None:
        step, tree, meta = restored
        self.state = tree.replace(ref_params=self.state.ref_params,
                                  frozen_params=self.state.frozen_params)
        # the loop state's format first: a refused one stops every process before any is loaded
        problem = (self.loop.meta_problem(meta, self._meta_file(step))
                   or lora.base_mismatch(meta.get("lora_base"), self.lora_base,
                                         checkpoint=checkpointer.directory / str(step)))
    own_step, own_meta = step, meta
    shared = meta  # what sampler-only processes load: queued batches as summaries
    if meta is not None and not problem and self.cluster.multi_process:
      shared = LoopState.summary_meta(meta)
    step, meta, problem = self.cluster.exchange.broadcast("restored", [step, shared, problem],
                                                          source=0)
    if not problem and self.cluster.is_trainer and own_step != step:
      problem = (f"{checkpointer.directory}: this trainer process restored step {own_step}, "
                 f"process 0 step {step}; the trainer processes must see the same checkpoints")
    if problem:  # every process stops with the same line
      raise CheckpointError(problem)
    if step == 0:
      return 0
    if self.cluster.is_trainer:
      meta = own_meta
    self.loop.load_meta(meta, self._meta_file(step))
    self.run_parts.weight_sync.push(self.state, self.loop.policy_version)
    return step

  def _stop_backend(self) -> None:
    """The rollout backend's threads, servers or buffers go when the run ends, as the scorer's
    (and an agent run's rollout server, `agents.collector.AgentCollector.close`)."""
    close_collector = getattr(getattr(self, "collector", None), "close", None)
    if close_collector is not None:
      close_collector()
    if self.run_parts.backend is not None:
      self.run_parts.backend.stop()

  def _meta_file(self, step: int) -> str:
    """The file Orbax keeps step `step`'s `meta` item in (its JsonCheckpointHandler's name)."""
    return str(self.workdir / "checkpoints" / str(step) / "meta" / "metadata")

  # ---------------------------------------------------------------------------- the loop

  def run(self) -> int:
    c, cluster = self.config, self.cluster
    primary = cluster.is_primary  # the one process that writes the run's files
    if primary:
      self.workdir.mkdir(parents=True, exist_ok=True)
    checkpointer = checkpointing.Checkpointer(
        self.workdir / "checkpoints", keep=c.checkpoint.keep, async_save=c.checkpoint.async_save,
        active_processes=set(cluster.topology.trainer_processes) if cluster.multi_process
        else None) if cluster.is_trainer else None
    deadlines.set_resume_point(checkpointer.resume_point if checkpointer is not None else None)
    restore_signal_handlers = stop_signals.install_preemption_handler()
    try:
      start_step = self._restore(checkpointer)
      if primary:  # after the restore: a refused checkpoint (another format) leaves model/ as is
        write_model_files(self.workdir, self.run_parts.model_config, self.run_parts.tokenizer,
                          lora_record=self._lora_record())
      writer = metrics_lib.MetricsWriter(self.workdir, resume_step=start_step or None,
                                         tensorboard=c.logging.tensorboard) if primary else None
    except BaseException:
      # nothing started: an in-process caller (a notebook) gets its own Ctrl-C back, and the
      # verifier workers and the checkpointer's threads end here rather than at process exit
      with contextlib.ExitStack() as releases:
        releases.callback(restore_signal_handlers)
        releases.callback(self.run_parts.scorer.close)
        releases.callback(self._stop_backend)
        if checkpointer is not None:
          releases.callback(checkpointer.close)
      raise
    progress = metrics_lib.ProgressBar(c.total_steps, initial=start_step,
                                       enabled=None if c.logging.progress_bar and primary
                                       else False)
    exit_code = ExitCode.DONE
    cadence = SaveCadence(c.checkpoint.every_steps, c.checkpoint.every_minutes, c.total_steps)

    def save(step: int) -> None:
      deadlines.set_phase(f"saving checkpoint step {step}")
      cadence.saved()
      if writer is not None:
        writer.flush()  # a checkpoint never holds steps whose metrics are not in the workdir
      if checkpointer is not None:
        checkpointer.save(step, self._checkpoint_tree(), self._checkpoint_meta(), force=True)

    def save_due(step: int) -> bool:
      """Step `step` is saved: on the step cadence, or (every_minutes) on process 0's clock,
      unless a save is still in flight there. Every process takes process 0's decision."""
      if not cadence.by_time:
        return cadence.due(step)
      busy = checkpointer is not None and checkpointer.saving()
      return bool(cluster.exchange.broadcast(
          "save_due", cadence.due(step, saving=busy) if primary else None, source=0))

    completed = start_step  # the newest step whose train state and loop state are current

    def stop_on_signal(why: str) -> int:
      if completed > 0:
        save(completed)
        if checkpointer is not None:
          checkpointer.wait()  # committed before the line says so (and before the report)
      code = stop_signals.interrupt_exit_code()
      saved = f"checkpoint of step {completed} saved" if completed else "nothing trained yet"
      progress.write(f"{_ENDINGS[code]} {why}: {saved}; rerun on the same workdir to resume")
      return code

    try:
      if start_step == 0 and primary:
        (self.workdir / guards_lib.STOPPED_FILE).unlink(missing_ok=True)
      if start_step == 0:
        progress.set_accuracy(self.evaluate(0)["accuracy"])
      trip = self._pending_evaluation(progress)  # one a stop interrupted before the restart
      self.stage.start(self.loop)
      step = start_step
      while trip is None and step < c.total_steps:
        step += 1
        deadlines.set_phase(f"training step {step}")
        self.state, row = self.stage.step(step, self.state, self.loop)
        completed = step
        if primary:
          writer.write(step, row)
        if (primary and c.logging.rollouts_every_steps
            and step % c.logging.rollouts_every_steps == 0):
          records = self.stage.rollout_records(step)
          if records:
            writer.write_rollouts(step, records)
        progress.update(step, row)
        trip = self.loop.guards.check_step(step, row)
        if trip is None and (step == c.total_steps or (
            c.eval.every_steps and step % c.eval.every_steps == 0)):
          self.loop.pending_eval = step  # evaluated before the step's checkpoint is written
          trip = self._pending_evaluation(progress)
        if trip is not None:
          break
        if save_due(step):
          save(step)
        # a signal may reach the processes at different steps: they stop at the same one
        if cluster.exchange.any("preempted", stop_signals.preemption_requested()):
          exit_code = stop_on_signal("after the step")
          break
      if trip is not None:
        save(completed)
        if primary:
          guards_lib.write_stopped_md(self.workdir, trip)
        log.error("guard %s stopped the run at step %d: %s", trip.guard, completed, trip.message)
        progress.write(f"stopped by guard {trip.guard} at step {completed}: {trip.message} "
                       f"(see {self.workdir / guards_lib.STOPPED_FILE})")
        exit_code = ExitCode.GUARD
    except PhaseInterrupted as interrupted:
      # every process raised it together (the collector and the evaluation agree through the
      # exchange); the interrupted step or evaluation is redone by the rerun
      log.info("stop request inside a long phase: %s", interrupted)
      exit_code = stop_on_signal("while sampling" if self.loop.pending_eval is None
                                 else f"during the evaluation of step {self.loop.pending_eval}")
    finally:
      deadlines.set_phase("closing the run (metrics, checkpoints)")
      # each resource is released even when one before it fails (a save that failed in the
      # background raises CheckpointError from close(): the run's one error line, exit 4, and
      # no success summary)
      with contextlib.ExitStack() as releases:
        if exit_code not in (ExitCode.PREEMPTED, ExitCode.INTERRUPTED):
          # after a stop on a signal (here or on another process), keep ours: a late SIGTERM
          # (this host's own preemption notice) must not kill the orderly exit with 130 / 143
          releases.callback(restore_signal_handlers)
        releases.callback(self.run_parts.scorer.close)
        releases.callback(self._stop_backend)
        releases.callback(progress.close)
        if writer is not None:
          releases.callback(writer.close)
        if checkpointer is not None:
          releases.callback(checkpointer.close)
    if primary:
      self._finish(exit_code)
    return exit_code

  def _finish(self, exit_code: int) -> None:
    """report.md (with plots) and a short summary on stdout, however the run ended."""
    from reasoning_rl.report import write_report  # pylint: disable=import-outside-toplevel

    report = write_report(self.workdir)
    print(summary_text(self.workdir, exit_code, report), flush=True)

  # ---------------------------------------------------------------------------- evaluation

  def _pending_evaluation(self, progress):
    """Runs the evaluation `loop.pending_eval` names, if any; returns a guard's trip or None.
    The final step's evaluation is reported, not guarded (the run ends there anyway)."""
    step = self.loop.pending_eval
    if step is None:
      return None
    result = self.evaluate(step)
    self.loop.pending_eval = None
    progress.set_accuracy(result["accuracy"])
    return None if step == self.config.total_steps else self.loop.guards.check_eval(step, result)

  def evaluate(self, step: int) -> dict[str, Any]:
    """Greedy pass@1 on the held-out examples (+ canaries); eval/step_XXXXXXXX.json."""
    c, run = self.config, self.run_parts
    start = time.perf_counter()

    def evaluate_with(template, canaries=()):
      return evaluation.run_evaluation(
          run.backend, run.tokenizer, template, run.data.eval_examples, run.scorer,
          num_samples=c.eval.num_samples, temperature=c.eval.temperature,
          max_new_tokens=eval_max_new_tokens(c), stop_strings=tuple(c.rollout.stop_strings),
          seed=c.seed, canaries=canaries, should_stop=stop_signals.preemption_requested,
          episodes=run.episodes)

    def evaluate_all():
      result = evaluate_with(run.template, tuple(c.eval.canaries))
      if self.variant_templates:
        result["variants"] = [
            {"instruction": instruction, **evaluation.headline(evaluate_with(template))}
            for instruction, template in self.variant_templates]
      return result

    # one sampler replica evaluates; every process gets the result (guards look at it)
    result = self.cluster.evaluate(evaluate_all)
    result["time/eval_s"] = time.perf_counter() - start
    if self.cluster.is_primary:
      evaluation.write_eval_result(self.workdir, step, result)
    log.info("held-out accuracy at step %d: %.3f", step, result["accuracy"])
    return result


class SaveCadence:
  """When the loop saves: every `every_steps` steps and at `total_steps`; with `every_minutes`
  also once that long has passed since the last save started (Orbax's continuous checkpointing
  policy, as MaxText and Tunix use it), skipped while a save is still in flight so training never
  waits for one. The clock starts with the run (a resume included).

  A time-based save lands on whichever step ends after the interval, so which steps have
  checkpoints differs from run to run; the metrics do not, because a resume from any step is
  exact (the loop state is in the checkpoint, module docstring)."""

  def __init__(self, every_steps: int, every_minutes: float, total_steps: int,
               clock=time.monotonic):
    self.every_steps, self.total_steps = every_steps, total_steps
    self.interval_s = 60.0 * every_minutes
    self._clock = clock
    self._last = clock()

  @property
  def by_time(self) -> bool:
    return self.interval_s > 0

  def due(self, step: int, *, saving: bool = False) -> bool:
    if step % self.every_steps == 0 or step == self.total_steps:
      return True
    return self.by_time and not saving and self._clock() - self._last >= self.interval_s

  def saved(self) -> None:
    self._last = self._clock()


_ENDINGS = {ExitCode.DONE: "finished", ExitCode.GUARD: "stopped by a guard",
            ExitCode.PREEMPTED: "preempted", ExitCode.INTERRUPTED: "interrupted"}


def summary_text(workdir: pathlib.Path, exit_code: int, report: pathlib.Path) -> str:
  """The few lines printed when a run ends: how it ended, held-out accuracy, where things are."""
  ended = {**_ENDINGS,
           ExitCode.GUARD: f"stopped by a guard (see {workdir / guards_lib.STOPPED_FILE})",
           ExitCode.PREEMPTED: "preempted (checkpoint saved; rerun to resume)",
           ExitCode.INTERRUPTED: "interrupted (checkpoint saved; rerun to resume)"}
  rows = metrics_lib.read_metrics(workdir / metrics_lib.METRICS_FILE) if (
      workdir / metrics_lib.METRICS_FILE).exists() else []
  lines = [f"run {ended.get(exit_code, f'ended with code {exit_code}')} after step "
           f"{rows[-1]['step'] if rows else 0}"]
  results = evaluation.read_eval_results(workdir)
  if results:
    trail = " -> ".join(f"{r['accuracy']:.1%} (step {r['step']})" for r in results)
    lines.append(f"held-out accuracy on {results[-1]['num_examples']} examples: {trail}")
    for index, variant in enumerate(results[-1].get("variants", ())):
      trail = " -> ".join(f"{r['variants'][index]['accuracy']:.1%} (step {r['step']})"
                          for r in results if len(r.get("variants", ())) > index)
      lines.append(f"  reworded ({variant['instruction']!r}): {trail}")
  if rows and "reward/mean" in rows[-1]:
    lines.append(f"train reward/mean: {rows[0]['reward/mean']:.3f} (step {rows[0]['step']}) -> "
                 f"{rows[-1]['reward/mean']:.3f} (step {rows[-1]['step']})")
  lines.append(f"report: {report}   metrics: {workdir / metrics_lib.METRICS_FILE}   "
               f"logs: {workdir / 'logs'}")
  return "\n".join(lines)
