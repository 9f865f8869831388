"""Reward composition: a reward is a weighted sum of named parts, configured with ml_collections.

Example (`config.rewards`):

    rewards = ml_collections.ConfigDict({
        "correct": {"weight": 1.0, "verifier": "math"},
        "format": {"weight": 0.1},
        "length": {"weight": 1.0, "method": "dapo", "cache_len": 256},
    })

Each entry is a part; its `kind` defaults to its name (`correct`, `format`, `language`, `length`), so
two parts of one kind need distinct names and an explicit `kind`. `parts` of a `Reward` hold the
*unweighted* value of every part (so each is logged on its own); `total` = Σ weight · value.

Settings (all optional except `weight`; each kind's are declared, with their defaults and accepted
values, in `config_groups.REWARD_PARTS`, and listed by `--help` and docs/config.md):
  correct:  verifier (a name of `registries.VERIFIERS`: math | countdown | reasoning_gym | code |
            auto, which routes by task kind), extract, timeout_s, answer_tag, think_tag (math:
            the reasoning tag, whose content never answers), use_each, allow_unary_minus
            (countdown), success_threshold (reasoning_gym), partial_credit (code: passed/total
            instead of all-or-nothing), code_isolation (namespaces | rlimits_only: an explicit,
            logged acceptance of weaker isolation).
  format:   think_tag, answer_tag, require_nonempty_think, require_nonempty_answer,
            think_open_in_prompt, pattern.
  language: script, think_tag, think_open_in_prompt.
  length:   method (dapo | kimi | lcpo | lcpo_max), cache_len, max_len (default: the record's
            max_new_tokens), alpha, delta, target_tokens (default: record.metadata["target_tokens"]).
  judge:    an LLM judge (model-scored; `reasoning_rl.verifiers.judge`): model, dtype, mode
            (fallback | alone), fallback_statuses, template (yes_no | score), max_new_tokens,
            max_prompt_tokens, batch_size, cache_size, extract, answer_tag, think_tag, timeout_s.
  reward_model: a Hugging Face Llama / Qwen2 *ForSequenceClassification checkpoint's score of
            (prompt, completion) (model-scored; `reasoning_rl.verifiers.reward_model_part`):
            model, dtype, label, transform (none | sigmoid), max_tokens, batch_size.

Model-scored parts (a `PartKind` with `make_scorer`, e.g. `judge`) need a model, so they are not
scored here: `RewardFunction.score_group` skips them (their names are absent from `parts` and they
add nothing to `total`), and `workers.model_parts.ModelPartsScorer` fills them in on the main
process and recomputes the totals.

`verifier_version` is derived from every part's name, kind, weight, resolved settings and the
version constants of the verifiers (and of math-verify / reasoning-gym), so any change shows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reasoning_rl import config_fields, config_groups, registries
from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.plain_data import plain
from reasoning_rl.verifiers import code_tests as code_lib
from reasoning_rl.verifiers import format as format_lib
from reasoning_rl.verifiers import judge as judge_lib
from reasoning_rl.verifiers import length as length_lib
from reasoning_rl.verifiers import logic as logic_lib
from reasoning_rl.verifiers import math_answers as math_lib
from reasoning_rl.verifiers import reward_model_part as reward_model_lib

CODE_VERIFIER_VERSION = "code-2"
CODE_TASKS = ("code", "humaneval", "mbpp")
ENVIRONMENT_PART_VERSION = "environment-1"


@dataclasses.dataclass
class CompletionRecord:
  """What a reward is computed from.

  Attributes:
    response: the completion text.
    ground_truth: the reference answer (math, reasoning-gym).
    task: task name (routes `verifier="auto"`: countdown, code/humaneval/mbpp, else by metadata).
    num_tokens: completion length in tokens.
    truncated: generation hit `max_new_tokens` without finishing.
    max_new_tokens: the generation limit (DAPO's L_max unless `length.max_len` is set).
    prompt: the prompt text (reasoning-gym `question`).
    tests: code tests (assert statements) for code tasks.
    metadata: task metadata: countdown `numbers`/`target`, reasoning-gym entry metadata
      (`source_dataset`, …), LCPO `target_tokens`.
    environment_parts: a multi-turn episode's outcome as its environment reported it
      (`sampler.multiturn`; e.g. {"correct": 1.0}); read by `environment` reward parts.
  """

  response: str
  ground_truth: str = ""
  task: str = "math"
  num_tokens: int = 0
  truncated: bool = False
  max_new_tokens: int | None = None
  prompt: str = ""
  tests: Sequence[str] = ()
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  environment_parts: Mapping[str, float] = dataclasses.field(default_factory=dict)

  @classmethod
  def coerce(cls, record: CompletionRecord | Mapping[str, Any]) -> CompletionRecord:
    """Accepts a record or a mapping (`completion` and `answer` are aliases of `response` and
    `ground_truth`, as in rollout rows and task files)."""
    if isinstance(record, cls):
      return record
    if not isinstance(record, Mapping):
      raise VerifierError(f"completion record must be a CompletionRecord or a mapping, got "
                          f"{type(record).__name__}")
    data = dict(record)
    if "response" not in data and "completion" in data:
      data["response"] = data.pop("completion")
    if "ground_truth" not in data and "answer" in data:
      data["ground_truth"] = data.pop("answer")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Reward:
  """A scalar reward, its unweighted parts, and the version of the verifiers that produced it."""

  total: float
  parts: dict[str, float]
  verifier_version: str


@dataclasses.dataclass(frozen=True)
class Part:
  """One configured reward part (picklable: plain data, behaviour in module functions)."""

  name: str
  kind: str
  weight: float
  settings: Mapping[str, Any]

  @property
  def behaviour(self) -> "PartKind":
    return registries.REWARD_PARTS.get(self.kind).impl

  @property
  def group_level(self) -> bool:
    return self.behaviour.group_level(self.settings)

  @property
  def needs_correctness(self) -> bool:
    return self.behaviour.needs_correctness(self.settings)

  @property
  def version(self) -> str:
    return self.behaviour.version(self.settings)

  @property
  def model_scored(self) -> bool:
    """Scored by a model on the main process (`workers.model_parts`), not by `RewardFunction`."""
    return self.behaviour.make_scorer is not None


@dataclasses.dataclass(frozen=True)
class PartKind:
  """What a kind of reward part does, as registered in `registries.REWARD_PARTS`.

  settings: every setting the kind accepts, declared in the schema (`config_groups.Group`: default,
    meaning, accepted values); a config names only `weight` and what differs.
  check(field, settings): what the declarations cannot say (one setting against another);
    raises ConfigError naming `config.<field>.<setting>`.
  score(records, settings, correct) -> one value per record of a group; `correct` holds the
    group's `correct` part values (None without one), for parts that depend on correctness.
  version(settings) -> the verifier version string that goes into `verifier_version`.
  group_level(settings): the part needs the whole group at once (scored per group).
  needs_correctness(settings): the part reads `correct`, so a `correct` part must exist.
  make_scorer(settings, mesh) -> an object with `score_batch(records, rule_rewards) -> list[float]`
    (and optionally `metrics() -> dict`): set only for model-scored parts, which
    `RewardFunction` skips and `workers.model_parts.ModelPartsScorer` scores (its docstring holds
    the contract); `score` is then never called.
  """

  settings: config_groups.Group
  score: Callable[..., list[float]]
  version: Callable[[Mapping[str, Any]], str]
  check: Callable[[str, dict[str, Any]], None] = lambda field, settings: None
  group_level: Callable[[Mapping[str, Any]], bool] = lambda settings: False
  needs_correctness: Callable[[Mapping[str, Any]], bool] = lambda settings: False
  make_scorer: Callable[..., Any] | None = None


def build_parts(rewards_config: Any) -> list[Part]:
  """Validates `rewards_config` and resolves every part's settings (defaults filled in)."""
  spec = plain(rewards_config)
  if not isinstance(spec, Mapping) or not spec:
    raise ConfigError("rewards must be a non-empty mapping of part name -> {weight: …, …}, e.g. "
                      "{'correct': {'weight': 1.0, 'verifier': 'math'}}")
  parts = []
  for name, part_spec in spec.items():
    field = f"rewards.{name}"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
      raise ConfigError(f"{field}: part names must be identifiers")
    if not isinstance(part_spec, Mapping):
      raise ConfigError(f"{field} must be a mapping such as {{'weight': 1.0}}, got {part_spec!r}")
    part_spec = dict(part_spec)
    kind = part_spec.pop("kind", name)
    if kind not in registries.REWARD_PARTS:
      raise ConfigError(f"config.{field}.kind={kind!r}: unknown reward part; use one of "
                        f"{list(registries.REWARD_PARTS.names())} (or set 'kind' for a part named "
                        "otherwise)")
    behaviour = registries.REWARD_PARTS.get(kind).impl
    weight = config_fields.checked(f"{field}.weight", config_groups.PART_WEIGHT,
                                   part_spec.pop("weight", config_fields.REQUIRED))
    settings = behaviour.settings.resolve(part_spec, field=field)
    behaviour.check(field, settings)
    parts.append(Part(name, kind, float(weight), settings))
  if sum(p.kind == "correct" for p in parts) > 1:
    raise ConfigError("rewards: at most one part of kind 'correct' is allowed")
  if any(p.needs_correctness for p in parts) and not any(p.kind == "correct" for p in parts):
    raise ConfigError("rewards: a length part with method kimi or lcpo_max needs a 'correct' part")
  return parts


# The checks below are what the schema's declarations cannot say: one setting against another,
# or a value the schema has no type for (a regular expression that must compile).


def _check_correct(field: str, s: dict[str, Any]) -> None:
  if s["verifier"] == "math" and s["extract"] == "none":
    raise ConfigError(f"config.{field}.extract='none': only countdown / reasoning_gym read no "
                      f"extraction; math reads one of {math_lib.EXTRACT_MODES}")
  check_tags_differ(field, s)


def check_tags_differ(field: str, s: Mapping[str, Any]) -> None:
  """The reasoning tag's content never answers, so it cannot also be the answer tag."""
  if s["think_tag"] == s["answer_tag"]:
    raise ConfigError(f"config.{field}.think_tag={s['think_tag']!r}: is also the answer_tag; the "
                      "reasoning tag (whose content never answers) and the answer tag must differ")


def _check_format(field: str, s: dict[str, Any]) -> None:
  check_tags_differ(field, s)
  if s["pattern"] is not None:
    try:
      re.compile(s["pattern"])
    except re.error as error:
      raise ConfigError(f"config.{field}.pattern={s['pattern']!r}: not a valid regular "
                        f"expression ({error})") from None


def _check_length(field: str, s: dict[str, Any]) -> None:
  if s["method"] == "dapo" and s["cache_len"] is None:
    raise ConfigError(f"config.{field}.cache_len=None: DAPO needs a positive L_cache in tokens "
                      "(e.g. 256)")


def _format_kwargs(s: Mapping[str, Any]) -> dict[str, Any]:
  return {k: s[k] for k in ("think_tag", "answer_tag", "require_nonempty_think",
                            "require_nonempty_answer", "think_open_in_prompt", "pattern")}


def verifier_version(parts: Sequence[Part]) -> str:
  """A stable, readable id of the configured reward: part:version list + hash of everything."""
  canonical = [[p.name, p.kind, p.weight, p.version, sorted(p.settings.items())]
               for p in sorted(parts, key=lambda p: p.name)]
  digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, default=repr).encode()).hexdigest()
  readable = ",".join(f"{p.name}={p.version}" for p in sorted(parts, key=lambda p: p.name))
  return f"{readable}#{digest[:12]}"


# ------------------------------------------------------------------------------------- part scoring


@dataclasses.dataclass(frozen=True)
class Verifier:
  """What a `correct` verifier is, as registered in `registries.VERIFIERS`.

  score(record, settings) -> 1.0 / 0.0, or a share in [0, 1] (code with partial_credit).
  version: its version string (it goes into `verifier_version`, so a change shows in replay).
  tasks: the task kinds (`CompletionRecord.task`) that `verifier="auto"` sends here.
  claims(record): whether `verifier="auto"` sends a record of another task kind here, from what it
    carries (code tests, reasoning-gym metadata); asked in registration order after `tasks`.
  """

  score: Callable[[CompletionRecord, Mapping[str, Any]], float]
  version: str
  tasks: tuple[str, ...] = ()
  claims: Callable[[CompletionRecord], bool] = lambda record: False


# `verifier="auto"` sends what no verifier's tasks or claims take to math.
_AUTO_FALLBACK = "math"


def _route(record: CompletionRecord) -> str:
  """The verifier `verifier="auto"` uses: the one whose task kinds hold the record's, else the
  first that claims it, else math."""
  choices = [registries.VERIFIERS.get(name) for name in registries.VERIFIERS.names()
             if name != "auto"]
  for choice in choices:
    if record.task in choice.impl.tasks:
      return choice.name
  for choice in choices:
    if choice.impl.claims(record):
      return choice.name
  return _AUTO_FALLBACK


def _metadata_field(record: CompletionRecord, key: str) -> Any:
  if key not in record.metadata:
    raise VerifierError(f"task {record.task!r}: completion record has no metadata[{key!r}]; the "
                        "task source must pass it through")
  return record.metadata[key]


def _code_answer(response: str, answer_tag: str) -> str:
  spans = format_lib.tag_contents(response, answer_tag)
  text = spans[-1] if spans else response
  blocks = re.findall(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", text, re.DOTALL)
  return blocks[-1] if blocks else text


def _score_math(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  extract = "answer_or_boxed" if s["extract"] == "none" else s["extract"]  # via verifier=auto
  return float(math_lib.is_correct(record.response, record.ground_truth, extract=extract,
                                    timeout_s=s["timeout_s"], answer_tag=s["answer_tag"],
                                    think_tag=s["think_tag"]))


def _logic_extract(s: Mapping[str, Any]) -> str:
  return "none" if s["extract"] == "none" else "answer"


def _score_countdown(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  return float(logic_lib.countdown_correct(
      record.response, _metadata_field(record, "numbers"), _metadata_field(record, "target"),
      extract=_logic_extract(s), use_each=s["use_each"], allow_unary_minus=s["allow_unary_minus"],
      answer_tag=s["answer_tag"]))


def _score_reasoning_gym(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  entry = {"question": record.prompt, "answer": record.ground_truth,
           "metadata": dict(record.metadata)}
  return logic_lib.reasoning_gym_score(record.response, entry, extract=_logic_extract(s),
                                       success_threshold=s["success_threshold"],
                                       answer_tag=s["answer_tag"])


def _score_code(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  """The test harness over the sandbox (reasoning_rl.verifiers.code_tests)."""
  if not record.tests:
    raise VerifierError(f"task {record.task!r}: code record has no tests")
  result = code_lib.run_tests(_code_answer(record.response, s["answer_tag"]), list(record.tests),
                              timeout_s=s["timeout_s"], isolation=s["code_isolation"])
  if result.total <= 0:
    return 0.0
  if s["partial_credit"]:
    return result.passed / result.total
  return float(result.passed == result.total and result.status == "passed")


def _score_auto(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  return registries.VERIFIERS.get(_route(record)).impl.score(record, s)


registries.VERIFIERS.add("math", Verifier(_score_math, math_lib.MATH_VERIFIER_VERSION),
                         summary="math-verify equivalence of the extracted answer and the ground "
                         "truth", options=("extract", "timeout_s", "answer_tag", "think_tag"))
registries.VERIFIERS.add(
    "countdown", Verifier(_score_countdown, logic_lib.COUNTDOWN_VERIFIER_VERSION,
                          tasks=("countdown",)),
    summary="the expression uses the given numbers and evaluates to the target (TinyZero)",
    options=("extract", "use_each", "allow_unary_minus", "answer_tag"))
registries.VERIFIERS.add(
    "reasoning_gym", Verifier(_score_reasoning_gym, logic_lib.REASONING_GYM_VERIFIER_VERSION,
                              claims=lambda record: "source_dataset" in record.metadata),
    summary="the reasoning-gym dataset's own score_answer (Stojanovski et al. 2025)",
    options=("extract", "success_threshold", "answer_tag"))
registries.VERIFIERS.add(
    "code", Verifier(_score_code, CODE_VERIFIER_VERSION, tasks=CODE_TASKS,
                     claims=lambda record: bool(record.tests)),
    summary="the record's tests run against the program in the sandbox",
    options=("timeout_s", "answer_tag", "partial_credit", "code_isolation"))


def _auto_version() -> str:
  return "+".join(registries.VERIFIERS.get(name).impl.version
                  for name in registries.VERIFIERS.names() if name != "auto")


# registered last: its version names every verifier it can route to
registries.VERIFIERS.add(
    "auto", Verifier(_score_auto, ""),
    summary="routes by task kind (countdown, code / humaneval / mbpp), then by what the record "
    "carries (tests, reasoning-gym metadata), else math")


def score_correct(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  """The `correct` part: its verifier's score (1.0 / 0.0, or a pass share for code with
  partial_credit)."""
  return registries.VERIFIERS.get(s["verifier"]).impl.score(record, s)


def score_format(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  return float(format_lib.format_ok(record.response, format_lib.FormatSpec(**_format_kwargs(s))))


def score_language(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  return format_lib.language_consistency(record.response, s["script"], think_tag=s["think_tag"],
                                         think_open_in_prompt=s["think_open_in_prompt"])


def score_length(record: CompletionRecord, s: Mapping[str, Any], correct: float | None) -> float:
  """Per-record length methods (dapo, lcpo, lcpo_max); kimi is scored per group."""
  method = s["method"]
  if method == "dapo":
    max_len = s["max_len"] if s["max_len"] is not None else record.max_new_tokens
    if max_len is None:
      raise VerifierError("length (dapo): set rewards.<part>.max_len or pass max_new_tokens in "
                          "the completion record")
    return length_lib.dapo_overlong_penalty(record.num_tokens, max_len=int(max_len),
                                            cache_len=s["cache_len"], truncated=record.truncated)
  target = s["target_tokens"]
  if target is None:
    target = _metadata_field(record, "target_tokens")
  if method == "lcpo":
    return length_lib.lcpo_exact_penalty(record.num_tokens, int(target), alpha=s["alpha"])
  return length_lib.lcpo_max_reward(bool(correct is not None and correct >= 1.0), record.num_tokens,
                                    int(target), alpha=s["alpha"], delta=s["delta"])


def _correct_version(s: Mapping[str, Any]) -> str:
  return (_auto_version() if s["verifier"] == "auto"
          else registries.VERIFIERS.get(s["verifier"]).impl.version)


def _score_length_group(records, s, correct) -> list[float]:
  if s["method"] == "kimi":  # relative to the group's shortest and longest
    return length_lib.kimi_length_rewards([r.num_tokens for r in records],
                                          [c >= 1.0 for c in correct])
  return [score_length(r, s, c) for r, c in zip(records, correct)]


registries.REWARD_PARTS.add(
    "correct", PartKind(config_groups.REWARD_PARTS["correct"],
                        lambda records, s, correct: [score_correct(r, s) for r in records],
                        _correct_version, check=_check_correct),
    summary="1 if the answer is right (math-verify / countdown / reasoning-gym / code tests), "
    "else 0", options=config_groups.REWARD_PARTS["correct"].names())
registries.REWARD_PARTS.add(
    "format", PartKind(config_groups.REWARD_PARTS["format"],
                       lambda records, s, correct: [score_format(r, s) for r in records],
                       lambda s: format_lib.FORMAT_VERIFIER_VERSION, check=_check_format),
    summary="1 if the completion has the <think>…</think><answer>…</answer> shape "
    "(DeepSeek-R1 2025)", options=config_groups.REWARD_PARTS["format"].names())
registries.REWARD_PARTS.add(
    "language", PartKind(config_groups.REWARD_PARTS["language"],
                         lambda records, s, correct: [score_language(r, s) for r in records],
                         lambda s: format_lib.LANGUAGE_VERIFIER_VERSION),
    summary="share of the reasoning written in one script (DeepSeek-R1 2025, language "
    "consistency)", options=config_groups.REWARD_PARTS["language"].names())
registries.REWARD_PARTS.add(
    "length", PartKind(config_groups.REWARD_PARTS["length"], _score_length_group,
                       lambda s: length_lib.LENGTH_VERIFIER_VERSION, check=_check_length,
                       group_level=lambda s: s["method"] == "kimi",
                       needs_correctness=lambda s: s["method"] in ("kimi", "lcpo_max")),
    summary="length shaping: dapo (overlong penalty), kimi, lcpo, lcpo_max (module docstring)",
    options=config_groups.REWARD_PARTS["length"].names())


def score_environment(record: CompletionRecord, s: Mapping[str, Any]) -> float:
  """The value the episode's environment gave its outcome part `part` (a multi-turn run only)."""
  if s["part"] not in record.environment_parts:
    raise VerifierError(
        f"environment reward part {s['part']!r}: the episode's outcome has "
        f"{sorted(record.environment_parts) or 'no parts (not a multi-turn episode)'}; set "
        "rewards.<name>.part to one of them, or set environment.name")
  return float(record.environment_parts[s["part"]])


registries.REWARD_PARTS.add(
    "environment", PartKind(config_groups.REWARD_PARTS["environment"],
                            lambda records, s, correct: [score_environment(r, s)
                                                         for r in records],
                            lambda s: ENVIRONMENT_PART_VERSION),
    summary="a part of a multi-turn episode's outcome as its environment reported it "
    "(environment.name)", options=config_groups.REWARD_PARTS["environment"].names())


def _model_scored(records, s, correct) -> list[float]:
  raise VerifierError("a model-scored reward part (e.g. judge) is scored on the main process by "
                      "workers.model_parts.ModelPartsScorer (build.build_scorer), not here")


def _make_judge(settings: Mapping[str, Any], mesh=None):
  return judge_lib.JudgePart(settings, judge_lib.EngineJudge.load(settings, mesh=mesh))


registries.REWARD_PARTS.add(
    "judge", PartKind(config_groups.REWARD_PARTS["judge"], _model_scored, judge_lib.version,
                      check=check_tags_differ, make_scorer=_make_judge),
    summary="an LLM judge's verdict on the final answer (alone, or where the math verifier "
    "cannot read it); model-scored on the main process",
    options=config_groups.REWARD_PARTS["judge"].names())

registries.REWARD_PARTS.add(
    "reward_model", PartKind(config_groups.REWARD_PARTS["reward_model"], _model_scored,
                             reward_model_lib.version,
                             make_scorer=reward_model_lib.RewardModelPart.load),
    summary="a Hugging Face Llama / Qwen2 *ForSequenceClassification reward model's score of "
    "(prompt, completion); model-scored on the main process",
    options=config_groups.REWARD_PARTS["reward_model"].names())


class RewardFunction:
  """Computes `Reward`s for completion records according to a `rewards` config.

  Picklable (it holds only plain data), so it can be shipped to verifier worker processes.
  Model-scored parts (`model_parts`) are skipped: see the module docstring.
  """

  def __init__(self, rewards_config: Any):
    self.parts = build_parts(rewards_config)
    self.verifier_version = verifier_version(self.parts)

  @property
  def model_parts(self) -> list[Part]:
    """The parts a model scores (`workers.model_parts`); absent from `score_group`'s rewards."""
    return [p for p in self.parts if p.model_scored]

  @property
  def rule_parts(self) -> list[Part]:
    return [p for p in self.parts if not p.model_scored]

  @property
  def needs_group(self) -> bool:
    """True when a part (Kimi length reward) can only be computed over a whole group."""
    return any(p.group_level for p in self.parts)

  def __call__(self, record: CompletionRecord | Mapping[str, Any]) -> Reward:
    if self.needs_group:
      names = [p.name for p in self.parts if p.group_level]
      raise VerifierError(f"reward parts {names} need the whole group of completions; call "
                          "RewardFunction.score_group(records)")
    return self.score_group([record])[0]

  def score_group(self, records: Sequence[CompletionRecord | Mapping[str, Any]]) -> list[Reward]:
    """Rewards for the completions of one prompt (group-level parts see all of them)."""
    records = [CompletionRecord.coerce(r) for r in records]
    correct_part = next((p for p in self.parts if p.kind == "correct"), None)
    correct = [score_correct(r, correct_part.settings) if correct_part else None for r in records]
    values: dict[str, list[float]] = {}
    rule_parts = self.rule_parts
    for part in rule_parts:
      if part.kind == "correct":  # scored once above: other parts may depend on it
        values[part.name] = [float(c) for c in correct]
      else:
        values[part.name] = part.behaviour.score(records, part.settings, correct)
    rewards = []
    for i in range(len(records)):
      parts = {p.name: float(values[p.name][i]) for p in rule_parts}
      total = sum(p.weight * parts[p.name] for p in rule_parts)
      rewards.append(Reward(total=float(total), parts=parts,
                            verifier_version=self.verifier_version))
    return rewards
