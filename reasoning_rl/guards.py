"""Guard rails: stop a run that is going wrong before it burns the compute budget.

A tripped guard ends the run with `ExitCode.GUARD` (3, reasoning_rl/errors.py): a checkpoint was
saved and `STOPPED.md` in the workdir names the guard, its numbers and the step. Restarting on
the same workdir resumes from that checkpoint and will likely trip again; raise the threshold or
fix the cause first.

Guards (thresholds under `config.guards`; off at their defaults except the verifier guards):

- `max_kl` (default inf): trips when a step's `kl` (mean KL to the reference) is > max_kl, or is
  not finite.
- `min_entropy` (default 0.0): trips when a step's `entropy` (mean token entropy, nats) is
  < min_entropy, or is not finite (only when min_entropy > 0).
- `max_verifier_timeout_rate` (default 0.5) and `max_verifier_error_rate` (default 0.1): trip
  when a step's `verifier/timeout_rate` / `verifier/error_rate` (shares of the step's scored
  groups that timed out / whose verifier raised or killed its worker; both get zero rewards) is >
  the threshold. On by default because a group the verifier could not score trains on fake zeros:
  an error is a verifier bug, so a tenth of a batch is already a broken reward; a timeout can be a
  slow machine or one pathological answer, so only a batch that is mostly fake zeros stops the run.
  1.0 turns either off.
- `max_skipped_updates` (default 10): trips when this many consecutive steps each skipped an
  update because of a non-finite loss or gradient (`skipped_update` > 0); 0 disables it.
- `heldout_drop_evals` K (default 0 = off): trips at an evaluation when held-out `accuracy` fell
  at each of the last K evaluations (a_{m−K} > a_{m−K+1} > … > a_m) while the training reward
  rose over the same span: the least-squares slope of `reward/mean` against step, over the steps
  in (s_{m−K}, s_m], is > 0 (at least two steps needed).
- `max_length_growth` (default inf = off) with `length_growth_evals` W (default 2): at an
  evaluation m, compared with evaluation b = max(0, m − W): relative length growth
  g_L = L_m / L_b − 1 (L: held-out `response_length/mean`) and relative accuracy growth
  g_A = (A_m − A_b) / A_b (inf if A_b = 0 < A_m, 0 if both are 0). Trips when
  g_L − max(g_A, 0) > max_length_growth, i.e. length grew by that much more (relatively) than
  accuracy did. Skipped while L_b <= 0.

- `agent.max_failed_frac` (default 0.5; agent rollouts, `reasoning_rl.agents`): trips when a
  step's `episode/failed_frac` (share of its agent episodes that raised or timed out, dropped)
  is > the threshold: an agent that mostly fails trains on a few survivors. 1.0 turns it off.
  It sits in `config.agent` with the other agent settings; `Guards` takes it as an argument.

- `max_routing_collapse` (default 0.95; mixture-of-experts models): trips when a step's
  `train/routing/collapse` is > the threshold: in some sparse layer, over the step's tokens, the
  busiest expert took that share of the most it could (its tokens over the mean per expert,
  divided by the ceiling E/k; 1 = every token sent to the same k experts,
  `reasoning_rl.rl.routing`). A router collapsed onto a few experts leaves the others untrained
  and the model's capacity unused (Shazeer et al. 2017 describe the self-reinforcing imbalance);
  1.0 turns it off.

Training rewards are only remembered when `heldout_drop_evals` > 0, and only back to the oldest
evaluation that guard still compares with. A guard whose metric is absent from a step's metrics does not check that step. The guard state
(counters, evaluation history, recent rewards) is JSON-able (`state_dict` / `load_state_dict`) and
goes into the checkpoint, so a resumed run decides exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from reasoning_rl import storage
from reasoning_rl.config import check_range
from reasoning_rl.errors import ConfigError, ExitCode

STOPPED_FILE = "STOPPED.md"

# Metric keys the guards read.
KL_KEY = "kl"
ENTROPY_KEY = "entropy"
TIMEOUT_RATE_KEY = "verifier/timeout_rate"
ERROR_RATE_KEY = "verifier/error_rate"
SKIPPED_KEY = "skipped_update"
TRAIN_REWARD_KEY = "reward/mean"
ACCURACY_KEY = "accuracy"
LENGTH_KEY = "response_length/mean"
ROUTING_COLLAPSE_KEY = "train/routing/collapse"
EPISODE_FAILED_KEY = "episode/failed_frac"


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """Thresholds (the module docstring defines every guard)."""

  max_kl: float = math.inf
  min_entropy: float = 0.0
  max_verifier_timeout_rate: float = 0.5
  max_verifier_error_rate: float = 0.1
  max_skipped_updates: int = 10
  heldout_drop_evals: int = 0
  max_length_growth: float = math.inf
  length_growth_evals: int = 2
  max_routing_collapse: float = 0.95

  def __post_init__(self):

    for field in dataclasses.fields(self):
      check_range(f"guards.{field.name}", getattr(self, field.name))

  @classmethod
  def from_config(cls, guards: Any) -> "GuardConfig":
    """From `config.guards` (a ConfigDict or mapping); unknown fields are a ConfigError."""
    if isinstance(guards, GuardConfig):
      return guards
    values = dict(guards.to_dict() if hasattr(guards, "to_dict") else guards)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"config.guards.{unknown[0]} is not a guard setting; known: "
                        f"{sorted(known)}")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class Trip:
  """A guard that tripped: which, why (with the numbers), at which step."""

  guard: str
  message: str
  step: int
  values: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, Any]:
    return {"guard": self.guard, "message": self.message, "step": self.step,
            "values": dict(self.values)}


def _number(metrics: Mapping[str, Any], key: str) -> float | None:
  value = metrics.get(key)
  return None if value is None else float(value)


def _slope(points: list[list[float]]) -> float | None:
  """Ordinary least-squares slope of y on x; None with fewer than two distinct x."""
  if len(points) < 2:
    return None
  mean_x = sum(p[0] for p in points) / len(points)
  mean_y = sum(p[1] for p in points) / len(points)
  sxx = sum((p[0] - mean_x) ** 2 for p in points)
  if sxx == 0:
    return None
  return sum((p[0] - mean_x) * (p[1] - mean_y) for p in points) / sxx


class Guards:
  """Checks every step's metrics and every evaluation against `GuardConfig` thresholds."""

  def __init__(self, config: GuardConfig | Any, *, max_failed_episode_frac: float = 1.0):
    """`max_failed_episode_frac`: `agent.max_failed_frac` (agent rollouts; 1 = off)."""
    self.config = GuardConfig.from_config(config)
    check_range("agent.max_failed_frac", max_failed_episode_frac)
    self.max_failed_episode_frac = float(max_failed_episode_frac)
    self._consecutive_skipped = 0
    self._rewards: list[list[float]] = []  # [step, reward/mean] since the oldest kept evaluation
    self._evals: list[list[float]] = []  # [step, accuracy, length] of the latest evaluations

  # ------------------------------------------------------------------------------------ state

  def state_dict(self) -> dict[str, Any]:
    return {"consecutive_skipped": self._consecutive_skipped,
            "rewards": [list(p) for p in self._rewards],
            "evals": [list(e) for e in self._evals]}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self._consecutive_skipped = int(state["consecutive_skipped"])
    self._rewards = [[float(x) for x in p] for p in state["rewards"]]
    self._evals = [[float(x) for x in e] for e in state["evals"]]

  # ------------------------------------------------------------------------------------ steps

  def check_step(self, step: int, metrics: Mapping[str, Any]) -> Trip | None:
    """Updates the history with this step's metrics; returns the first guard that trips."""
    c = self.config
    reward = _number(metrics, TRAIN_REWARD_KEY)
    if reward is not None and math.isfinite(reward) and c.heldout_drop_evals > 0:
      self._rewards.append([float(step), reward])
    skipped = _number(metrics, SKIPPED_KEY)
    if skipped is not None:
      self._consecutive_skipped = self._consecutive_skipped + 1 if skipped > 0 else 0

    kl = _number(metrics, KL_KEY)
    if kl is not None and c.max_kl < math.inf and not kl <= c.max_kl:
      return Trip("max_kl", f"KL to the reference {kl:.6g} exceeds guards.max_kl={c.max_kl:.6g} "
                  f"at step {step}", step, {"kl": kl, "max_kl": c.max_kl})
    entropy = _number(metrics, ENTROPY_KEY)
    if entropy is not None and c.min_entropy > 0 and not entropy >= c.min_entropy:
      return Trip("min_entropy", f"mean token entropy {entropy:.6g} is below guards.min_entropy="
                  f"{c.min_entropy:.6g} at step {step}", step,
                  {"entropy": entropy, "min_entropy": c.min_entropy})
    for key, name, what in ((TIMEOUT_RATE_KEY, "max_verifier_timeout_rate", "timed out"),
                            (ERROR_RATE_KEY, "max_verifier_error_rate", "failed in the verifier")):
      rate, limit = _number(metrics, key), getattr(c, name)
      if rate is not None and rate > limit:
        return Trip(name, f"{rate:.1%} of the groups scored at step {step} {what} (zero rewards), "
                    f"above guards.{name}={limit:.6g}; see WORKDIR/logs/train.log", step,
                    {key: rate, name: limit})
    failed = _number(metrics, EPISODE_FAILED_KEY)
    if failed is not None and self.max_failed_episode_frac < 1 and \
        failed > self.max_failed_episode_frac:
      return Trip("max_failed_frac", f"{failed:.1%} of the agent episodes of step {step} raised "
                  f"or timed out (dropped), above agent.max_failed_frac="
                  f"{self.max_failed_episode_frac:.6g}; see WORKDIR/logs/train.log", step,
                  {EPISODE_FAILED_KEY: failed, "max_failed_frac": self.max_failed_episode_frac})
    collapse = _number(metrics, ROUTING_COLLAPSE_KEY)
    if collapse is not None and c.max_routing_collapse < 1 and collapse > c.max_routing_collapse:
      return Trip("max_routing_collapse",
                  f"routing collapsed at step {step}: the busiest expert of a sparse layer took "
                  f"{collapse:.1%} of the most it could take (train/routing/collapse), above "
                  f"guards.max_routing_collapse={c.max_routing_collapse:.6g}", step,
                  {ROUTING_COLLAPSE_KEY: collapse,
                   "max_routing_collapse": c.max_routing_collapse})
    if c.max_skipped_updates > 0 and self._consecutive_skipped >= c.max_skipped_updates:
      return Trip("max_skipped_updates",
                  f"{self._consecutive_skipped} consecutive steps skipped their update (non-finite "
                  f"loss or gradient), reaching guards.max_skipped_updates="
                  f"{c.max_skipped_updates} at step {step}", step,
                  {"consecutive_skipped": self._consecutive_skipped,
                   "max_skipped_updates": c.max_skipped_updates})
    return None

  # ------------------------------------------------------------------------------ evaluations

  def check_eval(self, step: int, eval_result: Mapping[str, Any]) -> Trip | None:
    """Adds an evaluation (its `accuracy`, `response_length/mean`); returns a trip or None."""
    accuracy = _number(eval_result, ACCURACY_KEY)
    length = _number(eval_result, LENGTH_KEY)
    if accuracy is None or length is None:
      raise ValueError(f"check_eval: the evaluation result needs {ACCURACY_KEY!r} and "
                       f"{LENGTH_KEY!r} (as evaluation.evaluate_completions returns)")
    self._evals.append([float(step), accuracy, length])
    keep = max(self.config.heldout_drop_evals, self.config.length_growth_evals) + 1
    self._evals = self._evals[-keep:]
    oldest = self._evals[0][0]
    self._rewards = [p for p in self._rewards if p[0] > oldest]
    return self._check_heldout_drop(step) or self._check_length_growth(step)

  def _check_heldout_drop(self, step: int) -> Trip | None:
    k = self.config.heldout_drop_evals
    if k == 0 or len(self._evals) < k + 1:
      return None
    window = self._evals[-(k + 1):]
    accuracies = [e[1] for e in window]
    if not all(a > b for a, b in zip(accuracies, accuracies[1:])):
      return None
    start = window[0][0]
    slope = _slope([p for p in self._rewards if start < p[0] <= step])
    if slope is None or slope <= 0:
      return None
    steps = [int(e[0]) for e in window]
    return Trip("heldout_drop_evals",
                f"held-out accuracy fell at {k} consecutive evaluations (steps {steps}: "
                f"{', '.join(f'{a:.4f}' for a in accuracies)}) while the training reward rose "
                f"(slope {slope:.4g} per step); guards.heldout_drop_evals={k}", step,
                {"eval_steps": steps, "accuracies": accuracies, "train_reward_slope": slope})

  def _check_length_growth(self, step: int) -> Trip | None:
    c = self.config
    if c.max_length_growth == math.inf or len(self._evals) < 2:
      return None
    base = self._evals[max(0, len(self._evals) - 1 - c.length_growth_evals)]
    current = self._evals[-1]
    (base_step, base_acc, base_len), (_, acc, length) = base, current
    if base_len <= 0:
      return None
    length_growth = length / base_len - 1
    if base_acc > 0:
      accuracy_growth = (acc - base_acc) / base_acc
    else:
      accuracy_growth = math.inf if acc > 0 else 0.0
    excess = length_growth - max(accuracy_growth, 0.0)
    if not excess > c.max_length_growth:
      return None
    return Trip("max_length_growth",
                f"held-out mean response length grew {length_growth:+.1%} ({base_len:.1f} -> "
                f"{length:.1f} tokens) from step {int(base_step)} to {step} while accuracy grew "
                f"{accuracy_growth:+.1%} ({base_acc:.4f} -> {acc:.4f}); the excess {excess:.3f} "
                f"exceeds guards.max_length_growth={c.max_length_growth:.6g}", step,
                {"length_growth": length_growth, "accuracy_growth": accuracy_growth,
                 "base_step": int(base_step), "base_length": base_len, "length": length,
                 "base_accuracy": base_acc, "accuracy": acc})


def write_stopped_md(workdir: str | os.PathLike[str], trip: Trip):
  """Writes workdir/STOPPED.md: which guard tripped, its numbers, the step, and the exit code."""
  path = storage.path(workdir) / STOPPED_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  lines = [f"# Run stopped by guard `{trip.guard}` at step {trip.step}", "",
           trip.message, "", "| value | |", "|---|---|"]
  lines += [f"| {key} | {value} |" for key, value in trip.values.items()]
  lines += ["", f"Exit code {int(ExitCode.GUARD)}. The newest checkpoint holds step {trip.step}; "
            f"change `config.guards.{trip.guard}` (or fix the cause) before resuming.", ""]
  storage.atomic_write(path, "\n".join(lines))
  return path
