"""`python_tool`: the model runs Python in the code sandbox between reasoning steps.

Tool-integrated reasoning as in ToRL (Li et al. 2025, "ToRL: Scaling Tool-Integrated RL") and
ReTool (Feng et al. 2025, "ReTool: Reinforcement Learning for Strategic Tool Use in LLMs"): the
model writes code in `<python> … </python>`; the turn ends at "</python>"; the program runs and
what it printed comes back as the observation; the model goes on. A turn without a complete
`<python>` block ends the episode, and the task's verifier (the `correct` verifiers of
`verifiers/rewards.py`, e.g. `math` with `extract="final_answer"` as the arithmetic demo) judges
the FINAL model turn's text only, outside any `<python>` block: a program that prints the answer
earns nothing unless the model states it.

How a call runs: in the existing sandbox (`verifiers/sandbox`, through `code_tests.run_tests`;
docs/sandbox.md): fresh Linux namespaces, no network, no host files, no kernel keys, read-only
device nodes, rlimits (CPU, address space, processes) and `memory_mb` for all the program's
processes together, a wall deadline of `timeout_s`. The program is wrapped by a small harness that
runs it as `__main__`, sends `sys.stdout` and `sys.stderr` (interleaved, as a terminal shows them)
into a buffer that keeps the first `observation_max_chars` characters and counts the rest, and
prints a traceback (harness frames left out) for an exception. The sandbox's trusted supervisor
reads the kept text back in pieces, as the failure messages of tests that raise it (the only channel
it has to the host), so nothing about the sandbox changes. Output written to the file descriptors
directly (os.write(1, …), subprocesses) is not captured.

Observations (exact texts; `timeout_s` written with `:g`):
- the captured output, cut to `observation_max_chars` with
  "\n[output truncated: {total} characters, the first {observation_max_chars} shown]";
- "timed out after {timeout_s} s" (partial output is lost: the program is killed);
- "the program was killed: {why}" / "{why}" for a program that ended its own process
  (os._exit): the sandbox's reason;
- "call limit reached: {max_calls} calls were run; this code was not run. State the final
  answer." once `max_calls` programs ran.

Determinism: `random` is seeded with the episode's seed before the first cell, so a program's
random draws repeat; with `keep_state`, every earlier cell that ran to its end (or raised) runs
again first, silently, in order, so state (variables, functions, the random stream) is that of one
interpreter that ran the cells in turn. Not fixed: str hashes (the sandbox starts Python with -I, so
the order of a set of strings may differ between runs), the clock, and timeouts (reported in
`info["timed_out"]`).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Mapping
from typing import Any

from reasoning_rl import config_groups, registries
from reasoning_rl.environments.base import Turn
from reasoning_rl.errors import ConfigError
from reasoning_rl.verifiers import code_tests, rewards
from reasoning_rl.verifiers.sandbox import SandboxLimits, namespace_probe_failure

NAME = "python_tool"
CODE_BLOCK = re.compile(r"<python>(.*?)</python>", re.DOTALL)
STOP_STRING = "</python>"
# The supervisor cuts a failing test's message to 300 characters, "Piece: " included.
_PIECE_CHARS = 256
_PIECE_PREFIX = "Piece: "

# Declared (defaults, ranges, meaning) in the config schema, which also checks them.
SETTINGS = config_groups.ENVIRONMENTS[NAME]


def _harness(cells: list[str], keep_chars: int, seed: int) -> str:
  """The program the sandbox runs: the model's cells (the last one's output captured) in the
  wrapper the module docstring describes. Leaves exactly two names: _rrl_output, _rrl_total."""
  return f'''
def _rrl_main(cells, keep_chars, seed):
  import builtins, io, linecache, random, sys, traceback

  class Capture(io.TextIOBase):
    """Keeps the first keep_chars characters written, counts them all."""
    def __init__(self, keep):
      self.keep, self.parts, self.kept, self.total = keep, [], 0, 0
    def writable(self):
      return True
    def write(self, text):
      if not isinstance(text, str):
        raise TypeError(f"write() argument must be str, not {{type(text).__name__}}")
      self.total += len(text)
      if self.kept < self.keep:
        piece = text[:self.keep - self.kept]
        self.parts.append(piece)
        self.kept += len(piece)
      return len(text)

  random.seed(seed)
  namespace = {{"__name__": "__main__", "__builtins__": builtins}}
  capture = None
  for number, source in enumerate(cells, 1):
    capture = Capture(keep_chars if number == len(cells) else 0)
    name = f"<cell {{number}}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = capture
    try:
      exec(compile(source, name, "exec"), namespace)
    except SystemExit as stop:
      if stop.code is not None and not isinstance(stop.code, int):
        print(stop.code, file=capture)
    except BaseException as error:  # the model's bug is the observation
      traceback.print_exception(type(error), error, error.__traceback__.tb_next, file=capture)
    finally:
      sys.stdout, sys.stderr = saved
  return "".join(capture.parts), capture.total

_rrl_output, _rrl_total = _rrl_main({cells!r}, {keep_chars!r}, {seed!r})
del _rrl_main
'''


def _reader_tests(keep_chars: int) -> list[str]:
  """Trusted snippets the supervisor runs after the program: test 0 raises the output's length,
  test k its k-th piece (plain str checked by exact type, so the program cannot hand over an
  object of its own)."""
  tests = ["class Piece(Exception): pass\n"
           "raise Piece(str(_rrl_total) if type(_rrl_total) is int else '-1')"]
  for start in range(0, keep_chars, _PIECE_CHARS):
    tests.append("class Piece(Exception): pass\n"
                 f"raise Piece(_rrl_output[{start}:{start + _PIECE_CHARS}] "
                 "if type(_rrl_output) is str else '')")
  return tests


def _printable(text: str) -> str:
  """Lone surrogates (a program may print '\\udc80') cannot be tokenized: each becomes "?"."""
  return text.encode("utf-8", "replace").decode("utf-8") if any(
      "\ud800" <= ch <= "\udfff" for ch in text) else text


@dataclasses.dataclass(frozen=True)
class Execution:
  """One program run: the observation and the facts for the rollout record."""

  observation: str
  status: str  # ok | timeout | killed | error
  seconds: float
  output_chars: int
  truncated: bool


class PythonToolEnvironment:
  """Runs the model's `<python>` blocks in the sandbox (module docstring). Settings: SETTINGS."""

  name = NAME
  turn_stop_strings = (STOP_STRING,)

  def __init__(self, settings: Mapping[str, Any] | None = None, *,
               field: str = "environment.settings"):
    values = SETTINGS.resolve(settings, field=field, floats=True)
    # The schema's choice is any registered verifier; it cannot exclude one of them.
    if values["verifier"] == "code":
      raise ConfigError(f"config.{field}.verifier='code': the code verifier runs tests, not a "
                        "final answer; use another `correct` verifier of registry.VERIFIERS (math, "
                        "countdown, reasoning_gym, auto)")
    for key, value in values.items():
      setattr(self, key, value)
    self.settings = values
    # The correct part the reward parts use, resolved and checked as rewards.<name> would be.
    try:
      (part,) = rewards.build_parts({"correct": {
          "weight": 1.0, "verifier": self.verifier, "extract": self.extract,
          "answer_tag": self.answer_tag, "timeout_s": self.verify_timeout_s}})
    except ConfigError as error:
      raise ConfigError(f"config.{field}: the verifier settings are inconsistent: "
                        f"{error}") from None
    self.correct_settings = dict(part.settings)
    self.limits = SandboxLimits(memory_mb=self.memory_mb)
    if self.isolation == "namespaces":
      failure = namespace_probe_failure()
      if failure is not None:
        raise ConfigError(
            f"config.{field}.isolation='namespaces': the code sandbox cannot run here ({failure}); "
            "enable unprivileged user namespaces, or set it to 'rlimits_only' to accept weaker "
            "isolation (the program can then read host files)")

  def reset(self, example, *, seed: int) -> "PythonToolEpisode":
    return PythonToolEpisode(self, example, int(seed))

  def finish(self, episode: "PythonToolEpisode") -> Turn:
    return episode.finish()

  def run(self, cells: list[str], *, seed: int) -> Execution:
    """Runs `cells` (the last one's output kept) in the sandbox; never raises for their content."""
    keep = self.observation_max_chars
    result = code_tests.run_tests(_harness(cells, keep, seed), _reader_tests(keep),
                                  timeout_s=self.timeout_s, isolation=self.isolation,
                                  limits=self.limits)
    if result.status == "timeout":
      return Execution(f"timed out after {self.timeout_s:g} s", "timeout", result.wall_s, 0, False)
    if result.status == "killed":
      return Execution(f"the program was killed: {result.detail}", "killed", result.wall_s, 0,
                       False)
    pieces = []
    for reason in result.test_reasons:
      if not reason.startswith(_PIECE_PREFIX):  # the program ended its process (os._exit …)
        why = result.detail or "the program ended without reporting its output"
        if why.startswith("the sandbox supervisor failed"):  # host text: not for the model
          why = "the sandbox failed to run the program"
        return Execution(why, "error", result.wall_s, 0, False)
      pieces.append(reason[len(_PIECE_PREFIX):])
    total, text = int(pieces[0]), _printable("".join(pieces[1:])[:keep])
    truncated = total > keep
    if truncated:
      text += f"\n[output truncated: {total} characters, the first {keep} shown]"
    return Execution(text, "ok", result.wall_s, total, truncated)

  def score(self, example, final_text: str) -> float:
    """The task's verifier on the final model turn's text, `<python>` blocks removed."""
    record = rewards.CompletionRecord(
        response=CODE_BLOCK.sub("", final_text), ground_truth=example.answer, task=example.task,
        prompt=example.prompt, tests=example.tests, metadata=dict(example.metadata))
    return float(rewards.score_correct(record, self.correct_settings))


class PythonToolEpisode:
  """One episode: counts calls, keeps the cells that ran (for keep_state) and the last turn."""

  def __init__(self, environment: PythonToolEnvironment, example, seed: int):
    self.environment, self.example, self.seed = environment, example, seed
    self.cells: list[str] = []  # programs that ran to their end or raised: replayed
    self.calls = 0
    self.last_text = ""
    self.outcome: Turn | None = None
    self._lock = threading.Lock()  # one episode's turns come in order; this makes it certain

  def step(self, model_text: str) -> Turn:
    with self._lock:
      if self.outcome is not None:
        return self.outcome
      self.last_text = model_text
      match = CODE_BLOCK.search(model_text)
      if match is None:
        return self._end()
      env = self.environment
      if self.calls >= env.max_calls:
        return Turn(f"call limit reached: {env.max_calls} calls were run; this code was not run. "
                    "State the final answer.", False,
                    info={"call": None, "status": "call_limit", "timed_out": False})
      self.calls += 1
      code = match.group(1)
      previous = self.cells if env.keep_state else []
      execution = env.run(previous + [code], seed=self.seed)
      if execution.status == "ok" and env.keep_state:  # raised ones too, as Jupyter keeps them
        self.cells.append(code)
      return Turn(execution.observation, False, info={
          "call": self.calls, "status": execution.status,
          "timed_out": execution.status == "timeout", "seconds": round(execution.seconds, 3),
          "output_chars": execution.output_chars, "truncated": execution.truncated})

  def finish(self) -> Turn:
    with self._lock:
      return self.outcome if self.outcome is not None else self._end()

  def _end(self) -> Turn:
    correct = self.environment.score(self.example, self.last_text)
    self.outcome = Turn(None, True, reward_parts={"correct": correct},
                        info={"calls": self.calls})
    return self.outcome


def build(settings: Mapping[str, Any] | None, *, field: str) -> PythonToolEnvironment:
  return PythonToolEnvironment(settings, field=field)


registries.ENVIRONMENTS.add(
    NAME, build, summary="the model runs <python> blocks in the code sandbox and sees their "
    "output; the task's verifier judges the final turn (ToRL, Li et al. 2025; ReTool, Feng et "
    "al. 2025)", options=SETTINGS.names())

__all__ = ["CODE_BLOCK", "Execution", "NAME", "PythonToolEnvironment", "PythonToolEpisode",
           "SETTINGS", "STOP_STRING"]
