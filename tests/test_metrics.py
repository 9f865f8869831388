"""MetricsWriter: exact rows, crash repair + resume truncation, TensorBoard read-back, rollouts, bar."""

import io
import json
import math
import os
import pathlib
import signal
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from reasoning_rl.metrics import (MetricsWriter, ProgressBar, read_metrics, ROLLOUT_FIELDS)


def _without_time(rows):
  return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def _metrics(step):
  return {"loss": 0.5 / step, "reward/mean": step * 0.25, "reward/correct": float(step % 2),
          "kl": np.float32(0.125), "clip_frac": jnp.asarray(0.0625), "groups/n": np.int64(step)}


def _read_tensorboard(directory):
  """{tag: [(step, value)]} from TFRecord event files (length, crc, Event proto, crc)."""
  scalars, purge_steps = {}, []
  for path in sorted(directory.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      if event.HasField("session_log"):
        purge_steps.append(event.step)
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars, purge_steps


def test_rows_are_exact_and_ordered(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in (1, 2):
      writer.write(step, _metrics(step))
    writer.write(3, {"loss": float("nan"), "kl": math.inf, "entropy": -math.inf, "ok": True})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  first = json.loads(lines[0])
  assert list(first) == ["step", "clip_frac", "groups/n", "kl", "loss", "reward/correct",
                         "reward/mean", "time/unix"]
  assert _without_time([first]) == [{"step": 1, "clip_frac": 0.0625, "groups/n": 1, "kl": 0.125,
                                     "loss": 0.5, "reward/correct": 1.0, "reward/mean": 0.25}]
  assert isinstance(first["groups/n"], int) and isinstance(first["loss"], float)
  assert '"entropy": "-Infinity", "kl": "Infinity", "loss": "NaN", "ok": 1' in lines[2]
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert [row["step"] for row in rows] == [1, 2, 3]
  assert math.isnan(rows[2]["loss"]) and rows[2]["kl"] == math.inf and rows[2]["entropy"] == -math.inf


def test_crash_and_resume_leave_one_row_per_step(tmp_path):
  # Uninterrupted reference run.
  reference = tmp_path / "reference"
  with MetricsWriter(reference, tensorboard=False) as writer:
    for step in range(1, 9):
      writer.write(step, _metrics(step))
  # Interrupted run: checkpoint at step 4, logged up to 6, killed while writing row 7.
  run = tmp_path / "run"
  writer = MetricsWriter(run, tensorboard=False)
  for step in range(1, 7):
    writer.write(step, _metrics(step))
  writer.close()
  with open(run / "metrics.jsonl", "a") as handle:
    handle.write('{"step": 7, "loss": 0.0')  # torn row, no newline
  with MetricsWriter(run, resume_step=4, tensorboard=False) as writer:
    assert writer.last_step == 4
    with pytest.raises(ValueError, match="step 4 is not after the last logged step 4"):
      writer.write(4, _metrics(4))
    for step in range(5, 9):
      writer.write(step, _metrics(step))
  assert _without_time(read_metrics(run / "metrics.jsonl")) == _without_time(
      read_metrics(reference / "metrics.jsonl"))
  assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(1, 9))


def test_a_row_appended_twice_is_kept_once_on_resume(tmp_path):
  """A gs:// append whose reply was lost is retried, and GCS's compose adds its bytes twice."""
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in range(1, 4):
      writer.write(step, _metrics(step))
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
  (tmp_path / "metrics.jsonl").write_text("".join(lines[:2] + lines[1:]))  # row 2 twice
  with MetricsWriter(tmp_path, resume_step=3, tensorboard=False) as writer:
    assert writer.last_step == 3
  assert (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True) == lines


def test_restart_from_scratch_drops_all_rows(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(1, {"loss": 1.0})
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    assert writer.last_step is None
    writer.write(1, {"loss": 2.0})
  assert _without_time(read_metrics(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 2.0}]


def test_bad_metric_values(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    with pytest.raises(ValueError, match=r"metric 'loss' has shape \(2,\)"):
      writer.write(1, {"loss": np.zeros(2)})
    with pytest.raises(ValueError, match="metric 'name' is a str"):
      writer.write(1, {"name": "x"})
    with pytest.raises(ValueError, match="must not contain 'step'"):
      writer.write(1, {"step": 1})


def test_tensorboard_scalars_read_back(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    for step in (1, 2, 3):
      writer.write(step, {"loss": 1.0 / step, "reward/mean": step * 0.5})
  with MetricsWriter(tmp_path, resume_step=2) as writer:
    writer.write(3, {"loss": 7.0, "reward/mean": 9.0})
  scalars, purge_steps = _read_tensorboard(tmp_path / "tensorboard")
  assert scalars["loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (3, 7.0)]
  assert scalars["reward/mean"] == [(1, 0.5), (2, 1.0), (3, 1.5), (3, 9.0)]
  assert purge_steps == [3]  # TensorBoard hides the crashed attempt's step 3 from here on
  assert [step for step, _ in scalars["time/unix"]] == [1, 2, 3, 3]


def test_the_tensorboard_writer_does_not_load_torch_and_leaves_it_importable(tmp_path):
  """tensorboardX imports torch when installed (over a second of every start-up); the writer
  imports it with torch hidden, then torch imports as usual. Fails if the import loaded torch or
  if the hiding outlived it."""
  program = (
      "import sys\n"
      "from reasoning_rl.metrics import MetricsWriter\n"
      f"with MetricsWriter({str(tmp_path)!r}) as writer:\n"
      "  writer.write(1, {'loss': 0.25})\n"
      "loaded = 'torch' in sys.modules\n"
      "import torch\n"
      "print(loaded, torch.tensor([2.0]).sum().item())\n")
  result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=True)
  assert result.stdout.split() == ["False", "2.0"]
  scalars, _ = _read_tensorboard(tmp_path / "tensorboard")
  assert scalars["loss"] == [(1, 0.25)]


def _record(step, index):
  return {"step": step, "prompt_id": index // 2, "group_id": index // 2, "sample_index": index % 2,
          "prompt": "1+1=", "completion": "<answer>2</answer>", "reward": 1.0,
          "reward/correct": np.float32(1.0), "advantage": float("nan"),
          "num_tokens": np.int32(5), "truncated": False, "policy_version": 3,
          "verifier_version": "v1", "completion_ids": jnp.arange(3),
          "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16, "seed": 7}}


def test_rollouts_written_validated_and_truncated_on_resume(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    path = writer.write_rollouts(2, [_record(2, 0), _record(2, 1)])
    writer.write_rollouts(2, [_record(2, 2)])
    writer.write_rollouts(5, [_record(5, 0)])
    for field in ROLLOUT_FIELDS:
      broken = _record(3, 0)
      del broken[field]
      with pytest.raises(ValueError, match=f"rollout record 0 of step 3 lacks field '{field}'"):
        writer.write_rollouts(3, [broken])
    broken = _record(3, 0)
    del broken["sampling"]["seed"]
    with pytest.raises(ValueError, match="lacks field 'sampling.seed'"):
      writer.write_rollouts(3, [broken])
    with pytest.raises(ValueError, match="record 0 has step 2 but is written for step 3"):
      writer.write_rollouts(3, [_record(2, 0)])
  assert path == tmp_path / "rollouts" / "step_00000002.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  assert [row["sample_index"] for row in rows] == [0, 1, 0]
  assert rows[0]["advantage"] == "NaN" and rows[0]["completion_ids"] == [0, 1, 2]
  assert rows[0]["num_tokens"] == 5 and rows[0]["reward/correct"] == 1.0
  assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [
      "step_00000002.jsonl", "step_00000005.jsonl"]
  with MetricsWriter(tmp_path, resume_step=4, tensorboard=False):
    pass
  assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_00000002.jsonl"]


def test_progress_bar_quiet_unless_tty_or_forced():
  quiet = io.StringIO()
  bar = ProgressBar(10, stream=quiet)
  bar.update(3, {"loss": 0.5})
  bar.close()
  assert quiet.getvalue() == ""

  shown = io.StringIO()
  bar = ProgressBar(10, initial=2, enabled=True, stream=shown)
  bar.set_accuracy(0.34)
  bar.update(3, {"loss": 0.123456, "reward/mean": 0.5})
  bar.set_accuracy(0.571)
  bar.update(5, {"loss": 0.25, "reward/mean": 0.625})
  bar.write("a message above the line")
  bar.close()
  text = shown.getvalue()
  last = text.replace("\r", "\n").strip().splitlines()[-1]
  assert "5/10" in last and "reward 0.625" in last and "held-out 57.1%" in last, last
  assert "reward 0.500 held-out 34.0%" in text and "a message above the line" in text
  assert "<" in last and "step" in last  # ETA and rate


_WRITER_LOOP = """
import sys
from reasoning_rl.metrics import MetricsWriter
writer = MetricsWriter(sys.argv[1], tensorboard=False)
for step in range(1, 10**9):
  writer.write(step, {"loss": 1.0 / step, "payload": float(step)})
  if step == 50:
    print("ready", flush=True)
"""


def test_sigkill_mid_run_then_resume(tmp_path):
  repo_root = pathlib.Path(__file__).resolve().parents[1]
  child = subprocess.Popen([sys.executable, "-c", _WRITER_LOOP, str(tmp_path)],
                           env=dict(os.environ, PYTHONPATH=str(repo_root)),
                           stdout=subprocess.PIPE, text=True)
  assert child.stdout.readline().strip() == "ready"
  child.send_signal(signal.SIGKILL)
  child.wait(timeout=30)
  logged = read_metrics(tmp_path / "metrics.jsonl")
  assert [row["step"] for row in logged] == list(range(1, len(logged) + 1))
  assert len(logged) >= 50
  with MetricsWriter(tmp_path, resume_step=20, tensorboard=False) as writer:
    for step in range(21, 31):
      writer.write(step, {"loss": 1.0 / step, "payload": float(step)})
  rows = _without_time(read_metrics(tmp_path / "metrics.jsonl"))
  assert rows == [{"step": s, "loss": 1.0 / s, "payload": float(s)} for s in range(1, 31)]
