"""What a run writes for people to read: metrics.jsonl, TensorBoard events, rollouts, a progress bar.

Layout under the workdir (docs/architecture.md §3.3):

- `metrics.jsonl`: one JSON object per step, `{"step": s, <key>: <number>, …}` with `step` first and
  the other keys sorted, so two runs with equal numbers write equal bytes. Non-finite floats are
  written as the strings "NaN", "Infinity", "-Infinity" (JSON has no such numbers);
  `read_metrics` turns them back into floats. Every row is flushed and fsync'ed, so a crash loses
  at most the row being written, and the next `MetricsWriter` removes that partial row.
- `tensorboard/`: one scalar per key and step (tensorboardX).
- `rollouts/step_XXXXXXXX.jsonl`: rollout records (docs/architecture.md §3.5), written atomically,
  each with `format_version` = `ROLLOUT_FORMAT_VERSION` (readers: `check_rollout_version`).

Time measurements are the only non-deterministic values; their keys start with `time/`
(`MetricsWriter` adds `time/unix`, the wall clock when the row was written).

Resuming: `MetricsWriter(workdir, resume_step=s)` keeps the rows and rollout files of steps <= s
(the work the resumed checkpoint contains, each step's first row) and drops later ones, which a
crashed run may have logged after its last checkpoint; `resume_step=None` (a start from scratch) drops them all. So after any
number of crashes and resumes the file holds exactly one row per step.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import re
import sys
import time
from typing import Any, Iterable, Mapping, TextIO

import numpy as np

from reasoning_rl import storage
from reasoning_rl.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
ROLLOUTS_DIR = "rollouts"

# The rollout record of docs/architecture.md §3.5. Reward parts are extra keys (`reward/<part>`), not checked here
# because each task defines its own.
ROLLOUT_FIELDS = ("step", "prompt_id", "group_id", "sample_index", "prompt", "completion", "reward",
                  "advantage", "num_tokens", "truncated", "policy_version", "verifier_version",
                  "sampling")
SAMPLING_FIELDS = ("temperature", "top_p", "max_new_tokens", "seed")
# Stamped into every rollout record by `MetricsWriter.write_rollouts`: the fields above plus those
# the RL loop adds (loop.telemetry.rollout_records: task_prompt, ground_truth, task, metadata,
# tests, scoring_status, reward/<part>, under PPO token_advantages, and for multi-turn episodes
# turns, episode_end, environment_parts, observation_tokens, and for mixture-of-experts models
# experts: optional, so version 1 holds records with and without them, and no reader needs them).
ROLLOUT_FORMAT_VERSION = 1

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_ROLLOUT_NAME = re.compile(r"^step_(\d{8})\.jsonl$")


def _encode_float(value: float) -> float | str:
  if math.isnan(value):
    return "NaN"
  if math.isinf(value):
    return "Infinity" if value > 0 else "-Infinity"
  return value


def to_json_value(value: Any, *, where: str = "value") -> Any:
  """Plain JSON form of numbers, arrays, strings, lists and dicts (non-finite floats as strings)."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (numbers.Integral, np.integer)):
    return int(value)
  if isinstance(value, (numbers.Real, np.floating)):
    return _encode_float(float(value))
  if isinstance(value, str) or value is None:
    return value
  if hasattr(value, "__array__") and not isinstance(value, (list, tuple, dict)):
    array = np.asarray(value)
    return to_json_value(array.item() if array.ndim == 0 else array.tolist(), where=where)
  if isinstance(value, Mapping):
    return {str(key): to_json_value(item, where=f"{where}[{key!r}]") for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json_value(item, where=f"{where}[{i}]") for i, item in enumerate(value)]
  raise TypeError(f"{where} is a {type(value).__name__}, which has no JSON form; pass numbers, "
                  "strings, lists, dicts or arrays")


def _scalar(key: str, value: Any) -> int | float:
  """A metric value as a Python int or float (0-d arrays and numpy scalars accepted)."""
  if hasattr(value, "__array__") and not isinstance(value, (bool, numbers.Number)):
    array = np.asarray(value)
    if array.ndim != 0:
      raise ValueError(f"metric {key!r} has shape {array.shape}; log a scalar (e.g. its mean)")
    value = array.item()
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, (numbers.Integral, np.integer)):
    return int(value)
  if isinstance(value, (numbers.Real, np.floating)):
    return float(value)
  raise ValueError(f"metric {key!r} is a {type(value).__name__}; metrics are numbers")


def _decode_row(row: dict[str, Any]) -> dict[str, Any]:
  return {key: _NON_FINITE.get(value, value) if isinstance(value, str) else value
          for key, value in row.items()}


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """The complete rows of a metrics.jsonl, with non-finite values back as floats."""
  rows, _ = _read_complete_rows(storage.path(path))
  return [_decode_row(row) for row in rows]


def _read_complete_rows(path: pathlib.Path) -> tuple[list[dict[str, Any]], bool]:
  """(rows, had_partial_tail): rows of every newline-terminated line; a torn last line is skipped."""
  if not path.exists():
    return [], False
  data = path.read_bytes()
  lines = data.split(b"\n")
  tail = lines.pop()  # b"" when the file ends with a newline
  rows = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as error:
      raise ValueError(f"{path} line {number} is not JSON ({error}); the file was edited or "
                       "damaged by something other than a crash; fix or move it away") from error
  return rows, bool(tail)


def check_rollout_version(record: Mapping[str, Any], where: str) -> None:
  """Raises ConfigError naming `where` (file:line) for a rollout record of another version."""
  # A record written before versions were lacks the field. The writer only added it, so such a
  # record reads as version 1; one older than that lacks a field its reader needs and is refused
  # there, with the field's name.
  version = record.get("format_version", 1) if isinstance(record, Mapping) else None
  if version != ROLLOUT_FORMAT_VERSION:
    raise ConfigError(
        f"{where}: rollout record format_version {version!r}, but this reasoning_rl reads version "
        f"{ROLLOUT_FORMAT_VERSION} only; read these rollouts with the reasoning_rl that wrote them")


def _dumps(value: Any) -> str:
  return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(", ", ": "))


def _summary_writer_class():
  """tensorboardX's `SummaryWriter`, imported without loading torch.

  tensorboardX's writer module imports torch whenever it is installed, only so that it can
  accept torch tensors as values: 1.2-1.4 s of every launcher's start-up on a CPU host (measured
  with `python -X importtime launch/train.py`, 2026-11-28), paid again on each resume. This writer
  logs Python floats. When nothing has loaded torch yet, the import runs with torch marked
  absent, and the mark is removed right after, so a later `import torch` works as usual."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    return SummaryWriter
  sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    if sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  """Writes one row per step to metrics.jsonl and TensorBoard, and rollout files.

  Args:
    workdir: the run directory.
    resume_step: step of the checkpoint the run resumes from (rows and rollouts of later steps
      are removed), or None for a start from scratch (all of them are removed).
    tensorboard: also write TensorBoard event files under `workdir/tensorboard`.
  """

  def __init__(self, workdir: str | os.PathLike[str], *, resume_step: int | None = None,
               tensorboard: bool = True):
    self.workdir = storage.path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.metrics_path = self.workdir / METRICS_FILE
    self.rollouts_dir = self.workdir / ROLLOUTS_DIR
    # Appended locally; on a remote workdir a staging copy whose new rows storage.sync_staged
    # appends to the object.
    self._metrics_local = storage.staged(self.workdir, METRICS_FILE, download=True)
    keep_up_to = -1 if resume_step is None else int(resume_step)
    self._last_step = self._truncate_metrics(keep_up_to)
    self._truncate_rollouts(keep_up_to)
    self._file = open(self._metrics_local, "a", encoding="utf-8")
    self._tensorboard = None
    if tensorboard:
      # purge_step makes TensorBoard hide events a crashed attempt wrote for steps being redone.
      writer_class = _summary_writer_class()
      self._tensorboard = writer_class(
          str(storage.staged(self.workdir, TENSORBOARD_DIR)),
          purge_step=keep_up_to + 1 if resume_step is not None else None,
          # Unique per writer: the default name has one-second resolution and a quick restart
          # would overwrite it.
          filename_suffix=f".{time.time_ns()}")

  def _truncate_metrics(self, keep_up_to: int) -> int | None:
    """Drops rows with step > keep_up_to, a torn last line, and a row repeating an earlier
    step (on gs:// an append whose reply was lost is retried: GCS's compose then added the same
    bytes twice); returns the last kept step."""
    rows, had_partial_tail = _read_complete_rows(self._metrics_local)
    kept = []
    for row in rows:
      step = int(row["step"])
      if step <= keep_up_to and (not kept or step > int(kept[-1]["step"])):
        kept.append(row)
    if had_partial_tail or len(kept) != len(rows):
      storage.replace_staged(self.workdir, METRICS_FILE,
                             "".join(_dumps(row) + "\n" for row in kept).encode())
    return int(kept[-1]["step"]) if kept else None

  def _truncate_rollouts(self, keep_up_to: int) -> None:
    if not self.rollouts_dir.is_dir():
      return
    for path in self.rollouts_dir.iterdir():
      match = _ROLLOUT_NAME.match(path.name)
      if (match and int(match.group(1)) > keep_up_to) or path.name.startswith(".step_"):
        path.unlink()  # later steps, or the temp file of an interrupted write

  @property
  def last_step(self) -> int | None:
    """The step of the last row in metrics.jsonl (None if empty)."""
    return self._last_step

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Appends the row of `step` (steps must increase) and returns it as written."""
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
      raise ValueError(f"step must be an int >= 0, got {step!r}")
    step = int(step)
    if self._last_step is not None and step <= self._last_step:
      raise ValueError(f"step {step} is not after the last logged step {self._last_step}; each "
                       "step is logged once, in order (resume with resume_step=<checkpoint step>)")
    if "step" in metrics:
      raise ValueError("metrics must not contain 'step'; pass it as the first argument")
    values = {key: _scalar(key, value) for key, value in metrics.items()}
    values.setdefault("time/unix", time.time())
    row = {"step": step, **{key: values[key] for key in sorted(values)}}
    encoded = {key: _encode_float(v) if isinstance(v, float) else v for key, v in row.items()}
    self._file.write(_dumps(encoded) + "\n")
    self._file.flush()
    os.fsync(self._file.fileno())
    self._last_step = step
    if self._tensorboard is not None:
      for key, value in values.items():
        if math.isfinite(value):  # NaN marks "not measured" (e.g. kl without a reference)
          self._tensorboard.add_scalar(key, value, global_step=step)
      self._tensorboard.flush()
    storage.sync_staged()
    return row

  def write_rollouts(self, step: int, records: Iterable[Mapping[str, Any]]) -> pathlib.Path:
    """Appends rollout records (docs/architecture.md §3.5) to rollouts/step_XXXXXXXX.jsonl, atomically."""
    lines = []
    for index, record in enumerate(records):
      for field in ROLLOUT_FIELDS:
        if field not in record:
          raise ValueError(f"rollout record {index} of step {step} lacks field {field!r}; "
                           f"records need {', '.join(ROLLOUT_FIELDS)}")
      if int(record["step"]) != step:
        raise ValueError(f"rollout record {index} has step {record['step']} but is written for "
                         f"step {step}")
      if record.get("format_version", ROLLOUT_FORMAT_VERSION) != ROLLOUT_FORMAT_VERSION:
        raise ValueError(f"rollout record {index} of step {step} has format_version "
                         f"{record['format_version']!r}; the writer stamps version "
                         f"{ROLLOUT_FORMAT_VERSION}, leave the field out")
      sampling = record["sampling"]
      for field in SAMPLING_FIELDS:
        if not isinstance(sampling, Mapping) or field not in sampling:
          raise ValueError(f"rollout record {index} of step {step} lacks field 'sampling.{field}'; "
                           f"sampling needs {', '.join(SAMPLING_FIELDS)}")
      record = {**record, "format_version": ROLLOUT_FORMAT_VERSION}
      lines.append(_dumps(to_json_value(record, where=f"rollout record {index}")) + "\n")
    self.rollouts_dir.mkdir(parents=True, exist_ok=True)
    path = self.rollouts_dir / f"step_{step:08d}.jsonl"
    existing = path.read_bytes() if path.exists() else b""
    storage.atomic_write(path, existing + "".join(lines).encode())
    return path

  def flush(self) -> None:
    """Makes everything written so far durable in the workdir (copied, if it is remote)."""
    self._file.flush()
    if self._tensorboard is not None:
      self._tensorboard.flush()
    storage.sync_staged(force=True)

  def close(self) -> None:
    self._file.close()
    if self._tensorboard is not None:
      self._tensorboard.close()
    storage.sync_staged(force=True)

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


class ProgressBar:
  """One live console line (tqdm): step, train reward, last held-out accuracy, s/step and ETA.

  Silent unless `stream` is a terminal or it is forced on. Messages that must not tear the line
  (a guard trip, a preemption) go through `write`.

  Args:
    total_steps: the step the run ends at.
    initial: the step it starts from (a resumed run's checkpoint step).
    enabled: True/False to force; None means "only if `stream` is a TTY".
    stream: where to draw; stderr by default.
  """

  def __init__(self, total_steps: int, *, initial: int = 0, enabled: bool | None = None,
               stream: TextIO | None = None):
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    self._stream = sys.stderr if stream is None else stream
    if enabled is None:
      enabled = bool(getattr(self._stream, "isatty", lambda: False)())
    # The step's numbers go in `desc`, placed after the bar (tqdm's postfix adds a comma).
    self._bar = tqdm(total=total_steps, initial=initial, disable=not enabled, file=self._stream,
                     unit="step", dynamic_ncols=True,
                     bar_format="step {n_fmt}/{total_fmt} |{bar:12}| {desc} "
                                "[{elapsed}<{remaining}, {rate_fmt}]",
                     mininterval=0.0)  # a step takes seconds: draw every one
    self._step = initial
    self._shown: dict[str, str] = {}

  def _show(self, refresh: bool = True) -> None:
    self._bar.set_description_str(" ".join(f"{k} {v}" for k, v in self._shown.items()),
                                  refresh=refresh)

  def set_accuracy(self, accuracy: float) -> None:
    """Shows the latest held-out accuracy until the next evaluation."""
    self._shown["held-out"] = f"{accuracy:.1%}"
    self._show()

  def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
    """Moves the line to `step`; shows the step's train reward (or loss, for SFT stages)."""
    if metrics:
      key = "reward/mean" if "reward/mean" in metrics else "loss"
      if key in metrics:
        self._shown = {("reward" if key == "reward/mean" else key):
                       f"{_scalar(key, metrics[key]):.3f}",
                       **{k: v for k, v in self._shown.items() if k == "held-out"}}
      self._show(refresh=False)
    self._bar.update(step - self._step)
    self._step = step

  def write(self, message: str) -> None:
    """Prints a line above the bar (or plainly when the bar is off)."""
    if self._bar.disable:
      print(message, file=self._stream, flush=True)
    else:
      self._bar.write(message, file=self._stream)

  def close(self) -> None:
    self._bar.close()
