"""The run's on-disk formats carry a version, and readers refuse any version they do not read.

One group per format (docs/architecture.md §3.3): a checkpoint step (its `keys` item and its
CHECKSUMS.json), the loop state in a checkpoint's `meta`, model/lora.json, run_config.json, rollout
records. For
each: the version is written, a file of version 999 is refused with one line naming the file, a
current file round-trips, and a file written before versions existed is read (its content is the
current format) or refused with one line (an older content).
"""

import collections
import json
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl import checkpoint_layout, checkpoint_manifest, stop_signals
from reasoning_rl import guards as guards_lib
from reasoning_rl.checkpoint_layout import CHECKPOINT_FORMAT_VERSION
from reasoning_rl.checkpoint_manifest import (CHECKSUMS_FILE, MANIFEST_VERSION,
                                              CheckpointCorruptError)
from reasoning_rl.checkpointing import Checkpointer
from reasoning_rl.config import base_config
from reasoning_rl.errors import CheckpointError, ConfigError, ExitCode
from reasoning_rl.loop.state import LOOP_STATE_FORMAT_VERSION, InFlight, InFlightGroup, LoopState
from reasoning_rl.sampler.rollout import Completion, Unfinished
from reasoning_rl.metrics import ROLLOUT_FORMAT_VERSION, MetricsWriter
from reasoning_rl.models import load
from reasoning_rl.plain_data import plain
from reasoning_rl.run_checkpoint import (LORA_FILE_FORMAT_VERSION, load_model, read_lora_file,
                                         scans_layers)
from reasoning_rl.replay import replay
from reasoning_rl.workdir import (FINGERPRINT_FILE, RUN_CONFIG_FORMAT_VERSION,
                                  check_or_write_fingerprint)
from tests.support.loop import (
    COMPLETIONS, ORIGINAL, ScriptedStage, _batch, _fake_run, _run_workdir, _trainer, write_run)


def _one_line(error) -> str:
  text = str(error.value)
  assert "\n" not in text, text
  return text


def _rewrite_json(path, change) -> None:
  path.write_text(json.dumps(change(json.loads(path.read_text()))))


# ------------------------------------------------------------------------------ checkpoint steps


def _tree(value):
  return {"w": jnp.full((3,), value, jnp.float32), "key": jax.random.key(7)}


def _abstract():
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree(0.0))


@pytest.fixture()
def step_dir(tmp_path):
  """A checkpoint directory with one saved step (1); returns the step's directory."""
  with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
    ckpt.save(1, _tree(1.0), {"note": "one"}, force=True)
  return tmp_path / "checkpoints" / "1"


def _rewrite_keys(step_dir, change) -> None:
  """Edits the step's `keys` item, then its manifest, so only the edit differs (not corruption)."""
  _rewrite_json(step_dir / "keys" / "metadata", change)
  checkpoint_manifest.write_checksums(step_dir)


def test_a_checkpoint_step_records_its_format_version_and_round_trips(step_dir):
  keys = json.loads((step_dir / "keys" / "metadata").read_text())
  assert keys["format_version"] == CHECKPOINT_FORMAT_VERSION == 1
  assert json.loads((step_dir / CHECKSUMS_FILE).read_text())["version"] == MANIFEST_VERSION == 3
  with Checkpointer(step_dir.parent) as ckpt:
    step, state, meta = ckpt.restore_latest(_abstract())
  assert (step, meta) == (1, {"note": "one"})
  np.testing.assert_array_equal(state["w"], [1.0, 1.0, 1.0])
  assert jax.random.key_data(state["key"]).tolist() == jax.random.key_data(
      jax.random.key(7)).tolist()


def test_a_checkpoint_of_another_format_version_is_refused_and_kept(step_dir):
  _rewrite_keys(step_dir, lambda keys: {**keys, "format_version": 999})
  with Checkpointer(step_dir.parent) as ckpt, pytest.raises(CheckpointError) as error:
    ckpt.restore_latest(_abstract())
  assert not isinstance(error.value, CheckpointCorruptError)
  assert _one_line(error) == (
      f"{step_dir / 'keys'}: checkpoint format_version 999, but this reasoning_rl reads version 1 "
      "only; restore the step with the reasoning_rl that wrote it, or start a new workdir")
  assert step_dir.is_dir()  # not moved aside as corrupt: a newer reasoning_rl may read it
  with pytest.raises(CheckpointError, match="checkpoint format_version 999"):
    checkpoint_layout.check_format(step_dir)  # the file-level check run_checkpoint uses


def test_a_checkpoint_written_before_versions_reads_as_version_1(step_dir):
  _rewrite_keys(step_dir, lambda keys: {"impls": keys["impls"]})  # what such a step holds
  checkpoint_layout.check_format(step_dir)
  with Checkpointer(step_dir.parent) as ckpt:
    assert ckpt.restore(1, _abstract())[1] == {"note": "one"}


def test_loading_a_run_checkpoint_of_another_format_version_is_refused(tmp_path):
  """run_checkpoint.load_model of a run workdir (evaluate / generate) reads the step past
  Checkpointer."""
  workdir = _run_workdir(tmp_path / "run", nan=False)  # test_faults loads it intact
  step_dir = workdir / "checkpoints" / "6"
  _rewrite_keys(step_dir, lambda keys: {**keys, "format_version": 999})
  with pytest.raises(CheckpointError) as error:
    load_model(workdir)
  assert _one_line(error).startswith(f"{step_dir / 'keys'}: checkpoint format_version 999, ")


@pytest.mark.parametrize("version", [2, 999])
def test_a_manifest_of_another_version_is_refused_and_kept(step_dir, version):
  """Version 2 held SHA-256 digests; it was never released and is refused like 999."""
  _rewrite_json(step_dir / CHECKSUMS_FILE, lambda manifest: {**manifest, "version": version})
  with Checkpointer(step_dir.parent) as ckpt, pytest.raises(CheckpointError) as error:
    ckpt.restore_latest(_abstract())
  assert not isinstance(error.value, CheckpointCorruptError)
  assert _one_line(error).startswith(
      f"{step_dir / CHECKSUMS_FILE}: manifest version {version}, but this reasoning_rl reads "
      "version 3 only;")
  assert "delete the file to restore the step unverified" in str(error.value)
  assert step_dir.is_dir()


# ------------------------------------------------------------------------------ loop state


def _loop_state(**fields):
  return LoopState(guards=guards_lib.Guards(base_config().guards), **fields)


def test_the_loop_state_records_its_format_version_and_round_trips():
  state = _loop_state(data_position=17, policy_version=4, queue=collections.deque([_batch()]),
                      pending_eval=5)
  meta = json.loads(json.dumps(state.to_meta()))  # what the checkpoint's meta item holds
  assert meta["format_version"] == LOOP_STATE_FORMAT_VERSION == 3
  restored = _loop_state()
  assert restored.meta_problem(meta, "m.json") is None
  restored.load_meta(meta, "m.json")
  assert (restored.data_position, restored.policy_version, restored.pending_eval) == (17, 4, 5)
  assert list(restored.queue) == [_batch()] and restored.to_meta() == state.to_meta()


def test_a_loop_state_of_another_format_version_is_refused_before_anything_loads():
  meta = {**_loop_state(data_position=17).to_meta(), "format_version": 999}
  state = _loop_state()
  line = ("ckpt/4/meta/metadata: loop state format_version 999, but this reasoning_rl reads "
          "versions 1, 2, 3 only; resume with the reasoning_rl that wrote it, or start a new "
          "workdir")
  assert state.meta_problem(meta, "ckpt/4/meta/metadata") == line
  with pytest.raises(CheckpointError) as error:
    state.load_meta(meta, "ckpt/4/meta/metadata")
  assert _one_line(error) == line
  assert state.data_position == 0  # nothing loaded


# A queued batch as loop states of format_version 1 and 2 held it (before the columnar record):
# `_batch()`'s groups as [data position, fields, responses, status], numbers as lists.
_VERSION_2_BATCH = {
    "groups": [
        [11, {"prompt_tokens": [5, 6, 7], "completion_ids": [[1, 2, 3], [1, 2, 3, 4, 5]],
              "logprobs": [[-0.5] * 3, [-0.5] * 5], "rewards": [1.0, 0.0],
              "parts": {"correct": [1.0, 0.0]}, "truncated": [False, True],
              "sampling_logprobs": [[-0.5] * 3, [-0.5] * 5], "sampling": None,
              "loss_masks": None, "experts": None}, ["a", "b"], "ok"],
        [12, {"prompt_tokens": [5, 6, 7], "completion_ids": [[1, 2], [1, 2]],
              "logprobs": [[-0.5] * 2, [-0.5] * 2], "rewards": [0.5, 0.5],
              "parts": {"correct": [0.0, 0.0]}, "truncated": [False, False],
              "sampling_logprobs": [[-0.5] * 2, [-0.5] * 2], "sampling": None,
              "loss_masks": None, "experts": None}, ["c", "d"], "timeout"]],
    "outcome": {"groups/all_pass_frac": 0.0, "groups/all_fail_frac": 0.5}, "groups_sampled": 4,
    "scoring": {"ok": 2, "timeout": 1, "error": 1}, "sample_s": 2.0, "verify_s": 0.5,
    "policy_version": 3, "exact": None, "decode": None, "partial": None}


@pytest.mark.parametrize("version", [1, 2])
def test_queued_batches_of_a_version_2_loop_state_read_into_the_columnar_record(version):
  """A resume of a run checkpointed before the record changed trains on the same batch."""
  meta = {"format_version": version, "data_position": 17, "policy_version": 4,
          "guards": _loop_state().guards.state_dict(), "queue": [_VERSION_2_BATCH],
          "pending_eval": None, **({"in_flight": []} if version == 2 else {})}
  state = _loop_state()
  state.load_meta(json.loads(json.dumps(meta)), "m.json")
  assert list(state.queue) == [_batch()]
  assert state.to_meta()["format_version"] == 3


def test_partial_rollouts_in_flight_round_trip_and_version_1_reads_with_none():
  finished = Completion(prompt_id=7, sample_index=0, prompt_tokens=[1, 2], completion_ids=[3, 4],
                        logprobs=[-0.5, -0.25], sampling_logprobs=None, finish_reason="stop_id",
                        truncated=False, policy_version=2, token_versions=[2, 3])
  in_flight = InFlight([InFlightGroup(
      7, finished={0: finished}, unfinished={1: Unfinished(7, 1, [5], [-1.0], [-0.5], [3])},
      scored=None)])
  state = _loop_state(data_position=9, policy_version=4, in_flight=in_flight)
  meta = json.loads(json.dumps(state.to_meta()))
  restored = _loop_state()
  restored.load_meta(meta, "m.json")
  assert restored.in_flight == in_flight and restored.to_meta() == state.to_meta()
  version_1 = {**meta, "format_version": 1}
  del version_1["in_flight"]
  old = _loop_state()
  old.load_meta(version_1, "m.json")
  assert old.data_position == 9 and old.in_flight == InFlight()


def test_a_loop_state_written_before_versions_reads_as_version_1_or_is_refused():
  current = _loop_state(data_position=17, queue=collections.deque([_batch()])).to_meta()
  unversioned = {k: v for k, v in current.items() if k != "format_version"}
  state = _loop_state()
  state.load_meta(json.loads(json.dumps(unversioned)), "m")  # exactly version 1's content
  assert state.data_position == 17 and list(state.queue) == [_batch()]
  older = {k: v for k, v in unversioned.items() if k != "pending_eval"}
  assert _loop_state().meta_problem(older, "ckpt/4/meta/metadata") == (
      "ckpt/4/meta/metadata: loop state from before format_version 1 (it lacks 'pending_eval'), "
      "which this reasoning_rl does not resume; start a new workdir, or resume with the "
      "reasoning_rl that wrote it")
  # a queued batch of the never-released form (3-item groups, timeouts / verifications counts)
  old_batch = {**current["queue"][0], "timeouts": 1, "verifications": 3}
  del old_batch["scoring"]
  problem = _loop_state().meta_problem({**unversioned, "queue": [old_batch]}, "m")
  assert problem.startswith("m: loop state of format_version 1 does not parse (TypeError: ")
  assert "\n" not in problem


@pytest.fixture()
def restore_signal_handlers():
  """Trainer.run installs the stop-request handlers (and keeps them after a stop on a signal)."""
  previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
  stop_signals.clear_preemption_request()
  yield
  for signum, handler in previous.items():
    signal.signal(signum, handler)
  stop_signals.clear_preemption_request()


def test_a_run_refuses_to_resume_a_loop_state_of_another_version(tmp_path,
                                                                 restore_signal_handlers):
  """The refusal is one line naming the file, before the rerun writes anything."""
  run, _, _ = _fake_run(tmp_path, total_steps=4)
  assert _trainer(run, ScriptedStage(), []).run() == ExitCode.DONE
  step_dir = tmp_path / "checkpoints" / "4"
  meta_file = step_dir / "meta" / "metadata"
  assert json.loads(meta_file.read_text())["format_version"] == 3
  _rewrite_json(meta_file, lambda meta: {**meta, "format_version": 999})
  checkpoint_manifest.write_checksums(step_dir)
  (tmp_path / "model" / "config.json").write_text("as the newer run wrote it")
  metrics = (tmp_path / "metrics.jsonl").read_text()
  run, _, _ = _fake_run(tmp_path, total_steps=6)
  handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
  with pytest.raises(CheckpointError) as error:
    _trainer(run, ScriptedStage(), []).run()
  assert _one_line(error).startswith(f"{meta_file}: loop state format_version 999, but this")
  # the refused run put the caller's signal handlers back
  assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
  assert (tmp_path / "model" / "config.json").read_text() == "as the newer run wrote it"
  assert (tmp_path / "metrics.jsonl").read_text() == metrics
  assert step_dir.is_dir()


# ------------------------------------------------------------------------------ model/lora.json


def test_the_lora_file_records_its_version_and_other_versions_are_refused(tmp_path):
  path = tmp_path / "lora.json"
  record = {"format_version": LORA_FILE_FORMAT_VERSION, "lora": {"rank": 4},
            "fingerprint": "0123456789abcdef", "base": {"path": None, "dtype": "float32",
                                                        "random_seed": 0}}
  path.write_text(json.dumps(record))
  assert read_lora_file(path) == record and LORA_FILE_FORMAT_VERSION == 1
  unversioned = {k: v for k, v in record.items() if k != "format_version"}
  path.write_text(json.dumps(unversioned))
  assert read_lora_file(path) == unversioned  # version 1's fields: read as version 1
  path.write_text(json.dumps({**record, "format_version": 999}))
  with pytest.raises(CheckpointError) as error:
    read_lora_file(path)
  assert _one_line(error) == (f"{path}: format_version 999, but this reasoning_rl reads version 1 "
                              "only; load the run with the reasoning_rl that wrote it")


def test_a_lora_run_writes_the_version_into_model_lora_json(tmp_path, restore_signal_handlers):
  """What `Trainer._lora_record` returns is what write_model_files writes as model/lora.json."""
  run, _, _ = _fake_run(tmp_path, **{"lora.rank": 4})
  trainer = _trainer(run, ScriptedStage(), [])
  assert trainer._lora_record()["format_version"] == 1


# ------------------------------------------------------------------------------ run_config.json


def _resolved_config(**fields):
  """The base config as launch/train.py hands it to check_or_write_fingerprint."""
  config = base_config()
  config.workdir = "/runs/a"
  config.update_from_flattened_dict(fields)
  return config.to_dict()


def _unversioned_run_config() -> str:
  """run_config.json as a start wrote it before it carried a version: the config's fields alone."""
  return json.dumps(plain(_resolved_config(), json_safe=True), indent=2, sort_keys=True) + "\n"


def test_run_config_json_records_its_version(tmp_path):
  assert check_or_write_fingerprint(tmp_path, _resolved_config()) == []
  path = tmp_path / FINGERPRINT_FILE
  saved = json.loads(path.read_text())
  assert saved.pop("format_version") == RUN_CONFIG_FORMAT_VERSION == 1
  assert saved == json.loads(_unversioned_run_config())
  assert check_or_write_fingerprint(tmp_path, _resolved_config()) == []  # the key is no change
  # rewritten after an allowed change: still versioned
  assert check_or_write_fingerprint(tmp_path, _resolved_config(total_steps=50),
                                    allow_changes=("total_steps",)) == ["total_steps: 10 -> 50"]
  saved = json.loads(path.read_text())
  assert (saved["format_version"], saved["total_steps"]) == (1, 50)


def test_a_run_config_written_before_versions_resumes_as_version_1(tmp_path):
  path = tmp_path / FINGERPRINT_FILE
  path.write_text(_unversioned_run_config())
  assert check_or_write_fingerprint(tmp_path, _resolved_config()) == []
  assert path.read_text() == _unversioned_run_config()  # an unchanged resume rewrites nothing
  with pytest.raises(ConfigError) as error:  # it is still compared field by field
    check_or_write_fingerprint(tmp_path, _resolved_config(**{"rollout.num_samples": 8}))
  assert "changed fields: rollout.num_samples: 4 -> 8. " in _one_line(error)
  assert check_or_write_fingerprint(tmp_path, _resolved_config(total_steps=50),
                                    allow_changes=("total_steps",)) == ["total_steps: 10 -> 50"]
  assert json.loads(path.read_text())["format_version"] == 1  # rewritten in the current form


def test_a_run_config_of_another_version_is_refused_and_kept(tmp_path):
  path = tmp_path / FINGERPRINT_FILE
  newer = json.dumps({**json.loads(_unversioned_run_config()), "format_version": 2})
  path.write_text(newer)
  with pytest.raises(ConfigError) as error:
    check_or_write_fingerprint(tmp_path, _resolved_config())
  assert _one_line(error) == (f"{path}: format_version 2, but this reasoning_rl reads version 1 "
                              "only; resume the run with the reasoning_rl that wrote it, or use a "
                              "new workdir")
  assert path.read_text() == newer


def test_loading_a_run_reads_run_config_json_of_either_form_and_refuses_a_newer_one(tmp_path):
  """run_checkpoint reads the run's model.scan_layers from run_config.json."""
  workdir = _run_workdir(tmp_path / "run", nan=False)  # test_faults loads it intact
  path = workdir / FINGERPRINT_FILE
  path.write_text(_unversioned_run_config())
  model, _ = load_model(workdir)
  assert model.config.num_layers == 1 and not scans_layers(workdir)
  path.write_text(json.dumps({"model": {"scan_layers": True}}))
  assert scans_layers(workdir)
  path.write_text(json.dumps({"format_version": 1, "model": {"scan_layers": True}}))
  assert scans_layers(workdir)
  path.write_text(json.dumps({"format_version": 999, "model": {"scan_layers": False}}))
  with pytest.raises(CheckpointError) as error:
    load_model(workdir)
  assert _one_line(error).startswith(f"{path}: format_version 999, but this reasoning_rl reads ")


def test_models_load_points_a_run_at_the_run_loader(tmp_path):
  """models.load reads Hugging Face directories and GGUF files; a run is run_checkpoint's."""
  workdir = _run_workdir(tmp_path / "run", nan=False)
  for path in (workdir, workdir / "checkpoints" / "6"):
    with pytest.raises(CheckpointError) as error:
      load(path)
    assert _one_line(error) == (f"{path}: a training run's workdir or checkpoint step; load it "
                                "with reasoning_rl.run_checkpoint.load_model")
  assert load_model(workdir / "checkpoints" / "6")[0].config.num_layers == 1


# ------------------------------------------------------------------------------ rollout records


@pytest.fixture()
def rollouts(tmp_path):
  write_run(tmp_path)  # the replay test's run: 2 steps of records through MetricsWriter
  return tmp_path


def _lines(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollout_records_carry_their_format_version_and_round_trip(rollouts):
  records = _lines(rollouts / "rollouts" / "step_00000001.jsonl")
  assert [r["format_version"] for r in records] == [ROLLOUT_FORMAT_VERSION] * 4
  assert ROLLOUT_FORMAT_VERSION == 1
  report = replay(rollouts, ORIGINAL)
  assert report.num_records == len(COMPLETIONS) and report.changed == []


def test_a_rollout_record_of_another_version_is_refused(rollouts):
  path = rollouts / "rollouts" / "step_00000002.jsonl"
  records = _lines(path)
  records[1]["format_version"] = 999
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  with pytest.raises(ConfigError) as error:
    replay(rollouts, ORIGINAL)
  assert _one_line(error) == (
      "rollouts/step_00000002.jsonl:2: rollout record format_version 999, but this reasoning_rl "
      "reads version 1 only; read these rollouts with the reasoning_rl that wrote them")


def test_launch_replay_refuses_another_version_in_one_line(rollouts, tmp_path):
  path = rollouts / "rollouts" / "step_00000001.jsonl"
  records = _lines(path)
  records[0]["format_version"] = 999
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  config = tmp_path / "replay_config.py"
  config.write_text("import ml_collections\n\ndef get_config():\n  c = ml_collections.ConfigDict()\n"
                    f"  c.rewards = ml_collections.ConfigDict({ORIGINAL!r})\n  return c\n")
  launcher = pathlib.Path(__file__).resolve().parents[1] / "launch" / "replay.py"
  proc = subprocess.run([sys.executable, str(launcher), f"--workdir={rollouts}",
                         f"--config={config}"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: ConfigError: rollouts/step_00000001.jsonl:1: rollout record format_version 999, "
      "but this reasoning_rl reads version 1 only; read these rollouts with the reasoning_rl "
      "that wrote them")
  assert "Traceback" not in proc.stderr


def test_rollout_records_written_before_versions_read_as_version_1_or_are_refused(rollouts):
  path = rollouts / "rollouts" / "step_00000001.jsonl"
  records = [{k: v for k, v in r.items() if k != "format_version"} for r in _lines(path)]
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  assert replay(rollouts, ORIGINAL).changed == []  # the current content: read as version 1
  del records[2]["task_prompt"]  # a record from before task_prompt was written
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  with pytest.raises(ConfigError) as error:
    replay(rollouts, ORIGINAL)
  assert _one_line(error).startswith(
      "rollouts/step_00000001.jsonl:3: rollout record lacks 'task_prompt'; replay needs ")


def test_the_writer_refuses_a_record_claiming_another_version(tmp_path):
  record = {"step": 1, "prompt_id": 0, "group_id": 0, "sample_index": 0, "prompt": "q",
            "completion": "a", "reward": 1.0, "advantage": 0.0, "num_tokens": 1,
            "truncated": False, "policy_version": 0, "verifier_version": "v",
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4, "seed": 0}}
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    written = writer.write_rollouts(1, [record, {**record, "format_version": 1}])
    with pytest.raises(ValueError, match="rollout record 0 of step 2 has format_version 2"):
      writer.write_rollouts(2, [{**record, "step": 2, "format_version": 2}])
  assert [r["format_version"] for r in _lines(written)] == [1, 1]
