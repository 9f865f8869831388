"""A generative verifier: an LLM judge asked whether a completion's final answer matches the
reference, as a reward part (`kind="judge"`).

LLM-as-a-judge follows Zheng et al. 2023 ("Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena",
arXiv:2306.05685); a verifier that *generates* its verdict (the next-token "Yes"/"No" read as the
reward) follows Zhang et al. 2024 ("Generative Verifiers: Reward Modeling as Next-Token
Prediction", arXiv:2408.15240). Here the judge reads only (question, reference answer, the
candidate's extracted final answer), not the reasoning, and decodes greedily on our own
`sampler.Engine`.

Settings of a `judge` part (`config.rewards.<name>`; declared with their defaults and accepted values
in `config_groups.REWARD_PARTS["judge"]`, which also checks them):
  model: the judge model, any path `reasoning_rl.run_checkpoint.load_model` reads (HF dir,
    .gguf, run workdir), as `config.model.path`. Required.
  dtype: the judge's compute dtype ("float32" | "bfloat16").
  mode: "fallback" (default) | "alone".
    alone: every record with an extracted answer is judged; value = the judge's verdict. Answers
      the rule reader refuses on purpose (`REFUSED_STATUSES`: hedged, multiple_answers,
      too_large) score 0.0 without a call: shown to the judge, a hedge would be a second shot.
    fallback: the rule-based math verifier (`math_answers.check` with this part's extract /
      answer_tag / timeout_s) decides first; when its status is in `fallback_statuses` (by
      default unparseable, unevaluated, timeout: it could not read the answer) the judge decides,
      otherwise the value is the rule verdict (1.0 for "correct", else 0.0). Refusals on purpose
      (hedged, multiple_answers, too_large) stay refused unless listed; "correct" is never
      overruled.
    What the judge sees as the answer: the rule verifier's candidates (joined by " ; "), else the
    raw text of the last answer span (`answer_tag`; e.g. "forty-two", which the rule verifier
    reads as no answer). A record with neither is 0.0 without a judge call (`no_answer`).
  fallback_statuses: the `MathResult.status` values that go to the judge in fallback mode
    (default: no_answer, unparseable, unevaluated, timeout).
  template: "yes_no" (the judge answers Yes/No; parsed 1.0/0.0) | "score" (the judge writes an
    integer 0–10; parsed and divided by 10). The parser is the template's
    (`judge_verdicts.parse_yes_no` / `parse_score`: negations, refusals, hedges, echoes of the
    question and hypothetical scores never read as a verdict for the student).
  max_new_tokens: the judge's decode budget (a verdict needs a few tokens).
  max_prompt_tokens: the judge engine's prefill length; longer prompts keep their last tokens.
  batch_size: the judge engine's decode slots.
  cache_size: most (question, reference, extracted answer) verdicts kept (least recently used out).
  extract, answer_tag, think_tag, timeout_s: how the answer is read, as in the `correct` part
    (math).

A judge output the parser cannot read scores 0.0 and is counted (`unparseable`). The part is
scored on the main process by `workers.model_parts.ModelPartsScorer` (a model cannot run in the
verifier worker processes), in one batch over a step's outstanding groups. The judge model is
colocated: its engine sits on the devices given to it (the sampler's by default, else the default
device); a separate judge slice is not implemented.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from reasoning_rl import config_groups
from reasoning_rl.errors import ConfigError
from reasoning_rl.verifiers import format as format_lib
from reasoning_rl.verifiers import math_answers as math_lib
from reasoning_rl.verifiers.judge_verdicts import parse_score, parse_yes_no

JUDGE_VERSION = "judge-3"
MODES = config_groups.JUDGE_MODES  # declared with the setting that names them
STATUSES = ("correct", "wrong", "no_answer", "multiple_answers", "hedged", "unevaluated",
            "unparseable", "too_large", "timeout")
JUDGEABLE_STATUSES = tuple(s for s in STATUSES if s != "correct")
# Answers the rule reader refuses on purpose: a hedge ("maybe 42"), several candidates, an absurd
# number. Shown to a judge they would become a second shot ("42"), so alone mode never asks.
REFUSED_STATUSES = ("hedged", "multiple_answers", "too_large")
MAX_QUESTION_CHARS = 2000
MAX_ANSWER_CHARS = 300

TEMPLATES = {
    "yes_no": (
        "You are grading a math answer. Decide whether the student's final answer is "
        "mathematically equivalent to the reference answer. Ignore formatting differences.\n\n"
        "Question: {question}\nReference answer: {reference}\nStudent's final answer: {answer}\n\n"
        "Is the student's answer correct? Reply with one word: Yes or No."),
    "score": (
        "You are grading a math answer. Rate how well the student's final answer matches the "
        "reference answer, from 0 (wrong) to 10 (equivalent). Ignore formatting differences.\n\n"
        "Question: {question}\nReference answer: {reference}\nStudent's final answer: {answer}\n\n"
        "Reply with one integer from 0 to 10."),
}

PARSERS: dict[str, Callable[[str], float | None]] = {"yes_no": parse_yes_no, "score": parse_score}


def render_prompt(template: str, question: str, reference: str, answer: str) -> str:
  """The judge's user message (over-long fields are cut: question first, answer at its end)."""
  if len(question) > MAX_QUESTION_CHARS:
    question = question[:MAX_QUESTION_CHARS] + " …"
  if len(answer) > MAX_ANSWER_CHARS:
    answer = "… " + answer[-MAX_ANSWER_CHARS:]
  return (TEMPLATES[template].replace("{question}", question.strip() or "(not given)")
          .replace("{reference}", reference.strip()).replace("{answer}", answer.strip()))


def version(s: Mapping[str, Any]) -> str:
  """The judge's version: this module's, and the rule verifier's in fallback mode (every setting,
  the model path included, also goes into the `verifier_version` hash)."""
  if s["mode"] == "fallback":
    return f"{JUDGE_VERSION}+{math_lib.MATH_VERIFIER_VERSION}"
  return JUDGE_VERSION


class VerdictCache:
  """Least-recently-used verdicts keyed by (question, reference, extracted answer)."""

  def __init__(self, size: int):
    self.size = size
    self._data: collections.OrderedDict[tuple[str, str, str], float] = collections.OrderedDict()

  def get(self, key: tuple[str, str, str]) -> float | None:
    if key not in self._data:
      return None
    self._data.move_to_end(key)
    return self._data[key]

  def put(self, key: tuple[str, str, str], value: float) -> None:
    if self.size <= 0:
      return
    self._data[key] = value
    self._data.move_to_end(key)
    while len(self._data) > self.size:
      self._data.popitem(last=False)

  def __len__(self) -> int:
    return len(self._data)


class EngineJudge:
  """prompts (user messages) -> the judge model's greedy replies, decoded on our `Engine`.

  The chat template wraps each message when the tokenizer has one (instruct models); else the
  message is encoded plainly.
  """

  def __init__(self, model, tokenizer, *, max_new_tokens: int, max_prompt_tokens: int = 512,
               batch_size: int = 16, mesh=None):
    # JAX only for a judge with a model: the scorer's worker processes load this module too
    from reasoning_rl.sampler import EngineSpec, make_engine

    self.tokenizer = tokenizer
    self.max_new_tokens = max_new_tokens
    self.engine = make_engine(model, EngineSpec(
        max_concurrent_decodes=batch_size, max_prefill_length=max_prompt_tokens,
        max_decode_length=max_new_tokens, steps_per_call=max_new_tokens, truncation="left"),
        mesh=mesh)

  @classmethod
  def load(cls, settings: Mapping[str, Any], *, mesh=None) -> "EngineJudge":
    from reasoning_rl.run_checkpoint import load_model  # JAX: as __init__

    model, tokenizer = load_model(settings["model"], dtype=settings["dtype"], mesh=mesh)
    if tokenizer is None:
      raise ConfigError(f"judge model {settings['model']}: has no tokenizer files")
    return cls(model, tokenizer, max_new_tokens=settings["max_new_tokens"],
               max_prompt_tokens=settings["max_prompt_tokens"],
               batch_size=settings["batch_size"], mesh=mesh)

  def encode(self, message: str) -> list[int]:
    if self.tokenizer.chat_template is not None:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                add_generation_prompt=True)
      return self.tokenizer.encode(text, add_special_tokens=False)
    return self.tokenizer.encode(message)

  def __call__(self, messages: Sequence[str]) -> list[str]:
    # JAX: as __init__
    from reasoning_rl.sampler.rollout import generate_groups
    from reasoning_rl.sampler.sampling import SamplingParams

    if not messages:
      return []
    completions = generate_groups(
        self.engine, [self.encode(m) for m in messages], num_samples=1,
        sampling=SamplingParams(temperature=0.0), max_new_tokens=self.max_new_tokens,
        stop_ids=self.tokenizer.eos_ids)
    return [self.tokenizer.decode(c.completion_ids, skip_special_tokens=True)
            for c in completions]


@dataclasses.dataclass
class JudgeCounters:
  """Cumulative telemetry of one judge part."""

  records: int = 0  # records scored
  rule_decided: int = 0  # fallback mode: the rule verdict stood
  no_answer: int = 0  # nothing to judge: 0.0 without a call
  cache_hits: int = 0
  calls: int = 0  # judge generations (one per distinct uncached item)
  unparseable: int = 0  # judge outputs the parser could not read (scored 0.0)
  seconds: float = 0.0  # wall time of score_batch (rule checks and decoding)


class JudgePart:
  """Scores one `judge` part over a batch of records (the `model_parts` seam's `score_batch`).

  `generate`: judge messages -> replies (an `EngineJudge`, or any callable: tests pass a fake).
  """

  def __init__(self, settings: Mapping[str, Any], generate: Callable[[Sequence[str]], list[str]]):
    self.settings = dict(settings)
    self.generate = generate
    self.parse = PARSERS[self.settings["template"]]
    self.cache = VerdictCache(self.settings["cache_size"])
    self.counters = JudgeCounters()

  def rule_check(self, record) -> math_lib.MathResult:
    s = self.settings
    return math_lib.check(record.response, record.ground_truth, extract=s["extract"],
                          timeout_s=s["timeout_s"], answer_tag=s["answer_tag"],
                          think_tag=s["think_tag"])

  def answer_text(self, record, result: math_lib.MathResult) -> str:
    """What the judge is shown as the answer (module docstring); "" when there is nothing."""
    if result.candidates:
      return " ; ".join(result.candidates)
    outside = format_lib.outside_tag(record.response, self.settings["think_tag"])
    spans = format_lib.tag_contents(outside, self.settings["answer_tag"])
    return spans[-1].strip() if spans else ""

  def score_batch(self, records: Sequence[Any], rule_results: Sequence[Any] = ()) -> list[float]:
    """One value per record (`rule_results`, the records' rule-based rewards, are not read: the
    fallback's rule verdict is this part's own `math_answers.check`, which also extracts the
    answer the judge sees)."""
    del rule_results
    start = time.perf_counter()
    s, c = self.settings, self.counters
    values: list[float | None] = [None] * len(records)
    pending: dict[tuple[str, str, str], list[int]] = {}
    for i, record in enumerate(records):
      c.records += 1
      result = self.rule_check(record)
      if s["mode"] == "fallback" and result.status not in s["fallback_statuses"]:
        c.rule_decided += 1
        values[i] = 1.0 if result.status == "correct" else 0.0
        continue
      if s["mode"] == "alone" and result.status in REFUSED_STATUSES:
        c.rule_decided += 1
        values[i] = 0.0
        continue
      answer = self.answer_text(record, result)
      if not answer:
        c.no_answer += 1
        values[i] = 0.0
        continue
      key = (record.prompt, record.ground_truth, answer)
      cached = self.cache.get(key)
      if cached is not None:
        c.cache_hits += 1
        values[i] = cached
      else:
        pending.setdefault(key, []).append(i)
    if pending:
      keys = list(pending)
      replies = self.generate([render_prompt(s["template"], *key) for key in keys])
      c.calls += len(keys)
      for key, reply in zip(keys, replies):
        verdict = self.parse(reply)
        if verdict is None:
          c.unparseable += 1
          verdict = 0.0
        self.cache.put(key, verdict)
        for i in pending[key]:
          values[i] = verdict
      c.cache_hits += sum(len(v) - 1 for v in pending.values())  # repeats within the batch
    c.seconds += time.perf_counter() - start
    return [float(v) for v in values]

  def metrics(self) -> dict[str, float]:
    return {k: float(v) for k, v in dataclasses.asdict(self.counters).items()}
