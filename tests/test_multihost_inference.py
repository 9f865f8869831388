"""launch/evaluate.py and launch/generate.py split over 2 local processes (2 CPU devices each)
give exactly what one process gives, on a real run's checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from reasoning_rl.multihost.data_parallel import Share
from tests import multihost_runs as runs

REPO = runs.REPO


def test_share_takes_every_nth_id_and_merges_in_order():
  ids = list(range(10, 17))
  assert Share(0, 3).mine(ids) == [10, 13, 16] and Share(2, 3).mine(ids) == [12, 15]
  assert Share().merge("x", {3: "c", 1: "a"}) == {1: "a", 3: "c"}


class _SmallStore:
  """One process's exchange with a tiny value limit: records what each gather carried."""

  max_value_bytes = 200

  def __init__(self):
    self.sent = []

  def gather(self, name, value):
    self.sent.append((name, len(json.dumps(value))))
    return [value]


def test_merge_sends_results_in_pieces_under_the_store_limit():
  from reasoning_rl.multihost.data_parallel import _pieces

  results = {i: "x" * 30 for i in range(20)}
  store = _SmallStore()
  assert Share(0, 1, exchange=store).merge("gen", results) == results
  pieces = [size for name, size in store.sent if name != "gen/pieces"]
  assert len(pieces) > 4 and max(pieces) <= store.max_value_bytes // 2
  assert [name for name, _ in store.sent][:2] == ["gen/pieces", "gen/0"]
  assert _pieces({}, 100) == [{}]  # nothing to send is still one (empty) round


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("inference") / "run"
  done = runs.run_single(workdir, ["--config.total_steps=2", "--config.checkpoint.every_steps=2",
                                   "--config.eval.num_examples=4"], devices=2)
  assert done.returncode == 0, done.stdout + done.stderr
  return workdir


def _run(command: list[str], *, num_processes: int, timeout_s: float = 300) -> None:
  """Runs `command` as one process, or as `num_processes` joined by the process flags."""
  env = runs.environment(runs.DEVICES_PER_PROCESS)
  if num_processes == 1:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stdout + done.stderr
    return
  port = runs.free_port_block(num_processes + 2)
  processes = [subprocess.Popen(
      command + [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
                 f"--process_id={index}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for index in range(num_processes)]
  outputs = [p.communicate(timeout=timeout_s)[0] for p in processes]
  assert [p.returncode for p in processes] == [0] * num_processes, "\n".join(outputs)


def test_evaluation_split_over_processes_equals_one_process(trained_run, tmp_path):
  def command(output):
    return [sys.executable, str(REPO / "launch" / "evaluate.py"), "--config=configs/debug_cpu.py",
            f"--checkpoint={trained_run}", f"--output={output}", "--config.eval.num_examples=12",
            "--config.eval.num_samples=2", "--config.eval.temperature=1.0"]

  _run(command(tmp_path / "one.json"), num_processes=1)
  _run(command(tmp_path / "two.json"), num_processes=2)
  one = json.loads((tmp_path / "one.json").read_text())
  two = json.loads((tmp_path / "two.json").read_text())
  assert one["num_examples"] == 12 and len(one["examples"]) == 12
  assert two == one


def test_generation_split_over_processes_equals_one_process(trained_run, tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n"
                             for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1)]))

  def command(output):
    return [sys.executable, str(REPO / "launch" / "generate.py"), f"--checkpoint={trained_run}",
            f"--prompts_file={prompts}", f"--output={output}", "--max_new_tokens=6",
            "--num_samples=3", "--temperature=1.0", "--no_chat_template", "--batch_prompts=3"]

  _run(command(tmp_path / "one.jsonl"), num_processes=1)
  _run(command(tmp_path / "two.jsonl"), num_processes=2)
  one = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
  two = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
  assert len(one) == 5 * 3 and len(two) == len(one)
  for a, b in zip(one, two):  # same tokens; log-probs from a 2-device mesh vs one device
    np.testing.assert_allclose(b.pop("logprobs"), a.pop("logprobs"), rtol=1e-5, atol=1e-5)
    assert b == a
