"""Every guard trips on numbers past its threshold and stays quiet below it; state round-trips."""

import json
import math

import ml_collections
import pytest

from reasoning_rl import config as config_lib
from reasoning_rl import guards as guards_lib
from reasoning_rl.errors import ConfigError, ExitCode
from reasoning_rl.guards import GuardConfig, Guards


def test_config_from_base_config_and_errors():
  config = GuardConfig.from_config(config_lib.base_config().guards)
  assert config.max_kl == math.inf and config.max_skipped_updates == 10
  assert config.heldout_drop_evals == 0 and config.max_length_growth == math.inf
  with pytest.raises(ConfigError, match="guards.max_kll"):
    GuardConfig.from_config({"max_kll": 1.0})
  with pytest.raises(ConfigError, match="heldout_drop_evals"):
    GuardConfig(heldout_drop_evals=-1)
  with pytest.raises(ConfigError, match="max_kl"):
    GuardConfig(max_kl="big")


def test_defaults_trip_only_on_unscored_groups():
  guards = Guards(GuardConfig())
  for step in range(30):
    assert guards.check_step(step, {"kl": 1e9, "entropy": 0.0, "verifier/timeout_rate": 0.5,
                                    "verifier/error_rate": 0.1, "skipped_update": 0.0,
                                    "reward/mean": step}) is None
  # a broken verifier: by default the run stops instead of training on zeros
  trip = Guards(GuardConfig()).check_step(1, {"verifier/error_rate": 0.125})
  assert trip.guard == "max_verifier_error_rate" and "12.5%" in trip.message
  trip = Guards(GuardConfig()).check_step(1, {"verifier/timeout_rate": 0.75})
  assert trip.guard == "max_verifier_timeout_rate"
  assert Guards(GuardConfig(max_verifier_error_rate=1.0)).check_step(
      1, {"verifier/error_rate": 1.0}) is None
  for step, (acc, length) in enumerate([(0.9, 10), (0.5, 100), (0.1, 1000)]):
    assert guards.check_eval(step * 10, {"accuracy": acc, "response_length/mean": length}) is None


def test_max_kl():
  guards = Guards(ml_collections.ConfigDict({"max_kl": 0.5}))
  assert guards.check_step(1, {"kl": 0.5}) is None
  assert guards.check_step(2, {"loss": 1.0}) is None  # not logged: not checked
  trip = guards.check_step(3, {"kl": 0.7})
  assert trip.guard == "max_kl" and trip.step == 3 and trip.values["kl"] == 0.7
  assert "0.7" in trip.message and "0.5" in trip.message
  assert guards.check_step(4, {"kl": math.nan}).guard == "max_kl"
  assert Guards(GuardConfig(max_kl=1e-12)).check_step(1, {"kl": 1e-9}).guard == "max_kl"


def test_min_entropy():
  guards = Guards(GuardConfig(min_entropy=0.1))
  assert guards.check_step(1, {"entropy": 0.1}) is None
  trip = guards.check_step(2, {"entropy": 0.05})
  assert trip.guard == "min_entropy" and trip.values == {"entropy": 0.05, "min_entropy": 0.1}


def test_verifier_timeout_rate():
  guards = Guards(GuardConfig(max_verifier_timeout_rate=0.25))
  assert guards.check_step(1, {"verifier/timeout_rate": 0.25}) is None
  trip = guards.check_step(2, {"verifier/timeout_rate": 0.5})
  assert trip.guard == "max_verifier_timeout_rate" and "50.0%" in trip.message


def test_skipped_updates_counts_consecutive_steps():
  guards = Guards(GuardConfig(max_skipped_updates=3))
  pattern = [1, 1, 0, 1, 1]  # never three in a row
  assert all(guards.check_step(s, {"skipped_update": v}) is None for s, v in enumerate(pattern))
  trip = guards.check_step(5, {"skipped_update": 1.0})
  assert trip.guard == "max_skipped_updates" and trip.values["consecutive_skipped"] == 3
  off = Guards(GuardConfig(max_skipped_updates=0))
  assert all(off.check_step(s, {"skipped_update": 1}) is None for s in range(20))


def run_evals(guards, evals, rewards_per_interval):
  """evals: [(step, accuracy, length)]; train rewards logged on the steps between evaluations."""
  trips = []
  previous = 0
  for (step, accuracy, length), rewards in zip(evals, rewards_per_interval):
    for offset, reward in enumerate(rewards):
      assert guards.check_step(previous + 1 + offset, {"reward/mean": reward}) is None
    previous = step
    trips.append(guards.check_eval(step, {"accuracy": accuracy, "response_length/mean": length}))
  return trips


EVALS = [(0, 0.50, 10), (3, 0.45, 10), (6, 0.40, 10), (9, 0.35, 10)]


def test_heldout_drop_trips_when_accuracy_falls_k_times_and_reward_rises():
  guards = Guards(GuardConfig(heldout_drop_evals=2))
  trips = run_evals(guards, EVALS, [[], [0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
  assert trips[:2] == [None, None]
  trip = trips[2]  # accuracies 0.50 > 0.45 > 0.40 while reward rises over steps 1..6
  assert trip.guard == "heldout_drop_evals" and trip.step == 6
  assert trip.values["eval_steps"] == [0, 3, 6]
  assert trip.values["train_reward_slope"] == pytest.approx(0.1)


def test_heldout_drop_quiet_when_reward_falls_or_accuracy_recovers():
  falling = Guards(GuardConfig(heldout_drop_evals=2))
  assert run_evals(falling, EVALS, [[], [0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.3, 0.2, 0.1]]) == \
      [None] * 4
  recovering = Guards(GuardConfig(heldout_drop_evals=2))
  evals = [(0, 0.50, 10), (3, 0.45, 10), (6, 0.47, 10), (9, 0.46, 10)]
  assert run_evals(recovering, evals, [[], [0.1, 0.2, 0.3], [0.4, 0.5, 0.6],
                                       [0.7, 0.8, 0.9]]) == [None] * 4


def test_length_growth():
  config = GuardConfig(max_length_growth=0.5, length_growth_evals=2)
  # Length 100 -> 200 (+100%) while accuracy 0.40 -> 0.44 (+10%): excess 0.9 > 0.5.
  guards = Guards(config)
  assert guards.check_eval(0, {"accuracy": 0.40, "response_length/mean": 100}) is None
  assert guards.check_eval(5, {"accuracy": 0.42, "response_length/mean": 120}) is None
  trip = guards.check_eval(10, {"accuracy": 0.44, "response_length/mean": 200})
  assert trip.guard == "max_length_growth"
  assert trip.values["length_growth"] == pytest.approx(1.0)
  assert trip.values["accuracy_growth"] == pytest.approx(0.1)
  # Same length growth but accuracy +60%: excess 0.4, quiet.
  guards = Guards(config)
  assert guards.check_eval(0, {"accuracy": 0.40, "response_length/mean": 100}) is None
  assert guards.check_eval(10, {"accuracy": 0.64, "response_length/mean": 200}) is None
  # Accuracy from 0 to anything positive counts as unbounded growth.
  guards = Guards(config)
  guards.check_eval(0, {"accuracy": 0.0, "response_length/mean": 100})
  assert guards.check_eval(10, {"accuracy": 0.01, "response_length/mean": 400}) is None


def test_length_growth_window_compares_w_evaluations_back():
  guards = Guards(GuardConfig(max_length_growth=0.5, length_growth_evals=1))
  lengths = [100, 140, 196, 274]  # +40% per evaluation: never more than +50% versus the previous
  assert all(guards.check_eval(s, {"accuracy": 0.5, "response_length/mean": l}) is None
             for s, l in enumerate(lengths))
  guards = Guards(GuardConfig(max_length_growth=0.5, length_growth_evals=2))
  trips = [guards.check_eval(s, {"accuracy": 0.5, "response_length/mean": l})
           for s, l in enumerate(lengths)]
  assert trips[:2] == [None, None] and trips[2].guard == "max_length_growth"  # 196/100 - 1 = 0.96


def test_state_dict_resume_continues_exactly():
  config = GuardConfig(heldout_drop_evals=2, max_skipped_updates=3)
  whole = Guards(config)
  first = run_evals(whole, EVALS[:2], [[], [0.1, 0.2, 0.3]])
  whole.check_step(4, {"reward/mean": 0.4, "skipped_update": 1})
  state = json.loads(json.dumps(whole.state_dict()))  # JSON-able
  resumed = Guards(config)
  resumed.load_state_dict(state)
  for guards in (whole, resumed):
    assert guards.check_step(5, {"reward/mean": 0.5, "skipped_update": 1}) is None
    assert guards.check_step(6, {"reward/mean": 0.6}) is None
  trip_whole = whole.check_eval(6, {"accuracy": 0.40, "response_length/mean": 10})
  trip_resumed = resumed.check_eval(6, {"accuracy": 0.40, "response_length/mean": 10})
  assert first == [None, None] and trip_whole == trip_resumed
  assert trip_whole.guard == "heldout_drop_evals"
  assert whole.state_dict() == resumed.state_dict()
  assert whole.state_dict()["consecutive_skipped"] == 2


def test_write_stopped_md(tmp_path):
  trip = Guards(GuardConfig(max_kl=1e-12)).check_step(7, {"kl": 0.003})
  path = guards_lib.write_stopped_md(tmp_path, trip)
  text = path.read_text()
  assert path.name == "STOPPED.md"
  assert "`max_kl`" in text and "step 7" in text and "0.003" in text and "Exit code 3" in text
  assert ExitCode.GUARD == 3 and ExitCode.PREEMPTED == 143
