"""Task sources: prompts with ground truth, addressed by an integer index.

Every source answers `example(index)` deterministically, for any index >= 0, so the trainer's data
position is one integer: checkpoint it and the same position yields the same examples again.
Sources are endless: finite ones start another epoch (see each source for how).

Kinds (`config.data.train` / `config.data.eval`: `kind` plus the settings below):
- `synthetic_arithmetic`: "3+4=" -> "7" (`seed`, `max_operand`, `ops`), written only with characters
  of the built-in "debug_arithmetic" vocabulary.
- `reasoning_gym`: any reasoning-gym generator (`name`, `seed`, `size`, `params`).
- `jsonl`: a file of `{"prompt"|"question", "answer", "tests"?, "task"?, ...}` rows (`path`,
  `shuffle`, `seed`).
- `mixture`: several sources interleaved by weight (`sources`, `weights`).
- `agent`: the tasks the run's agent brings (`config.agent.entry` whose agent has `examples()`, a
  hub taskset: docs/agent_hubs.md), in order or reshuffled each epoch (`shuffle`, `seed`);
  training data only.

`PromptStream` walks a source from a position, skipping prompts that belong to the held-out set.
"""

from __future__ import annotations

import dataclasses
import fractions
import importlib.metadata
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from reasoning_rl import config_groups, registries, storage
from reasoning_rl.errors import ConfigError
from reasoning_rl.plain_data import plain

SYNTHETIC_OPS = config_groups.SYNTHETIC_OPS  # declared with the setting that names them
MAX_MIXTURE_PERIOD = 100_000
_JSONL_KNOWN_FIELDS = ("prompt", "question", "answer", "tests", "task", "metadata", "uid", "id")


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance.

  Attributes:
    uid: stable id of the problem (the same problem has the same uid in every run).
    prompt: the task's question text, before any template.
    answer: the ground truth as a string ("" for code tasks judged only by `tests`).
    task: task name ("synthetic_arithmetic", "basic_arithmetic", "countdown", ...); verifiers route
      on it.
    metadata: JSON-able facts verifiers need (reasoning-gym entry metadata incl. `source_dataset`,
      countdown `numbers`/`target`, ...).
    tests: assert statements for code tasks (empty otherwise).
  """

  uid: str
  prompt: str
  answer: str
  task: str
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
  tests: tuple[str, ...] = ()


class TaskSource(Protocol):
  """Deterministic random access to an endless sequence of examples."""

  kind: str

  def example(self, index: int) -> Example:
    """The example at data position `index` (>= 0); the same index always gives the same one."""
    ...


def _check_index(index: int) -> int:
  if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
    raise ValueError(f"example index must be an integer >= 0, got {index!r}")
  return int(index)


def _json_value(value: Any) -> Any:
  """`value` with tuples as lists and numpy scalars/arrays as Python values, so that it survives a
  JSON round trip unchanged (rollout records, checkpoints and worker pipes all carry metadata)."""
  if isinstance(value, Mapping):
    return {str(key): _json_value(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_value(item) for item in value]
  if isinstance(value, np.ndarray):
    return _json_value(value.tolist())
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, (set, frozenset)):
    return sorted(_json_value(item) for item in value)
  if value is None or isinstance(value, (str, int, float, bool)):
    return value
  return str(value)


def _derived_seed(*parts: int) -> int:
  """A seed in [0, 2**31) derived from integers (numpy's SeedSequence hashing); fits every RNG."""
  return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint32)[0] >> 1)


# ----------------------------------------------------------------------------- synthetic


@dataclasses.dataclass(frozen=True)
class SyntheticArithmeticSource:
  """`a<op>b=` -> the exact integer result, a, b uniform in [0, max_operand], op uniform in `ops`.

  Operands and operator of index i come from a generator seeded by (seed, i), so every index is
  independent of the others. Endless; with max_operand = 9 and ops "+" there are 100 distinct
  prompts, which repeat.
  """

  seed: int = 0
  max_operand: int = 9
  ops: tuple[str, ...] = ("+",)
  kind: str = "synthetic_arithmetic"

  def example(self, index: int) -> Example:
    index = _check_index(index)
    rng = np.random.default_rng([self.seed, index])
    a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
    op = self.ops[int(rng.integers(len(self.ops)))]
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Example(uid=f"synthetic_arithmetic/{self.seed}/{index}", prompt=f"{a}{op}{b}=",
                   answer=str(result), task="synthetic_arithmetic",
                   metadata={"operands": [a, b], "op": op, "source_index": index})


# ----------------------------------------------------------------------------- reasoning-gym


class ReasoningGymSource:
  """A reasoning-gym generator: `reasoning_gym.create_dataset(name, seed=..., size=..., **params)`.

  Index i < size is exactly entry i of that dataset. Beyond it the source wraps into epoch
  e = i // size, a dataset of the same size and params whose seed is derived from (seed, e), so
  the stream goes on with new problems instead of repeating or failing.
  """

  kind = "reasoning_gym"

  def __init__(self, name: str, *, seed: int = 0, size: int = 1000,
               params: Mapping[str, Any] | None = None, field: str = "data"):
    import reasoning_gym  # Imported here: it takes seconds and only this source needs it.
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
      raise ConfigError(f"config.{field}.name={name!r}: not a dataset of reasoning-gym "
                        f"{_reasoning_gym_version()}; e.g. basic_arithmetic, countdown, "
                        "gsm_symbolic (all: sorted(reasoning_gym.factory.DATASETS))")
    self.name, self.seed, self.size = name, seed, size
    self.params = dict(params or {})
    self._create = reasoning_gym.create_dataset
    self._field = field
    self._datasets: dict[int, Any] = {}  # epoch -> dataset; the few most recent are kept
    self._dataset(0)  # Fails now, naming the field, if the params are wrong.

  def epoch_seed(self, epoch: int) -> int:
    return self.seed if epoch == 0 else _derived_seed(self.seed, epoch)

  def _dataset(self, epoch: int):
    if epoch not in self._datasets:
      try:
        dataset = self._create(self.name, seed=self.epoch_seed(epoch), size=self.size,
                               **self.params)
      except (TypeError, ValueError, AssertionError) as error:
        raise ConfigError(f"config.{self._field}.params={self.params!r}: reasoning-gym rejects "
                          f"them for {self.name!r} ({type(error).__name__}: {error}); fix the "
                          "dataset options") from error
      if len(self._datasets) >= 4:
        self._datasets.pop(next(iter(self._datasets)))
      self._datasets[epoch] = dataset
    return self._datasets[epoch]

  def dataset(self, index: int):
    """The reasoning-gym dataset holding `index` (for its `score_answer`)."""
    return self._dataset(_check_index(index) // self.size)

  def example(self, index: int) -> Example:
    index = _check_index(index)
    epoch, local = divmod(index, self.size)
    entry = self._dataset(epoch)[local]
    metadata = _json_value(entry.get("metadata", {}))
    metadata.setdefault("source_dataset", self.name)
    return Example(uid=f"{self.name}/{self.epoch_seed(epoch)}/{local}", prompt=entry["question"],
                   answer=str(entry["answer"]), task=self.name, metadata=metadata)


def _reasoning_gym_version() -> str:
  return importlib.metadata.version("reasoning-gym")


# ----------------------------------------------------------------------------- jsonl


def _parse_jsonl_row(row: Any, where: str) -> dict[str, Any]:
  """The Example fields of one file row; ConfigError names `where` (file:line) and the field."""
  if not isinstance(row, dict):
    raise ConfigError(f"{where}: expected a JSON object, found {type(row).__name__}")
  prompt = row.get("prompt", row.get("question"))
  if not isinstance(prompt, str) or not prompt.strip():
    raise ConfigError(f"{where}: field 'prompt' (or 'question') must be a non-empty string, got "
                      f"{prompt!r}")
  tests = row.get("tests", [])
  if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
    raise ConfigError(f"{where}: field 'tests' must be a list of strings (assert statements)")
  answer = row.get("answer")
  if answer is None and tests:
    answer = ""  # Code tasks are judged by their tests.
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise ConfigError(f"{where}: field 'answer' must be a string or number (it may be left out "
                      f"only when 'tests' are given), got {answer!r}")
  task = row.get("task", "math")
  if not isinstance(task, str) or not task:
    raise ConfigError(f"{where}: field 'task' must be a non-empty string, got {task!r}")
  metadata = row.get("metadata", {})
  if not isinstance(metadata, dict):
    raise ConfigError(f"{where}: field 'metadata' must be a JSON object, got {metadata!r}")
  metadata = dict(metadata)
  metadata.update({k: v for k, v in row.items() if k not in _JSONL_KNOWN_FIELDS})
  uid = row.get("uid", row.get("id"))
  return dict(prompt=prompt, answer=answer if isinstance(answer, str) else json.dumps(answer),
              task=task, metadata=metadata, tests=tuple(tests),
              uid=None if uid is None else str(uid))


class JsonlSource:
  """Rows of a JSONL file, in file order (or reshuffled every epoch with `shuffle`).

  Index i is row i % num_rows of epoch i // num_rows; with `shuffle`, each epoch visits the rows
  in a permutation seeded by (seed, epoch). Extra row keys go into `metadata`. `task` defaults to
  "math"; `uid` is the row's "uid"/"id", else "<file name>:<line>".
  """

  kind = "jsonl"

  def __init__(self, path: str, *, shuffle: bool = False, seed: int = 0, field: str = "data"):
    file = storage.path(path)
    if not file.is_file():
      raise ConfigError(f"config.{field}.path={path!r}: no such file; give a JSONL file of "
                        '{"prompt", "answer", ...} rows')
    self.path, self.shuffle, self.seed = file, shuffle, seed
    self._epoch_order: tuple[int, np.ndarray | None] = (-1, None)
    self.examples: list[Example] = []
    with file.open("rb") as lines:
      for line_number, raw in enumerate(lines, start=1):
        where = f"{file}:{line_number}"
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
          raise ConfigError(f"{where}: not UTF-8 text (byte {error.start} of the line is "
                            f"{raw[error.start]:#04x}); give a JSONL file of "
                            '{"prompt", "answer", ...} rows') from None
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as error:
          raise ConfigError(f"{where}: not valid JSON ({error}); one object per line") from error
        fields = _parse_jsonl_row(row, where)
        uid = fields.pop("uid") or f"{file.name}:{line_number}"
        self.examples.append(Example(uid=uid, **fields))
    if not self.examples:
      raise ConfigError(f"config.{field}.path={path!r}: the file has no rows")

  @property
  def num_rows(self) -> int:
    return len(self.examples)

  def _order(self, epoch: int) -> np.ndarray:
    if self._epoch_order[0] != epoch:
      self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(
          self.num_rows))
    return self._epoch_order[1]

  def example(self, index: int) -> Example:
    epoch, row = divmod(_check_index(index), self.num_rows)
    if self.shuffle:
      row = int(self._order(epoch)[row])
    return self.examples[row]


# ----------------------------------------------------------------------------- mixture


class MixtureSource:
  """Sources interleaved in fixed proportion: a deterministic, evenly spread weighted round robin.

  Weights are turned into small integers w_k (ratios exact to 1/1000). Each block of W = sum(w_k)
  consecutive indices holds exactly w_k examples of source k, placed by smooth weighted round robin
  (each slot goes to the source furthest behind its share), so index i maps in O(1) to
  (source k, that source's own index) and every source is read in its own order.
  """

  kind = "mixture"

  def __init__(self, sources: Sequence[TaskSource], weights: Sequence[float], *,
               field: str = "data"):
    ratios = [fractions.Fraction(w / max(weights)).limit_denominator(1000) for w in weights]
    scale = math.lcm(*(r.denominator for r in ratios))
    integers = [int(r * scale) for r in ratios]
    divisor = math.gcd(*integers)
    self.weights = [w // divisor for w in integers]
    if min(self.weights) == 0:
      raise ConfigError(f"config.{field}.weights={list(weights)}: a weight below 1/1000 of the "
                        "others rounds to 0; drop that source or raise its weight")
    if sum(self.weights) > MAX_MIXTURE_PERIOD:
      raise ConfigError(f"config.{field}.weights={list(weights)}: their ratios need a period of "
                        f"{sum(self.weights)} slots; use simpler ratios (e.g. 1, 2, 0.25)")
    self.sources = list(sources)
    self.slots: list[tuple[int, int]] = []  # slot -> (source, rank of the slot in that source)
    credit = [0] * len(self.weights)
    total = sum(self.weights)
    counts = [0] * len(self.weights)
    for _ in range(total):
      credit = [c + w for c, w in zip(credit, self.weights)]
      chosen = max(range(len(credit)), key=lambda k: (credit[k], -k))
      credit[chosen] -= total
      self.slots.append((chosen, counts[chosen]))
      counts[chosen] += 1

  def locate(self, index: int) -> tuple[int, int]:
    """(source number, index within that source) of mixture position `index`."""
    block, slot = divmod(_check_index(index), len(self.slots))
    source, rank = self.slots[slot]
    return source, block * self.weights[source] + rank

  def example(self, index: int) -> Example:
    source, inner = self.locate(index)
    return self.sources[source].example(inner)


# ----------------------------------------------------------------------------- agent


class AgentTasksSource:
  """The tasks a run's agent brings (`examples()` of a hub adapter's agent: one JSON-safe dict per
  task), as examples: index i is task i % num_rows of epoch i // num_rows (with `shuffle`, each
  epoch visits them in a permutation seeded by (seed, epoch)). An Example's `metadata` is the task
  dict itself — what the agent is handed back (`hub_support.example_fields`); `prompt` is its
  "prompt" (text, or its messages as JSON), `answer` its "answer" ("" if none), uid "agent/<row>".
  """

  kind = "agent"

  def __init__(self, rows: Sequence[Mapping[str, Any]], *, shuffle: bool = False, seed: int = 0,
               field: str = "data.train"):
    if not rows:
      raise ConfigError(f"config.{field}.kind='agent': the agent (config.agent.entry) brought no "
                        "tasks; check its environment's arguments (config.agent.env_args)")
    self.examples = [self._example(number, row, field) for number, row in enumerate(rows)]
    self.shuffle, self.seed = shuffle, seed
    self._epoch_order: tuple[int, np.ndarray | None] = (-1, None)

  @staticmethod
  def _example(number: int, row: Mapping[str, Any], field: str) -> Example:
    if not isinstance(row, Mapping):
      raise ConfigError(f"config.{field}.kind='agent': the agent's task {number} is a "
                        f"{type(row).__name__}, not a dict of its fields")
    task = _json_value(row)
    prompt, answer = task.get("prompt"), task.get("answer")
    return Example(uid=f"agent/{number}",
                   prompt=prompt if isinstance(prompt, str) else json.dumps(
                       prompt if prompt is not None else task, sort_keys=True),
                   answer="" if answer is None else answer if isinstance(answer, str)
                   else json.dumps(answer), task="agent", metadata=task)

  @property
  def num_rows(self) -> int:
    return len(self.examples)

  def example(self, index: int) -> Example:
    epoch, row = divmod(_check_index(index), self.num_rows)
    if self.shuffle:
      if self._epoch_order[0] != epoch:
        self._epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(
            self.num_rows))
      row = int(self._epoch_order[1][row])
    return self.examples[row]


# ----------------------------------------------------------------------------- building


@dataclasses.dataclass(frozen=True)
class TaskSourceKind:
  """A kind of task source, as registered in `registries.TASK_SOURCES`.

  settings: every setting the kind accepts, declared in the schema (`config_groups.Group`:
    default, meaning, accepted values); a config names `kind` and what differs.
  build(values, field) -> TaskSource: the source of the resolved settings (defaults filled in,
    each checked); it checks what the declarations cannot say (one setting against another, a
    file that must exist) and raises ConfigError naming `config.<field>.<setting>`.
  needs: the run's inputs (beyond its settings) `build` takes as keywords, e.g.
    "agent_examples" (the `agent` kind); `build_source(..., provided=)` hands them over, None for
    one the caller did not provide (the builder says what is missing).
  """

  settings: config_groups.Group
  build: Callable[..., TaskSource]
  needs: tuple[str, ...] = ()


def register_source(kind: str, summary: str, needs: tuple[str, ...] = ()):
  """Decorator: registers `build(values, field, **needs) -> TaskSource` as task source `kind`,
  whose settings are `config_groups.TASK_SOURCES[kind]` (`TaskSourceKind` for `needs`)."""

  def add(build):
    settings = config_groups.TASK_SOURCES[kind]
    registries.TASK_SOURCES.add(kind, TaskSourceKind(settings, build, tuple(needs)),
                                summary=summary, options=settings.names())
    return build

  return add


def build_source(source_config: Any, *, field: str = "data",
                 provided: Mapping[str, Any] | None = None) -> TaskSource:
  """The source a config describes: `kind` plus that kind's settings (module docstring).

  Args:
    source_config: a ConfigDict or dict, e.g. `dict(kind="reasoning_gym", name="countdown")`.
    field: its config path, named in errors (the trainer passes "data.train" / "data.eval").
    provided: the run's inputs a kind `needs` (the trainer provides "agent_examples" for
      data.train when config.agent.entry is set).

  Raises:
    ConfigError: unknown kind or setting, missing or ill-typed setting, or a source that cannot
      be built (missing file, bad rows, params the generator rejects); the message names
      `config.<field>.<setting>` and the fix.
  """
  settings = plain(source_config, keep_tuples=True)
  if not isinstance(settings, dict):
    raise ConfigError(f"config.{field}={settings!r}: must be a dict with 'kind' and its settings")
  kind = settings.pop("kind", None)
  source = registries.TASK_SOURCES.get(kind, field=f"{field}.kind").impl
  inputs = {name: (provided or {}).get(name) for name in source.needs}
  return source.build(source.settings.resolve(settings, field=field), field, **inputs)


@register_source("synthetic_arithmetic", summary="a op b with single operands up to "
                 "max_operand, generated (no dependency; the debug task)")
def _synthetic_arithmetic(values, field) -> TaskSource:
  del field
  return SyntheticArithmeticSource(seed=values["seed"], max_operand=values["max_operand"],
                                   ops=tuple(dict.fromkeys(values["ops"])))


@register_source("reasoning_gym", summary="any reasoning-gym dataset by name, with its own "
                 "checker")
def _reasoning_gym(values, field) -> TaskSource:
  return ReasoningGymSource(values["name"], seed=values["seed"], size=values["size"],
                            params=values["params"], field=field)


@register_source("jsonl", summary="rows of {prompt|question, answer, tests, task} from a JSONL "
                 "file")
def _jsonl(values, field) -> TaskSource:
  return JsonlSource(values["path"], shuffle=values["shuffle"], seed=values["seed"], field=field)


@register_source("mixture", summary="several sources interleaved by weight")
def _mixture(values, field) -> TaskSource:
  built = [build_source(s, field=f"{field}.sources[{i}]")
           for i, s in enumerate(values["sources"])]
  weights = values["weights"]
  if weights is None:
    weights = [1.0] * len(built)
  elif len(weights) != len(built):  # the declaration checks each; the count is the sources'
    raise ConfigError(f"config.{field}.weights={list(weights)!r}: one positive number per "
                      f"source ({len(built)})")
  return MixtureSource(built, weights, field=field)


@register_source("agent", summary="the tasks of the run's agent (config.agent.entry with "
                 "examples(): a hub taskset); training only", needs=("agent_examples",))
def _agent(values, field, *, agent_examples) -> TaskSource:
  if agent_examples is None:  # the held-out set, or a run without an agent entry
    raise ConfigError(
        f"config.{field}.kind='agent': only the training data of an agent run (config.agent."
        "entry) can be its agent's tasks; the held-out evaluation scores single-turn "
        "completions with config.rewards, so give data.eval a task source they can score"
        if field.endswith("eval") else
        f"config.{field}.kind='agent': the tasks come from the agent of config.agent.entry, and "
        "none is set; set it or choose another kind")
  return AgentTasksSource(agent_examples(), shuffle=values["shuffle"], seed=values["seed"],
                          field=field)


# ----------------------------------------------------------------------------- streams


def normalize_prompt(prompt: str) -> str:
  """The prompt with runs of whitespace collapsed and ends stripped: the key of overlap checks."""
  return " ".join(prompt.split())


def held_out_prompts(examples: Iterable[Example]) -> frozenset[str]:
  """Normalised prompts of held-out examples, for `PromptStream(..., exclude=...)`."""
  return frozenset(normalize_prompt(e.prompt) for e in examples)


class PromptStream:
  """Walks a source from `position`, skipping examples whose prompt is held out.

  `position` is the next index to read; it is all the state there is, so a stream rebuilt with a
  checkpointed position yields exactly what the original would have.
  """

  def __init__(self, source: TaskSource, *, position: int = 0,
               exclude: Iterable[str] = (), max_consecutive_skips: int = 10_000):
    self.source = source
    self.position = _check_index(position)
    self.exclude = frozenset(normalize_prompt(p) for p in exclude)
    self.max_consecutive_skips = max_consecutive_skips

  def take(self, count: int) -> list[tuple[int, Example]]:
    """The next `count` (data position, example) pairs not held out; advances `position`.

    Raises:
      ConfigError: `max_consecutive_skips` examples in a row were held out, i.e. the training
        source (nearly) repeats the evaluation set.
    """
    taken, skipped = [], 0
    while len(taken) < count:
      index = self.position
      example = self.source.example(index)
      self.position += 1
      if normalize_prompt(example.prompt) in self.exclude:
        skipped += 1
        if skipped >= self.max_consecutive_skips:
          raise ConfigError(
              f"config.data.train: {skipped} consecutive examples from position "
              f"{index - skipped + 1} all appear in the held-out set; the training source "
              "repeats config.data.eval — give it other seeds or settings")
        continue
      skipped = 0
      taken.append((index, example))
    return taken
