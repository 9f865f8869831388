"""The settings of the pluggable choices a config gives as a dict, declared like the sections of
`config_schema`: each reward-part kind's (at config.rewards.<name>), each task source kind's (at
config.data.train / data.eval) and each environment's (at config.environment.settings).
`Group.resolve` fills in their defaults and checks every value for the modules that implement
them (`verifiers.rewards`, `verifiers.judge`, `verifiers.reward_model_part`, `data.tasks`,
`environments/*`), which hold no defaults or type checks of their own; `launch/train.py --help`
and docs/config.md list them after the sections (`config_help`).

JAX-free, like the schema: the verifiers read their plain choice lists from here; the few names
of a table that lives with its implementation are copies, each kept equal to it by a test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from reasoning_rl.config_fields import (COUNT, FRACTION, POSITIVE, REQUIRED, Field, ManyOf, OneOf,
                                        Range, Satisfies, Shown, Text, checked, int_range)
from reasoning_rl.config_schema import DTYPES
from reasoning_rl.errors import ConfigError
from reasoning_rl.plain_data import plain


@dataclasses.dataclass(frozen=True)
class Group:
  """The settings of one pluggable choice, which a config gives as a dict: a reward part of kind
  `choice` (at config.rewards.<name>), a task source of kind `choice` (at config.data.train /
  data.eval) or the environment `choice` (at config.environment.settings).
  Declared with `Field`s like a section; `resolve` fills in the defaults and checks every value
  against its declaration, so the implementing module holds no defaults or type checks of its
  own."""

  path: str  # where the dict sits: "rewards.<name>" | "data.<train|eval>" | "environment.settings"
  choice: str  # the reward-part kind / task source kind / environment name
  doc: str
  fields: tuple[Field, ...]

  @property
  def qualifier(self) -> str:
    """Which choice the settings belong to, as --help and docs/config.md head them."""
    selector = "environment.name" if self.path.startswith("environment.") else "kind"
    return f"({selector} = {self.choice})"

  @property
  def title(self) -> str:
    return f"{self.path} {self.qualifier}"

  def names(self) -> tuple[str, ...]:
    return tuple(item.name for item in self.fields)

  def defaults(self) -> dict[str, Any]:
    return {item.name: item.default for item in self.fields}

  def resolve(self, given: Any, *, field: str, floats: bool = False) -> dict[str, Any]:
    """`given` (a mapping; None = empty) with every default filled in and every value checked:
    a ConfigError names config.<field>.<setting> and what it accepts.

    field: where `given` sits, e.g. "rewards.format" or "environment.settings".
    floats: an integer given for a real-valued setting is read as a float (environments hold
    their settings as attributes of that type).
    """
    given = {} if given is None else plain(given)
    if not isinstance(given, Mapping):
      raise ConfigError(f"config.{field}={given!r}: must be a mapping of setting name -> value")
    names = self.names()
    unknown = sorted(set(given) - set(names), key=str)
    if unknown:
      owner = (f"a {self.choice!r} reward part" if self.path.startswith("rewards.")
               else f"task source kind {self.choice!r}" if self.path.startswith("data.")
               else f"environment {self.choice!r}")
      raise ConfigError(f"config.{field}.{unknown[0]}: not a setting of {owner}; its settings "
                        f"are {sorted(names)}")
    return {item.name: checked(f"{field}.{item.name}", item, given.get(item.name, item.default),
                               floats=floats)
            for item in self.fields}


# The names the settings below choose from. The plain lists are declared here and the verifiers
# read them from here (math_answers.EXTRACT_MODES, logic.USE_EACH_MODES, judge.MODES,
# reward_model_part.TRANSFORMS); the names of a table that lives with its implementation (scripts,
# judge templates, sandbox isolations, judgeable statuses) are copied, since that module imports
# more than this one may, and a test keeps each copy equal to its table.
EXTRACT_MODES = ("answer_or_boxed", "answer", "boxed", "last_number", "final_answer")  # math_answers
USE_EACH_MODES = ("exactly_once", "at_most_once")  # verifiers.logic
SCRIPTS = ("latin", "cjk", "han", "kana", "hangul", "cyrillic", "greek", "arabic", "hebrew",
           "devanagari", "thai")  # verifiers.format.SCRIPT_NAME_PREFIXES
LENGTH_METHODS = ("dapo", "kimi", "lcpo", "lcpo_max")  # verifiers.rewards
CODE_ISOLATIONS = ("namespaces", "rlimits_only")  # the code sandbox's
JUDGE_MODES = ("fallback", "alone")  # verifiers.judge.MODES
JUDGEABLE_STATUSES = ("wrong", "no_answer", "multiple_answers", "hedged", "unevaluated",
                      "unparseable", "too_large", "timeout")  # verifiers.judge: never "correct"
JUDGE_TEMPLATES = ("yes_no", "score")  # verifiers.judge.TEMPLATES
REWARD_MODEL_TRANSFORMS = ("none", "sigmoid")  # verifiers.reward_model_part.TRANSFORMS

TAG_NAME = Text(r"[A-Za-z][A-Za-z0-9_\-]*", "a tag name: a letter, then letters, digits, '_' or '-' "
            "(e.g. 'think')")
IDENTIFIER = Text(r"[A-Za-z_][A-Za-z0-9_]*", "an identifier (e.g. 'correct')")
SECONDS = POSITIVE


def _model_path(what: str) -> Text:
  return Text(r"(?s).+", f"{what} (required)")


# Every reward part has these two besides its kind's settings (rewards.build_parts reads them).
PART_WEIGHT = Field("weight", REQUIRED, "its weight in the total reward: Σ weight · value",
                    Range(float), kind=float)
PART_KIND = Field("kind", Shown("(the part's name)"), "which kind of part (a name of "
                  "registry.REWARD_PARTS); two parts of one kind need distinct names and a kind",
                  OneOf(registry="REWARD_PARTS"))

REWARD_PARTS: dict[str, Group] = {group.choice: group for group in (
    Group("rewards.<name>", "correct", "1 if the answer is right, by the named verifier; at "
          "most one part of this kind.", (
        Field("verifier", "math", "math | countdown | reasoning_gym | code | auto (routes by "
              "task kind)", OneOf(registry="VERIFIERS")),
        Field("extract", "answer_or_boxed", "where the answer is read (none: countdown / "
              "reasoning_gym read the whole answer span's text as is; not for math)",
              OneOf(EXTRACT_MODES + ("none",))),
        Field("timeout_s", 5.0, "seconds one check may take (math-verify, code tests)", SECONDS),
        Field("answer_tag", "answer", "the tag the answer is written in", TAG_NAME),
        Field("think_tag", "think", "math: the reasoning tag, whose content never answers "
              "(must differ from answer_tag)", TAG_NAME),
        Field("use_each", "exactly_once", "countdown: how often each given number may be used",
              OneOf(USE_EACH_MODES)),
        Field("allow_unary_minus", False, "countdown: accept -x in the expression"),
        Field("success_threshold", 1.0, "reasoning_gym: the dataset's score at or above which "
              "the answer counts as right", FRACTION),
        Field("partial_credit", False, "code: the share of tests passed instead of "
              "all-or-nothing"),
        Field("code_isolation", "namespaces", "code: the sandbox's isolation; rlimits_only is an "
              "explicit, logged acceptance of weaker isolation", OneOf(CODE_ISOLATIONS)),
    )),
    Group("rewards.<name>", "format", "1 if the completion has the "
          "<think>…</think><answer>…</answer> shape (DeepSeek-R1 2025).", (
        Field("think_tag", "think", "the reasoning tag (must differ from answer_tag)", TAG_NAME),
        Field("answer_tag", "answer", "the answer tag", TAG_NAME),
        Field("require_nonempty_think", True, "the reasoning span must hold text"),
        Field("require_nonempty_answer", True, "the answer span must hold text"),
        Field("think_open_in_prompt", False, "the prompt already opened the reasoning tag"),
        Field("pattern", None, "a regular expression the whole completion must match instead "
              "of the tag shape (None = the tag shape)", kind=str),
    )),
    Group("rewards.<name>", "language", "Share of the reasoning written in one script "
          "(DeepSeek-R1 2025, language consistency).", (
        Field("script", "latin", "the script the reasoning should be written in",
              OneOf(SCRIPTS)),
        Field("think_tag", "think", "the reasoning tag", TAG_NAME),
        Field("think_open_in_prompt", False, "the prompt already opened the reasoning tag"),
    )),
    Group("rewards.<name>", "length", "Length shaping: dapo (overlong penalty, DAPO 2025), kimi "
          "(Kimi k1.5 2025, per group), lcpo / lcpo_max (L1, Aggarwal & Welleck 2025); kimi and "
          "lcpo_max need a correct part.", (
        Field("method", "dapo", "the shaping", OneOf(LENGTH_METHODS)),
        Field("cache_len", None, "dapo: L_cache, the soft zone before the limit, in tokens "
              "(required by dapo)", Range(int, 1, none_ok=True), kind=int),
        Field("max_len", None, "dapo: L_max in tokens (None = the record's max_new_tokens)",
              Range(int, 1, none_ok=True), kind=int),
        Field("alpha", 3e-4, "lcpo / lcpo_max: penalty per token off the target", Range(float)),
        Field("delta", 0.5, "lcpo_max: the reward's floor", Range(float)),
        Field("target_tokens", None, "lcpo / lcpo_max: the length target (None = the record's "
              "metadata target_tokens)", Range(int, 1, none_ok=True), kind=int),
    )),
    Group("rewards.<name>", "environment", "A part of a multi-turn episode's outcome as its "
          "environment reported it (environment.name).", (
        Field("part", "correct", "the outcome part read", IDENTIFIER),
    )),
    Group("rewards.<name>", "judge", "An LLM judge's verdict on the final answer "
          "(reasoning_rl/verifiers/judge.py), alone or where the math verifier cannot read it; "
          "model-scored on the main process.", (
        Field("model", "", "the judge model: an HF directory, .gguf or run workdir, as "
              "model.path", _model_path("a model path (HF dir, .gguf or run workdir), as "
                                        "config.model.path")),
        Field("dtype", "float32", "the judge's compute dtype", OneOf(DTYPES)),
        Field("mode", "fallback", "fallback: the judge decides only where the rule verifier's "
              "status is in fallback_statuses; alone: every answer is judged", OneOf(JUDGE_MODES)),
        Field("fallback_statuses", ("no_answer", "unparseable", "unevaluated", "timeout"),
              "fallback: the rule verifier's statuses the judge decides (correct is never "
              "overruled)", ManyOf(JUDGEABLE_STATUSES)),
        Field("template", "yes_no", "yes_no (Yes / No: 1 / 0) | score (an integer 0-10, / 10)",
              OneOf(JUDGE_TEMPLATES)),
        Field("max_new_tokens", 8, "the judge's decode budget", COUNT),
        Field("max_prompt_tokens", 512, "the judge engine's prefill length (longer prompts keep "
              "their last tokens)", COUNT),
        Field("batch_size", 16, "the judge engine's decode slots", COUNT),
        Field("cache_size", 4096, "verdicts kept (least recently used out)",
              int_range(0, meaning="0 = no cache")),
        Field("extract", "answer_or_boxed", "how the answer is read, as the correct part's",
              OneOf(EXTRACT_MODES)),
        Field("answer_tag", "answer", "the answer tag", TAG_NAME),
        Field("think_tag", "think", "the reasoning tag (must differ from answer_tag)", TAG_NAME),
        Field("timeout_s", 5.0, "seconds the rule verifier may take", SECONDS),
    )),
    Group("rewards.<name>", "reward_model", "A Hugging Face Llama / Qwen2 "
          "*ForSequenceClassification checkpoint's score of (prompt, completion) "
          "(reasoning_rl/verifiers/reward_model_part.py); model-scored on the main process.", (
        Field("model", "", "the checkpoint directory (local)", _model_path(
            "the directory of a Hugging Face LlamaForSequenceClassification or "
            "Qwen2ForSequenceClassification checkpoint")),
        Field("dtype", "float32", "compute dtype", OneOf(DTYPES)),
        Field("label", 0, "which output of the head is the reward", int_range(0)),
        Field("transform", "none", "none (the raw score) | sigmoid",
              OneOf(REWARD_MODEL_TRANSFORMS)),
        Field("max_tokens", 2048, "longest scored sequence (a longer one keeps its last tokens)",
              COUNT),
        Field("batch_size", 16, "rows per forward", COUNT),
    )),
)}

ENVIRONMENTS: dict[str, Group] = {group.choice: group for group in (
    Group("environment.settings", "calculator", "Exact arithmetic after '=' "
          "(reasoning_rl/environments/calculator.py).", (
        Field("max_calls", 8, "calculator calls per episode", int_range(1, 256)),
    )),
    Group("environment.settings", "guess_number", "Find a secret integer from higher / lower "
          "answers (reasoning_rl/environments/guess_number.py).", (
        Field("max_guesses", 10, "guesses per episode", int_range(1, 1000)),
    )),
    Group("environment.settings", "python_tool", "<python> blocks run in the code sandbox; the "
          "task's verifier judges the final turn (reasoning_rl/environments/python_tool.py).", (
        Field("max_calls", 4, "programs run per episode", int_range(1, 64)),
        Field("timeout_s", 5.0, "wall deadline of one program", Range(float, 0, 60,
                                                                      low_open=True)),
        Field("observation_max_chars", 1024, "characters of output shown", int_range(16, 65536)),
        Field("memory_mb", 1024, "memory of all the program's processes together",
              int_range(128, 65536)),
        Field("keep_state", False, "every earlier cell runs again first (one interpreter's "
              "state)"),
        Field("isolation", "namespaces", "the sandbox's isolation", OneOf(CODE_ISOLATIONS)),
        Field("verifier", "math", "the correct verifier of the final turn (not code)",
              OneOf(registry="VERIFIERS")),
        Field("extract", "final_answer", "where the verifier reads the answer",
              OneOf(EXTRACT_MODES + ("none",))),
        Field("answer_tag", "answer", "the answer tag", TAG_NAME),
        Field("verify_timeout_s", 5.0, "seconds the verifier may take",
              Range(float, 0, 60, low_open=True)),
    )),
)}

SYNTHETIC_OPS = ("+", "-", "*")  # data.tasks reads them from here


def _operators(value) -> bool:
  """A non-empty string or list of operators of SYNTHETIC_OPS ('+-' or ('+', '-'))."""
  return (isinstance(value, (str, list, tuple)) and len(value) > 0
          and all(isinstance(op, str) and op in SYNTHETIC_OPS for op in value))


def _source_list(value) -> bool:
  return isinstance(value, (list, tuple)) and len(value) > 0


def _weights(value) -> bool:
  """None, or positive finite numbers (one per source: the mixture checks the count)."""
  return value is None or (isinstance(value, (list, tuple)) and all(
      isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w < float("inf")
      for w in value))


_SEED = Field("seed", 0, "the source's seed (which examples, in which order)", int_range(0))
_SOURCE_PATH = "data.<train|eval>"

TASK_SOURCES: dict[str, Group] = {group.choice: group for group in (
    Group(_SOURCE_PATH, "synthetic_arithmetic", "'a op b=' with single operands, generated (no "
          "dependency; the debug task; reasoning_rl/data/tasks.py).", (
        _SEED,
        Field("max_operand", 9, "the largest operand", int_range(0)),
        Field("ops", "+", "the operators drawn from",
              Satisfies(_operators, "a non-empty string or list of operators from + - * "
                        "(e.g. '+-')")),
    )),
    Group(_SOURCE_PATH, "reasoning_gym", "Any reasoning-gym dataset by name, with its own "
          "checker.", (
        Field("name", REQUIRED, "the dataset, e.g. 'basic_arithmetic'",
              Text(r"(?s).+", "a reasoning-gym dataset name"), kind=str),
        _SEED,
        Field("size", 1000, "examples per epoch", COUNT),
        Field("params", {}, "the dataset's own options",
              Satisfies(lambda value: isinstance(value, dict), "a dict of the dataset's options")),
    )),
    Group(_SOURCE_PATH, "jsonl", "Rows of {prompt|question, answer, tests, task} from a JSONL "
          "file.", (
        Field("path", REQUIRED, "a local or gs:// file",
              Text(r"(?s).+", "the path of a JSONL file"), kind=str),
        Field("shuffle", False, "a new order each epoch"),
        Field("seed", 0, "the shuffle's seed", int_range(0)),
    )),
    Group(_SOURCE_PATH, "mixture", "Several sources interleaved by weight.", (
        Field("sources", REQUIRED, "the sources, each a dict with its kind and settings",
              Satisfies(_source_list, "a non-empty list of source configs"), kind=list),
        Field("weights", None, "one positive number per source (None = equal weights)",
              Satisfies(_weights, "a list of positive numbers, one per source, or None"),
              kind=list),
    )),
    Group(_SOURCE_PATH, "agent", "The tasks the run's agent brings: examples() of the agent "
          "config.agent.entry loads (a hub taskset, docs/agent_hubs.md); training data only.", (
        Field("shuffle", False, "a new order each epoch"),
        Field("seed", 0, "the shuffle's seed", int_range(0)),
    )),
    Group(_SOURCE_PATH, "guess_number", "A secret integer in [low, high] (the guess_number "
          "environment's task; reasoning_rl/environments/guess_number.py).", (
        _SEED,
        Field("low", 1, "the smallest secret", int_range()),
        Field("high", 100, "the largest secret (above low)", int_range()),
    )),
)}

# Every Group, in the order --help and docs/config.md list them.
GROUPS: tuple[Group, ...] = (tuple(REWARD_PARTS.values()) + tuple(TASK_SOURCES.values())
                             + tuple(ENVIRONMENTS.values()))
