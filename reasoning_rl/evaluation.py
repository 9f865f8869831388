"""Held-out evaluation: pass@k, majority vote (maj@k), greedy accuracy, canaries.

- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
  Models Trained on Code", §2.1): with n samples of which c are correct,
  pass@k = E[1 − C(n−c, k) / C(n, k)], computed as the product 1 − Π_{i=n−c+1}^{n} (1 − k/i), which
  never forms the huge binomials.
- maj@k (self-consistency, Wang et al. 2023, "Self-Consistency Improves Chain of Thought Reasoning
  in Language Models"): the answer most of the first k samples agree on is the prediction; maj@k is
  1 when that answer is correct. Answers are compared after `normalise_answer` (see there); the
  winner's correctness is the verifier's judgement of the first sample that gave it.
- Accuracy (`accuracy`): the mean over examples of (correct samples / samples), i.e. the unbiased
  pass@1. With `num_samples=1` and temperature 0 it is greedy accuracy.

A sample is *correct* when its reward part of kind `correct` is >= 1.0 (all tests pass for code).
`format_rate` is the mean of the reward part of kind `format` when there is one, else the share of
completions `verifiers.format.format_ok` accepts with its default (R1-Zero `<think>`/`<answer>`)
spec; `answer_rate` is the share from which the `correct` part's extraction finds an answer.

The result of an evaluation (`EvalResult`) is a plain JSON-able dict; `write_eval_result` stores it
as `workdir/eval/step_XXXXXXXX.json` and `read_eval_results` reads them back (the format
`reasoning_rl.report` and the guards consume):

    step, num_examples, num_samples, temperature, max_new_tokens, verifier_version,
    accuracy, pass@<k> (k = 1, 2, 4, … <= num_samples, and num_samples), maj@<k> (same ks, k > 1),
    reward/mean, reward/<part> (unweighted part means), response_length/mean (tokens),
    truncated_frac, format_rate, answer_rate, per_task {task: {num_examples, accuracy}},
    examples [{uid, task, answer, num_correct, majority_answer}],
    canaries [{uid, prompt, completions: [{text, num_tokens, truncated}]}],
    variants [{instruction, accuracy, reward/mean, …}] (the trainer, with eval.instruction_variants:
      the same examples under reworded instructions; `headline` lists the keys kept)
"""

from __future__ import annotations

import dataclasses
import fractions
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from reasoning_rl import storage
from reasoning_rl.metrics import to_json_value
from reasoning_rl.errors import VerifierError
from reasoning_rl.verifiers import format as format_lib
from reasoning_rl.verifiers import math_answers as math_lib
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction
from reasoning_rl.workers.model_parts import with_model_parts
from reasoning_rl.workers.scorer import InlineScorer, Scorer

EvalResult = dict[str, Any]
EVAL_DIR = "eval"
_EVAL_NAME = re.compile(r"^step_(\d{8})\.json$")


# ------------------------------------------------------------------------------------------ pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of Chen et al. 2021 from n samples with c correct: 1 − C(n−c, k) / C(n, k).

  Computed as 1 − Π_{i=n−c+1}^{n} (1 − k / i) (their numerically stable form).

  Raises:
    ValueError: unless 0 <= c <= n and 1 <= k <= n (integers).
  """
  for name, value in (("n", n), ("c", c), ("k", k)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"pass_at_k: {name}={value!r} must be an integer")
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k: c={c} correct samples must be in [0, n={n}]")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}] (draw at most the samples you have)")
  if n - c < k:
    return 1.0  # every draw of k contains a correct sample
  product = 1.0
  for i in range(n - c + 1, n + 1):
    product *= 1.0 - k / i
  return 1.0 - product


def default_ks(num_samples: int) -> list[int]:
  """1, 2, 4, … up to num_samples, plus num_samples itself."""
  ks = [1 << e for e in range(num_samples.bit_length()) if 1 << e <= num_samples]
  return sorted(set(ks + [num_samples]))


# ---------------------------------------------------------------------------------- majority vote

_FRAC = re.compile(r"^\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}$")
_SLASH = re.compile(r"^([+-]?\d+)/([+-]?\d+)$")
_DECIMAL = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"^([+-]?\d{1,3})((?:,\d{3})+)(\.\d+)?$")
_LATEX_SPACES = re.compile(r"\\[,;:! ]|~|\u2009|\u202f|\s")


def normalise_answer(answer: str) -> str:
  """A canonical string for voting: equal strings are one vote bucket.

  Steps: strip surrounding whitespace, `$…$` / `\\(…\\)` wrappers and a final period; remove every
  space and LaTeX spacing command; drop thousands separators (`1,234` → `1234`); write numbers as
  exact fractions in lowest terms (`3.50` → `7/2`, `4.0` → `4`, `\\frac{6}{4}` → `3/2`, `-0` → `0`).
  Other answers are compared as the remaining text, case-sensitively.

  math-verify's equivalence (e.g. `0.5` vs `\\frac12` vs `50\\%`) is not used for bucketing: it
  needs a pairwise check between buckets (quadratic in the distinct answers, each check up to the
  verifier timeout); exact-number canonicalisation covers the common numeric cases cheaply.
  """
  text = answer.strip()
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
      text = text[len(left):len(text) - len(right)].strip()
  text = _LATEX_SPACES.sub("", text.rstrip(".").strip())
  thousands = _THOUSANDS.match(text)
  if thousands:
    text = thousands.group(1) + thousands.group(2).replace(",", "") + (thousands.group(3) or "")
  value = None
  for pattern in (_FRAC, _SLASH):
    match = pattern.match(text)
    if match and int(match.group(2)) != 0:
      value = fractions.Fraction(int(match.group(1)), int(match.group(2)))
  if value is None and _DECIMAL.match(text):
    value = fractions.Fraction(text)
  return str(value) if value is not None else text


def extract_answer(response: str, *, extract: str = "answer_or_boxed",
                   answer_tag: str = "answer") -> str | None:
  """The value of a response's final answer (last `<answer>` span, `\\boxed{}` or stated answer,
  as `extract` reads it; a chain `17 + 25 = 42` gives its last link), or None."""
  candidates = math_lib.extract_candidates(response, extract, answer_tag)
  return math_lib.answer_value(candidates[-1]) if candidates else None


def majority_vote(answers: Sequence[str | None]) -> str | None:
  """The normalised answer given most often; None answers do not vote; None if nobody voted.

  Ties are broken by first appearance: among the most frequent answers, the one whose first vote
  comes earliest in `answers` wins (deterministic, independent of hashing).
  """
  return _vote(answers)[0]


def _vote(answers: Sequence[str | None]) -> tuple[str | None, int | None]:
  """(winning normalised answer, index of its first vote)."""
  counts: dict[str, int] = {}
  first: dict[str, int] = {}
  for index, answer in enumerate(answers):
    if answer is None:
      continue
    key = normalise_answer(answer)
    counts[key] = counts.get(key, 0) + 1
    first.setdefault(key, index)
  if not counts:
    return None, None
  winner = min(counts, key=lambda key: (-counts[key], first[key]))
  return winner, first[winner]


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
  """1.0 if the majority answer of the first k samples is correct, else 0.0.

  Args:
    answers: each sample's extracted answer (None: it gave none).
    correct: each sample's verdict; the winning answer's verdict is that of its first vote.
    k: how many samples vote (the first k).
  """
  if len(answers) != len(correct):
    raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} verdicts")
  if not 1 <= k <= len(answers):
    raise ValueError(f"maj_at_k: k={k} must be in [1, {len(answers)}]")
  _, index = _vote(answers[:k])
  return float(index is not None and bool(correct[index]))


# ------------------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class GeneratedText:
  """One generated completion as evaluation sees it."""

  text: str
  num_tokens: int
  truncated: bool = False
  environment_parts: dict[str, float] | None = None  # a multi-turn episode's outcome
  turns: int | None = None  # a multi-turn episode's model turns


def _generated_json(generated: GeneratedText) -> dict[str, Any]:
  """A GeneratedText as JSON, the episode fields only where it is an episode."""
  return {key: value for key, value in dataclasses.asdict(generated).items()
          if value is not None or key not in ("environment_parts", "turns")}


def _as_generated(item: GeneratedText | Mapping[str, Any] | str, where: str) -> GeneratedText:
  if isinstance(item, GeneratedText):
    return item
  if isinstance(item, Mapping) and "text" in item:
    return GeneratedText(str(item["text"]), int(item.get("num_tokens", 0)),
                         bool(item.get("truncated", False)))
  raise ValueError(f"{where}: expected a GeneratedText or a mapping with 'text', 'num_tokens', "
                   f"'truncated'; got {type(item).__name__}")


def completion_record(example, text: str, *, num_tokens: int, truncated: bool,
                      max_new_tokens: int | None,
                      environment_parts: Mapping[str, float] | None = None) -> CompletionRecord:
  """What a verifier sees of one completion of `example` (a task example or a canary prompt);
  training (`loop.rollouts`) and evaluation build their records here, so both score alike.
  `environment_parts`: a multi-turn episode's outcome, read by `environment` reward parts."""
  return CompletionRecord(
      environment_parts=dict(environment_parts or {}),
      response=text, ground_truth=str(getattr(example, "answer", "") or ""),
      task=getattr(example, "task", "math") or "math", num_tokens=num_tokens,
      truncated=bool(truncated), max_new_tokens=max_new_tokens,
      prompt=getattr(example, "prompt", ""), tests=tuple(getattr(example, "tests", ()) or ()),
      metadata=dict(getattr(example, "metadata", {}) or {}))


def _as_scorer(scorer):
  """A `workers.scorer.Scorer`; a bare RewardFunction is scored inline (its model-scored parts,
  e.g. a judge, load their models on every such call: pass a built scorer instead)."""

  return scorer if isinstance(scorer, Scorer) else with_model_parts(InlineScorer(scorer))


def _correct_part(reward_fn: RewardFunction):
  """The part that says whether a sample is right: the `correct` verifier part, else (an
  environment that judges its own episodes) an `environment` part reading its `correct` outcome."""
  part = next((p for p in reward_fn.parts if p.kind == "correct"), None) or next(
      (p for p in reward_fn.parts if p.kind == "environment" and p.settings["part"] == "correct"),
      None)
  if part is None:
    raise VerifierError("evaluation needs a reward part of kind 'correct' (config.rewards."
                        "correct = {'weight': …, 'verifier': …}) to decide which samples are right")
  return part


def _mean(values: Sequence[float]) -> float:
  return float(sum(values) / len(values)) if values else math.nan


def evaluate_completions(examples: Sequence[Any],
                         completions_by_example: Sequence[Sequence[GeneratedText]],
                         scorer, *, max_new_tokens: int | None = None,
                         temperature: float | None = None, ks: Sequence[int] | None = None,
                         canaries: Sequence[Any] = (),
                         canary_completions: Sequence[Sequence[GeneratedText]] = ()) -> EvalResult:
  """Scores every example's completions and aggregates them (module docstring lists the keys).

  Args:
    examples: objects with `.answer`, `.task`, `.prompt`, `.metadata`, `.tests`, `.uid`.
    completions_by_example: for each example, its n samples (same n for all examples).
    scorer: a `workers.scorer.Scorer` (or a RewardFunction, scored inline) of the run's rewards;
      its `correct` part decides correctness. A group it cannot score (timeout / error) counts
      as wrong and is counted in `verifier/timeouts` / `verifier/errors`.
    max_new_tokens: the generation budget (for length rewards and the record).
    temperature: recorded in the result.
    ks: the k of pass@k / maj@k (default `default_ks(n)`).
    canaries: prompts whose completions are reported verbatim and not scored.
    canary_completions: their completions, aligned with `canaries`.
  """
  if len(examples) != len(completions_by_example):
    raise ValueError(f"evaluate_completions: {len(examples)} examples but "
                     f"{len(completions_by_example)} completion lists")
  if not examples:
    raise ValueError("evaluate_completions: no examples to evaluate; check the eval data source")
  if len(canaries) != len(canary_completions):
    raise ValueError(f"evaluate_completions: {len(canaries)} canaries but "
                     f"{len(canary_completions)} canary completion lists")
  counts = {len(c) for c in completions_by_example}
  if len(counts) != 1 or 0 in counts:
    raise ValueError(f"evaluate_completions: every example needs the same number (>= 1) of "
                     f"completions, got {sorted(counts)}")
  n = counts.pop()
  ks = default_ks(n) if ks is None else sorted(set(int(k) for k in ks))
  if not all(1 <= k <= n for k in ks):
    raise ValueError(f"evaluate_completions: ks={ks} must lie in [1, {n}] (samples per example)")
  scorer = _as_scorer(scorer)
  reward_fn = scorer.reward_fn
  correct_part = _correct_part(reward_fn)
  generated_by_example = [[_as_generated(s, f"completions_by_example[{index}]") for s in samples]
                          for index, samples in enumerate(completions_by_example)]
  scored = scorer.score(
      (index, [completion_record(example, g.text, num_tokens=g.num_tokens, truncated=g.truncated,
                                 max_new_tokens=max_new_tokens,
                                 environment_parts=g.environment_parts) for g in generated])
      for index, (example, generated) in enumerate(zip(examples, generated_by_example)))
  format_part = next((p for p in reward_fn.parts if p.kind == "format"), None)
  extract = correct_part.settings.get("extract", "answer_or_boxed")
  extract = "answer_or_boxed" if extract == "none" else extract
  answer_tag = correct_part.settings.get("answer_tag", "answer")

  pass_sums = {k: 0.0 for k in ks}
  maj_sums = {k: 0.0 for k in ks if k > 1}
  totals, lengths, truncated, formats, answered = [], [], [], [], []
  part_values: dict[str, list[float]] = {p.name: [] for p in reward_fn.parts}
  per_task: dict[str, list[float]] = {}
  rows = []
  for index, (example, generated) in enumerate(zip(examples, generated_by_example)):
    rewards = scored[index].rewards
    verdicts = [r.parts[correct_part.name] >= 1.0 for r in rewards]
    answers = [extract_answer(g.text, extract=extract, answer_tag=answer_tag) for g in generated]
    num_correct = sum(verdicts)
    for k in ks:
      pass_sums[k] += pass_at_k(n, num_correct, k)
    for k in maj_sums:
      maj_sums[k] += maj_at_k(answers, verdicts, k)
    for g, reward, answer in zip(generated, rewards, answers):
      totals.append(reward.total)
      for name, value in reward.parts.items():
        part_values[name].append(value)
      lengths.append(g.num_tokens)
      truncated.append(float(g.truncated))
      answered.append(float(answer is not None))
      formats.append(reward.parts[format_part.name] if format_part else
                     float(format_lib.format_ok(g.text)))
    task = getattr(example, "task", "math") or "math"
    per_task.setdefault(task, []).append(num_correct / n)
    rows.append({"uid": str(getattr(example, "uid", index)), "task": task,
                 "answer": str(getattr(example, "answer", "")), "num_correct": num_correct,
                 "majority_answer": majority_vote(answers)})

  num_examples = len(examples)
  result: EvalResult = {
      "num_examples": num_examples, "num_samples": n, "temperature": temperature,
      "max_new_tokens": max_new_tokens, "verifier_version": reward_fn.verifier_version,
      "accuracy": _mean([row["num_correct"] / n for row in rows]),
  }
  result.update({f"pass@{k}": pass_sums[k] / num_examples for k in ks})
  result.update({f"maj@{k}": maj_sums[k] / num_examples for k in maj_sums})
  result["reward/mean"] = _mean(totals)
  result.update({f"reward/{name}": _mean(values) for name, values in part_values.items()})
  result["response_length/mean"] = _mean(lengths)
  result["truncated_frac"] = _mean(truncated)
  result["format_rate"] = _mean(formats)
  result["answer_rate"] = _mean(answered)
  episode_turns = [g.turns for generated in generated_by_example for g in generated
                   if g.turns is not None]
  if episode_turns:  # multi-turn episodes: model turns per episode
    result["turns/mean"] = _mean(episode_turns)
  result["verifier/timeouts"] = sum(item.status == "timeout" for item in scored.values())
  result["verifier/errors"] = sum(item.status == "error" for item in scored.values())
  result["per_task"] = {task: {"num_examples": len(values), "accuracy": _mean(values)}
                        for task, values in sorted(per_task.items())}
  result["examples"] = rows
  result["canaries"] = [
      {"uid": str(getattr(canary, "uid", f"canary-{i}")), "prompt": getattr(canary, "prompt", ""),
       "completions": [_generated_json(_as_generated(g, f"canary_completions[{i}]"))
                       for g in generated]}
      for i, (canary, generated) in enumerate(zip(canaries, canary_completions))]
  return result


@dataclasses.dataclass(frozen=True)
class CanaryPrompt:
  """A prompt given as plain text (no answer): generated and shown, never scored."""

  prompt: str
  uid: str
  answer: str = ""
  task: str = "canary"
  tests: tuple = ()
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def run_evaluation(backend, tokenizer, template, examples: Sequence[Any], scorer, *, num_samples: int = 1, temperature: float = 0.0,
                   top_p: float = 1.0, max_new_tokens: int, stop_strings: Sequence[str] = (),
                   seed: int = 0, ks: Sequence[int] | None = None,
                   canaries: Sequence[Any] = (), share=None,
                   should_stop=None, episodes=None) -> EvalResult | None:
  """Generates `num_samples` completions per example (and per canary) and evaluates them.

  Args:
    backend: the `sampler.api.RolloutBackend` holding the weights to evaluate (asked for
      completions `for_training=False`: nothing trains on their log-probs); with `episodes`, a
      `sampler.api.MultiTurnEpisodes`.
    tokenizer: decodes completions (`decode(ids, skip_special_tokens=True)`); its `eos_ids` stop
      generation.
    template: `.encode(example) -> list[int]` (the prompt as the policy sees it in training).
    examples: held-out examples (see `evaluate_completions`).
    scorer: scores the completions (see `evaluate_completions`).
    num_samples, temperature, top_p, max_new_tokens, stop_strings, seed: sampling (0 = greedy).
      Example i is prompt id i; canary j is prompt id len(examples) + j, so a completion depends
      only on (seed, its position, the weights).
    ks: pass@k / maj@k sizes (default `default_ks(num_samples)`).
    canaries: examples or plain strings whose completions are returned verbatim in `canaries`.
    share: a `multihost.data_parallel.Share` when the processes of a run split the work: this
      process generates for its share of the prompts, the completions meet on every process, and
      process 0 scores them and returns the result (the others return None). The result equals
      a single process's.
    should_stop: asked between decode calls; True raises `errors.PhaseInterrupted` (a run's
      preemption during an evaluation).
    episodes: a `sampler.multiturn.EpisodeSettings`: the examples are played as multi-turn
      episodes, as in training (`max_new_tokens` bounds a whole episode), scored on their final
      model turn and outcome; the result adds `turns/mean`. Canaries are single completions
      (they have no task for an environment).
  """
  # Imported here so that scoring-only users (replay, report) do not load JAX.
  from reasoning_rl.sampler.sampling import SamplingParams  # pylint: disable=import-outside-toplevel

  canaries = [CanaryPrompt(prompt=c, uid=f"canary-{i}") if isinstance(c, str) else c
              for i, c in enumerate(canaries)]
  everything = list(examples) + canaries
  mine = list(range(len(everything))) if share is None else share.mine(range(len(everything)))
  common = dict(num_samples=num_samples,
                sampling=SamplingParams(temperature=temperature, top_p=top_p),
                max_new_tokens=max_new_tokens, stop_ids=tuple(tokenizer.eos_ids),
                tokenizer=tokenizer, seed=seed, should_stop=should_stop)
  single = mine if episodes is None else [i for i in mine if i >= len(examples)]
  completions = list(backend.generate(
      [list(template.encode(everything[i])) for i in single], prompt_ids=single,
      stop_strings=tuple(stop_strings), for_training=False, **common)) if single else []
  played = [i for i in mine if i not in set(single)]
  if played:
    completions += backend.generate_episodes(
        [list(template.encode(everything[i])) for i in played], prompt_ids=played,
        examples=[everything[i] for i in played], episodes=episodes, **common)
  by_prompt: dict[int, list[GeneratedText]] = {i: [] for i in mine}
  for completion in sorted(completions, key=lambda c: (c.prompt_id, c.sample_index)):
    by_prompt[completion.prompt_id].append(GeneratedText(
        text=completion.scored_text(tokenizer), num_tokens=completion.num_model_tokens,
        truncated=bool(completion.truncated), environment_parts=completion.reward_parts,
        turns=len(completion.turns) if completion.turns is not None else None))
  if share is not None and share.count > 1:
    merged = share.merge("evaluation", {i: [dataclasses.asdict(g) for g in texts]
                                        for i, texts in by_prompt.items()})
    if not share.is_primary:
      return None
    by_prompt = {i: [GeneratedText(**g) for g in texts] for i, texts in merged.items()}
  generated = [by_prompt[i] for i in range(len(everything))]
  return evaluate_completions(
      examples, generated[:len(examples)], scorer, max_new_tokens=max_new_tokens,
      temperature=temperature, ks=ks, canaries=canaries,
      canary_completions=generated[len(examples):])


HEADLINE_KEYS = ("accuracy", "reward/mean", "response_length/mean", "truncated_frac",
                 "answer_rate", "format_rate")


def headline(result: EvalResult) -> dict[str, Any]:
  """The few numbers of a result that are kept for each reworded variant of the held-out set."""
  out = {key: result[key] for key in HEADLINE_KEYS}
  out.update({key: value for key, value in result.items() if key.startswith(("pass@", "maj@"))})
  return out


# --------------------------------------------------------------------------------------- storage


def eval_path(workdir: str | os.PathLike[str], step: int):
  return storage.path(workdir) / EVAL_DIR / f"step_{int(step):08d}.json"


def write_eval_result(workdir: str | os.PathLike[str], step: int, result: EvalResult):
  """Writes `result` (plus its `step`) to workdir/eval/step_XXXXXXXX.json atomically."""

  path = eval_path(workdir, step)
  path.parent.mkdir(parents=True, exist_ok=True)
  data = json.dumps(to_json_value({**result, "step": int(step)}), indent=1, ensure_ascii=False,
                    allow_nan=False)
  storage.atomic_write(path, data + "\n")
  return path


def read_eval_results(workdir: str | os.PathLike[str]) -> list[EvalResult]:
  """Every workdir/eval/step_XXXXXXXX.json, ordered by step (non-finite numbers restored)."""
  directory = storage.path(workdir) / EVAL_DIR
  if not directory.is_dir():
    return []
  results = []
  for path in sorted(directory.iterdir()):
    match = _EVAL_NAME.match(path.name)
    if not match:
      continue
    result = json.loads(path.read_text(encoding="utf-8"))
    for key, value in result.items():
      if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        result[key] = float(value.replace("Infinity", "inf"))
    result.setdefault("step", int(match.group(1)))
    results.append(result)
  return sorted(results, key=lambda r: r["step"])
