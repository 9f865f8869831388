"""The `judge` reward part (reasoning_rl.verifiers.judge) and the model-parts seam
(reasoning_rl.workers.model_parts): parser, template, cache, fallback routing against a hand-built
reference with a fake judge, the scorer wrapper's batching and totals, a tiny random model decoding
through our engine, and config errors."""

import importlib

import pytest

from reasoning_rl.errors import ConfigError, VerifierError
from reasoning_rl.verifiers import judge as judge_lib
from reasoning_rl.verifiers.rewards import CompletionRecord, RewardFunction, build_parts
from reasoning_rl.workers.model_parts import ModelPartsScorer, with_model_parts
from reasoning_rl.workers.scorer import InlineScorer


class FakeJudge:
  """Says "Yes" when the shown answer is in `accept`, else "No" (or `reply` for every prompt)."""

  def __init__(self, accept=(), reply=None):
    self.accept, self.reply = set(accept), reply
    self.batches = []

  def __call__(self, messages):
    self.batches.append(list(messages))
    if self.reply is not None:
      return [self.reply for _ in messages]
    answers = [m.split("Student's final answer: ")[1].split("\n")[0] for m in messages]
    return ["Yes" if a in self.accept else "No" for a in answers]


def settings(**overrides):
  return build_parts({"judge": {"weight": 1.0, "model": "judge.gguf", **overrides}})[0].settings


def record(answer_span, gold="42", prompt="What is 6 * 7?"):
  return CompletionRecord(response=answer_span, ground_truth=gold, prompt=prompt)


@pytest.mark.parametrize("text, value", [
    ("Yes", 1.0), ("yes.", 1.0), (" No", 0.0), ("NO, it is not", 0.0), ("Correct", 1.0),
    ("Incorrect.", 0.0), ("The answer is yes", 1.0), ("I cannot tell", None), ("", None),
    ("Yesterday", None),
])
def test_yes_no_parser(text, value):
  assert judge_lib.parse_yes_no(text) == value


@pytest.mark.parametrize("text, value", [
    ("7", 0.7), ("Score: 10", 1.0), ("0/10", 0.0), ("8 / 10", 0.8), ("11", None), ("-3", None),
    ("7.5", None), ("none", None),
])
def test_score_parser(text, value):
  assert judge_lib.parse_score(text) == value


def test_every_known_judge_reply_reads_as_its_right_verdict():
  from reasoning_rl.verifiers import judge_verdicts  # pylint: disable=import-outside-toplevel

  KNOWN_REPLIES = judge_verdicts.KNOWN_REPLIES  # pylint: disable=invalid-name

  assert len(KNOWN_REPLIES) >= 30
  assert {template for template, _, _ in KNOWN_REPLIES} == set(judge_lib.TEMPLATES)
  misread = [(reply, judge_lib.PARSERS[template](reply), want)
             for template, reply, want in KNOWN_REPLIES
             if judge_lib.PARSERS[template](reply) != want]
  assert misread == []
  # the negations, refusals and hypotheticals that judge-2's parsers scored as full marks
  for reply in ("Not correct.", "The student's answer is not correct.",
                "I cannot say yes to this."):
    assert judge_lib.parse_yes_no(reply) == 0.0
  assert judge_lib.parse_score("10/10 would be a perfect answer; this gets 2") == 0.2


def test_template_holds_question_reference_answer_and_cuts_long_fields():
  prompt = judge_lib.render_prompt("yes_no", "What is {x}?", "42", "6 * 7")
  assert "Question: What is {x}?" in prompt and "Reference answer: 42" in prompt
  assert "Student's final answer: 6 * 7" in prompt and prompt.endswith("Yes or No.")
  assert "(not given)" in judge_lib.render_prompt("score", "", "1", "1")
  long = judge_lib.render_prompt("yes_no", "q" * 5000, "1", "9" * 1000)
  assert len(long) < 5000 / 2 + judge_lib.MAX_ANSWER_CHARS + 600 and "9" * 300 in long


# hand-built reference: (response, rule status, fallback value, alone value) under
# FakeJudge(accept={"40 + 2", "forty-two", "41"}), gold 42
REFERENCE = [
    ("<answer>42</answer>", "correct", 1.0, 0.0),  # the judge is not asked in fallback
    ("<answer>41</answer>", "wrong", 0.0, 1.0),  # alone: the (fake) judge accepts 41
    ("<answer>40 + 2</answer>", "unevaluated", 1.0, 1.0),
    ("<answer>forty-two</answer>", "no_answer", 1.0, 1.0),  # the raw span goes to the judge
    ("<answer>maybe 42</answer>", "hedged", 0.0, 0.0),  # refused on purpose: never judged
    ("no tags at all", "no_answer", 0.0, 0.0),  # nothing to show the judge: no call
]


@pytest.mark.parametrize("mode, column", [("fallback", 2), ("alone", 3)])
def test_fallback_and_alone_route_verdicts_as_the_reference(mode, column):
  fake = FakeJudge(accept={"40 + 2", "forty-two", "41"})
  part = judge_lib.JudgePart(settings(mode=mode), fake)
  records = [record(row[0]) for row in REFERENCE]
  assert [part.rule_check(r).status for r in records] == [row[1] for row in REFERENCE]
  assert part.score_batch(records) == [row[column] for row in REFERENCE]
  shown = [m.split("Student's final answer: ")[1].split("\n")[0] for m in fake.batches[0]]
  if mode == "fallback":
    assert shown == ["40 + 2", "forty-two"]
    assert part.counters.rule_decided == 3 and part.counters.no_answer == 1
  else:
    assert shown == ["42", "41", "40 + 2", "forty-two"]  # not the hedge's "42" a second time
    assert part.counters.calls == 4 and part.counters.rule_decided == 1
    assert part.counters.cache_hits == 0 and part.counters.no_answer == 1
  assert len(fake.batches) == 1  # one batch for the whole call


def test_fallback_statuses_widen_what_the_judge_decides():
  fake = FakeJudge(accept={"41"})
  part = judge_lib.JudgePart(settings(fallback_statuses=["wrong"]), fake)
  assert part.score_batch([record("<answer>41</answer>"), record("<answer>40 + 2</answer>"),
                           record("<answer>42</answer>")]) == [1.0, 0.0, 1.0]
  assert part.counters.calls == 1 and part.counters.rule_decided == 2


def test_cache_hits_across_batches_and_size_bound():
  fake = FakeJudge(accept={"forty-two"})
  part = judge_lib.JudgePart(settings(cache_size=2), fake)
  words = ["forty-two", "forty two", "six sevens"]
  assert part.score_batch([record(f"<answer>{w}</answer>") for w in words]) == [1.0, 0.0, 0.0]
  assert part.counters.calls == 3 and len(part.cache) == 2  # least recently used dropped
  assert part.score_batch([record("<answer>six sevens</answer>")]) == [0.0]
  assert part.counters.cache_hits == 1 and part.counters.calls == 3
  assert part.score_batch([record("<answer>forty-two</answer>")]) == [1.0]  # evicted: asked again
  assert part.counters.calls == 4
  # the key holds the question: the same answer to another question is asked again
  part.score_batch([record("<answer>six sevens</answer>", prompt="What is 7 * 6?")])
  assert part.counters.calls == 5


def test_unparseable_judge_output_scores_zero_and_is_counted():
  part = judge_lib.JudgePart(settings(mode="alone"), FakeJudge(reply="Hmm, let me think"))
  assert part.score_batch([record("<answer>42</answer>"), record("<answer>7</answer>")]) == [0, 0]
  assert part.metrics()["unparseable"] == 2.0 and part.metrics()["calls"] == 2.0
  scored = judge_lib.JudgePart(settings(mode="alone", template="score"), FakeJudge(reply="8/10"))
  assert scored.score_batch([record("<answer>42</answer>")]) == [0.8]


def test_reward_function_skips_model_parts_and_the_wrapper_fills_them_in_one_batch():
  config = {"correct": {"weight": 1.0}, "format": {"weight": 0.5},
            "judge": {"weight": 2.0, "model": "judge.gguf"}}
  reward_fn = RewardFunction(config)
  assert [p.name for p in reward_fn.model_parts] == ["judge"]
  bare = reward_fn.score_group([record("<answer>40 + 2</answer>")])[0]
  assert "judge" not in bare.parts and bare.total == 0.0  # no placeholder in the total
  fake = FakeJudge(accept={"40 + 2"})
  part = judge_lib.JudgePart(reward_fn.model_parts[0].settings, fake)
  scorer = with_model_parts(InlineScorer(reward_fn), part_scorers={"judge": part})
  assert isinstance(scorer, ModelPartsScorer)
  groups = {0: [record("<answer>40 + 2</answer>"), record("<answer>42</answer>")],
            1: [record("<think>x</think><answer>40 + 2</answer>")]}
  scored = scorer.score(groups.items())
  assert len(fake.batches) == 1 and len(fake.batches[0]) == 1  # both groups, one distinct ask
  assert [r.parts for r in scored[0].rewards] == [
      {"correct": 0.0, "format": 0.0, "judge": 1.0}, {"correct": 1.0, "format": 0.0, "judge": 1.0}]
  assert [r.total for r in scored[0].rewards] == [2.0, 3.0]
  assert scored[1].rewards[0].total == 0.5 + 2.0 and scored[1].status == "ok"
  metrics = scorer.metrics()
  assert metrics["judge/calls"] == 1.0 and metrics["judge/cache_hits"] == 1.0
  assert metrics["model_parts/batches"] == 1.0 and metrics["model_parts/records"] == 3.0
  assert scorer.counts()["ok"] == 2
  with pytest.raises(VerifierError, match="nothing is outstanding"):
    scorer.get()


def test_a_failing_part_scorer_turns_its_batch_into_error_groups():
  reward_fn = RewardFunction({"correct": {"weight": 1.0},
                              "judge": {"weight": 1.0, "model": "judge.gguf"}})

  class Broken:
    def score_batch(self, records, rule_rewards):
      raise RuntimeError("judge crashed")

  scorer = ModelPartsScorer(InlineScorer(reward_fn), {"judge": Broken()})
  scored = scorer.score([(0, [record("<answer>42</answer>")])])
  assert scored[0].status == "error" and "judge crashed" in scored[0].error
  assert scored[0].rewards[0].parts == {"correct": 0.0, "judge": 0.0}
  assert scorer.counts()["error"] == 1
  with pytest.raises(ValueError, match="no part scorer"):
    ModelPartsScorer(InlineScorer(reward_fn), {})


def test_no_model_parts_leaves_the_scorer_alone():
  inner = InlineScorer(RewardFunction({"correct": {"weight": 1.0}}))
  assert with_model_parts(inner) is inner


@pytest.mark.parametrize("overrides, message", [
    ({"model": ""}, "config.rewards.judge.model=''"),
    ({"mode": "vote"}, "config.rewards.judge.mode='vote'"),
    ({"fallback_statuses": ["correct"]}, "config.rewards.judge.fallback_statuses"),
    ({"fallback_statuses": "wrong"}, "config.rewards.judge.fallback_statuses"),
    ({"fallback_statuses": []}, "config.rewards.judge.fallback_statuses"),
    ({"template": "likert"}, "config.rewards.judge.template='likert'"),
    ({"max_new_tokens": 0}, "config.rewards.judge.max_new_tokens=0"),
    ({"cache_size": -1}, "config.rewards.judge.cache_size=-1"),
    ({"batch_size": True}, "config.rewards.judge.batch_size=True"),
    ({"extract": "none"}, "config.rewards.judge.extract='none'"),
    ({"timeout_s": 0}, "config.rewards.judge.timeout_s=0"),
    ({"dtype": "int8"}, "config.rewards.judge.dtype='int8'"),
    ({"temperature": 0.5}, "config.rewards.judge.temperature: not a setting of a 'judge' "
     "reward part"),
])
def test_config_errors_name_the_setting(overrides, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
    settings(**overrides)


def test_settings_go_into_verifier_version():
  def version(**overrides):
    return RewardFunction({"judge": {"weight": 1.0, "model": "a.gguf", **overrides}}
                          ).verifier_version
  assert version().startswith(f"judge={judge_lib.JUDGE_VERSION}+math-")
  assert version(mode="alone").startswith(f"judge={judge_lib.JUDGE_VERSION}#")
  assert len({version(), version(model="b.gguf"), version(template="score"),
              version(fallback_statuses=["wrong"])}) == 4


def test_tiny_random_model_judges_through_the_engine():
  from reasoning_rl import build
  from reasoning_rl.models.transformer import create_model

  config = importlib.import_module("configs.debug_cpu").get_config()
  model_config, tokenizer = build.random_model_config(config)
  model = create_model(model_config, seed=0)
  generate = judge_lib.EngineJudge(model, tokenizer, max_new_tokens=4, max_prompt_tokens=128,
                                   batch_size=4)
  part = judge_lib.JudgePart(settings(mode="alone", max_new_tokens=4), generate)
  records = [record(f"<answer>{n}</answer>", gold="7", prompt="3+4") for n in (7, 8, 9, 7)]
  values = part.score_batch(records)
  # a random model writes no yes / no: every distinct answer asked once, all unparseable -> 0
  assert values == [0.0, 0.0, 0.0, 0.0]
  assert part.counters.calls == 3 and part.counters.cache_hits == 1
  assert part.counters.unparseable == 3 and part.counters.seconds > 0
  messages = [judge_lib.render_prompt("yes_no", "3+4", "7", str(n)) for n in (7, 8, 9)]
  first, second = generate(messages), generate(messages[::-1])
  assert first == second[::-1]  # greedy: a reply depends on its prompt only
  assert all(len(tokenizer.encode(reply, add_special_tokens=False)) <= 4 for reply in first)
  assert generate.engine.num_prefills == 9 and generate([]) == []
