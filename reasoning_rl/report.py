"""A run report at a glance: `workdir/report.md` with PNG plots and sample completions.

Reads what a run wrote (docs/architecture.md §3.3): `metrics.jsonl` (via `reasoning_rl.metrics.read_metrics`),
`eval/step_XXXXXXXX.json` (`reasoning_rl.evaluation.write_eval_result`), `rollouts/*.jsonl` and
`STOPPED.md` if a guard stopped the run. Writes `workdir/report.md` and `workdir/report/*.png`:

  reward_parts.png      reward/mean and every reward/<part> per step
  heldout_accuracy.png  held-out accuracy (and pass@k / maj@k) per evaluation
  response_length.png   response_length/mean of training and of the held-out evaluations
  kl.png, entropy.png   kl and entropy per step
  groups.png            groups/all_pass_frac and groups/all_fail_frac per step

A quantity that was never logged gets a plot saying "not logged" (and the same words in the
markdown), never an error. A file that is there but cannot be read (not JSON, not UTF-8, rows of the
wrong shape) is a ConfigError naming it; nothing is written then. Sample completions: the highest-
and lowest-reward records of the last logged rollout step, and the canary completions of the last
evaluation.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display (set before pyplot is imported)
from matplotlib import pyplot as plt  # noqa: E402  pylint: disable=wrong-import-position

from reasoning_rl import storage
from reasoning_rl.errors import ConfigError
from reasoning_rl.evaluation import read_eval_results  # noqa: E402
from reasoning_rl.metrics import METRICS_FILE, ROLLOUTS_DIR, read_metrics  # noqa: E402

REPORT_FILE = "report.md"
PLOTS_DIR = "report"
NOT_LOGGED = "not logged"
MAX_SAMPLE_CHARS = 2000
_ROLLOUT_NAME = re.compile(r"^step_(\d{8})\.jsonl$")
_HELDOUT_KEY = re.compile(r"^(accuracy|pass@\d+|maj@\d+)$")

Series = dict[str, tuple[list[float], list[float]]]


def _series(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], x_key: str = "step",
            prefix: str = "") -> Series:
  """label -> (xs, ys) for every key that has at least one numeric value."""
  found: Series = {}
  for key in keys:
    points = [(float(r[x_key]), float(r[key])) for r in rows
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    if points:
      found[prefix + key] = ([p[0] for p in points], [p[1] for p in points])
  return found


def _plot(path, title: str, series: Series, *, xlabel: str = "step",
          ylabel: str = "") -> bool:
  """Draws the series (or a "not logged" notice); returns whether anything was plotted."""
  figure, axes = plt.subplots(figsize=(6.4, 3.6), dpi=100)
  # fixed margins that fit a title, one tick-label line and labels of ~8 characters: the tight
  # layout engine measured every text of every plot first (a report of six plots 0.86-0.92 s with
  # it, 0.62-0.74 s without), and every run writes this report at its end, each test run too
  figure.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)
  try:
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if series:
      for label, (xs, ys) in series.items():
        axes.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
      axes.grid(alpha=0.3)
      axes.legend(fontsize=8)
    else:
      axes.text(0.5, 0.5, NOT_LOGGED, ha="center", va="center", fontsize=16, color="gray",
                transform=axes.transAxes)
      axes.set_xticks([])
      axes.set_yticks([])
    image = io.BytesIO()
    figure.savefig(image, format="png")
    storage.atomic_write(path, image.getvalue())
  finally:
    plt.close(figure)
  return bool(series)


def _fence(text: str) -> str:
  """A code block whose fence is longer than any backtick run inside `text`."""
  longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
  fence = "`" * max(3, longest + 1)
  return f"{fence}\n{text}\n{fence}"


def _clip(text: str) -> str:
  text = str(text)
  if len(text) <= MAX_SAMPLE_CHARS:
    return text
  return text[:MAX_SAMPLE_CHARS] + f"\n… [{len(text) - MAX_SAMPLE_CHARS} more characters]"


def _format(value: Any) -> str:
  if isinstance(value, float):
    return "nan" if math.isnan(value) else f"{value:.4g}"
  return str(value)


def _newest_rollouts_file(workdir):
  directory = workdir / ROLLOUTS_DIR
  files = sorted(p for p in directory.iterdir() if _ROLLOUT_NAME.match(p.name)) \
      if directory.is_dir() else []
  return files[-1] if files else None


def last_rollouts(workdir) -> tuple[int | None, list[dict[str, Any]]]:
  """(step, records) of the newest rollouts/step_XXXXXXXX.jsonl, or (None, [])."""
  newest = _newest_rollouts_file(workdir)
  if newest is None:
    return None, []
  records = [json.loads(line) for line in newest.read_text(encoding="utf-8").splitlines()
             if line.strip()]
  _check_objects(records, "record")
  return int(_ROLLOUT_NAME.match(newest.name).group(1)), records


@contextlib.contextmanager
def _reading(path):
  """Turns a file that is there but unreadable as what a run writes into one ConfigError naming
  it (I/O errors pass: they are the storage's, exit 4)."""
  try:
    yield
  except (ValueError, TypeError, KeyError, AttributeError, IndexError) as error:
    text = " ".join(str(error).split())[:300]
    raise ConfigError(f"{path}: cannot be read as a run's file ({type(error).__name__}: {text}); "
                      "fix it or move it away") from None


def _check_objects(rows: Sequence[Any], what: str, *, step: bool = False) -> None:
  for number, row in enumerate(rows, start=1):
    if not isinstance(row, dict):
      raise ValueError(f"{what} {number} is a {type(row).__name__}, not a JSON object")
    if step and (not isinstance(row.get("step"), (int, float)) or isinstance(row["step"], bool)):
      raise ValueError(f"{what} {number} has no numeric 'step'")


def _sample_section(title: str, record: Mapping[str, Any]) -> list[str]:
  parts = ", ".join(f"{k[len('reward/'):]}={_format(v)}" for k, v in sorted(record.items())
                    if k.startswith("reward/"))
  header = (f"**{title}**: reward {_format(record.get('reward'))}"
            + (f" ({parts})" if parts else "")
            + f", {record.get('num_tokens', '?')} tokens"
            + (", truncated" if record.get("truncated") else "")
            + (f", ground truth `{record['ground_truth']}`" if "ground_truth" in record else ""))
  lines = [header, "", "Prompt:", "", _fence(_clip(record.get("prompt", ""))), ""]
  if record.get("turns"):  # a multi-turn episode: every model turn and what answered it
    lines += [f"Episode ({len(record['turns'])} turns, ended: {record.get('episode_end')}):", ""]
    for index, turn in enumerate(record["turns"], start=1):
      lines += [f"Turn {index} (model):", "", _fence(_clip(turn.get("model_text", ""))), ""]
      if turn.get("observation") is not None:
        lines += [f"Turn {index} (environment):", "", _fence(_clip(turn["observation"])), ""]
      if turn.get("unsent_observation") is not None:
        lines += [f"Turn {index} (environment, after the episode ended; not shown to the model):",
                  "", _fence(_clip(turn["unsent_observation"])), ""]
    return lines + ["Scored text:", "", _fence(_clip(record.get("completion", ""))), ""]
  return lines + ["Completion:", "", _fence(_clip(record.get("completion", ""))), ""]


def write_report(workdir: str | os.PathLike[str], *, num_samples: int = 2):
  """Writes workdir/report.md and its plots (see the module docstring); returns the path.

  Args:
    workdir: the run directory.
    num_samples: how many highest- and lowest-reward completions of the last step to show.
  """
  workdir = storage.path(workdir)
  if not workdir.is_dir():
    raise ConfigError(f"{workdir}: not a directory; pass the workdir of a run")
  with _reading(workdir / METRICS_FILE):
    rows = read_metrics(workdir / METRICS_FILE)
    _check_objects(rows, "row", step=True)
  with _reading(workdir / "eval"):
    evals = read_eval_results(workdir)
    _check_objects(evals, "evaluation", step=True)
    # eval.instruction_variants: the held-out set under reworded instructions, as "reworded N"
    reworded = [{"step": e["step"], **{f"reworded {i + 1}": v["accuracy"]
                                       for i, v in enumerate(e.get("variants", ()))}}
                for e in evals]
  keys = sorted({key for row in rows for key in row})
  reward_keys = ["reward/mean"] + [k for k in keys if k.startswith("reward/") and k != "reward/mean"]
  heldout_keys = sorted({k for e in evals for k in e if _HELDOUT_KEY.match(k)},
                        key=lambda k: (k != "accuracy", k))
  reworded_keys = sorted({k for r in reworded for k in r if k != "step"})
  plots = [
      ("reward_parts.png", "Reward and its parts (train)", _series(rows, reward_keys), "step"),
      ("heldout_accuracy.png", "Held-out accuracy",
       {**_series(evals, heldout_keys), **_series(reworded, reworded_keys)}, "step"),
      ("response_length.png", "Mean response length (tokens)",
       {**_series(rows, ["response_length/mean"], prefix="train "),
        **_series(evals, ["response_length/mean"], prefix="held-out ")}, "step"),
      ("kl.png", "KL to the reference", _series(rows, ["kl"]), "step"),
      ("entropy.png", "Mean token entropy", _series(rows, ["entropy"]), "step"),
      ("groups.png", "Groups with all samples passing / failing",
       _series(rows, ["groups/all_pass_frac", "groups/all_fail_frac"]), "step"),
  ]

  lines = [f"# Run report: `{workdir.name}`", ""]
  stopped = workdir / "STOPPED.md"
  if stopped.exists():
    with _reading(stopped):
      first = (stopped.read_text(encoding="utf-8").splitlines() or ["stopped"])[0].lstrip("# ")
    lines += [f"**{first}** (see STOPPED.md).", ""]
  if rows:
    lines += [f"{len(rows)} steps logged ({rows[0]['step']} … {rows[-1]['step']}); "
              f"{len(evals)} held-out evaluations.", ""]
    summary = [k for k in ("reward/mean", "kl", "entropy", "response_length/mean",
                           "groups/all_pass_frac", "groups/all_fail_frac") if k in keys]
    if summary:
      lines += ["| metric | first step | last step |", "|---|---|---|"]
      for key in summary:
        values = [r[key] for r in rows if key in r]
        lines.append(f"| {key} | {_format(values[0])} | {_format(values[-1])} |")
      lines.append("")
  else:
    lines += [f"metrics.jsonl: {NOT_LOGGED}.", ""]

  lines += ["## Plots", ""]
  for name, title, series, _ in plots:
    lines += [f"### {title}" + ("" if series else f" — {NOT_LOGGED}"), "",
              f"![{title}]({PLOTS_DIR}/{name})", ""]

  lines += ["## Held-out evaluations", ""]
  with _reading(workdir / "eval"):
    lines += _evaluations_section(evals, reworded, heldout_keys, reworded_keys)
  lines += ["## Sample completions", ""]
  with _reading(_newest_rollouts_file(workdir) or workdir / ROLLOUTS_DIR):
    lines += _samples_section(workdir, num_samples)

  # everything was read: only now is anything written
  plots_dir = workdir / PLOTS_DIR
  plots_dir.mkdir(exist_ok=True)
  for name, title, series, xlabel in plots:
    _plot(plots_dir / name, title, series, xlabel=xlabel)
  path = workdir / REPORT_FILE
  storage.atomic_write(path, "\n".join(lines))
  return path


def _evaluations_section(evals, reworded, heldout_keys, reworded_keys) -> list[str]:
  if not evals:
    return [f"Held-out evaluations: {NOT_LOGGED}.", ""]
  columns = ["step"] + heldout_keys + reworded_keys + ["format_rate", "response_length/mean"]
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for result, extra in zip(evals, reworded):
    lines.append("| " + " | ".join(_format({**result, **extra}.get(c, "")) for c in columns)
                 + " |")
  lines.append("")
  for i, variant in enumerate(evals[-1].get("variants", ())):
    lines += [f"reworded {i + 1}:", "", _fence(_clip(variant["instruction"])), ""]
  canaries = evals[-1].get("canaries") or []
  if canaries:
    lines += [f"### Canary completions (evaluation at step {evals[-1]['step']})", ""]
    for canary in canaries:
      lines += [f"**{canary.get('uid', '')}**:", "", _fence(_clip(canary.get("prompt", ""))), ""]
      for completion in canary.get("completions", []):
        lines += [_fence(_clip(completion.get("text", ""))), ""]
  return lines


def _samples_section(workdir, num_samples: int) -> list[str]:
  step, records = last_rollouts(workdir)
  scored = [r for r in records if isinstance(r.get("reward"), (int, float))]
  if not scored:
    return [f"Rollout records: {NOT_LOGGED}.", ""]
  order = sorted(range(len(scored)), key=lambda i: (-scored[i]["reward"], i))
  best = order[:num_samples]
  worst = [i for i in reversed(order) if i not in best][:num_samples]
  lines = [f"From step {step}: the {len(best)} highest- and {len(worst)} lowest-reward "
           "completions.", ""]
  for rank, i in enumerate(best, start=1):
    lines += _sample_section(f"Highest #{rank}", scored[i])
  for rank, i in enumerate(worst, start=1):
    lines += _sample_section(f"Lowest #{rank}", scored[i])
  return lines
