"""Format strictness, language consistency, and length shaping against hand-computed numbers."""

import pytest

from reasoning_rl.errors import ConfigError
from reasoning_rl.verifiers import format as format_lib
from reasoning_rl.verifiers import length as length_lib
from reasoning_rl.verifiers.format import FormatSpec, format_ok

# ------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize("response,expected", [
    ("<think>reason</think><answer>42</answer>", True),
    ("  <think>reason</think>\n\n<answer>42</answer>\n  ", True),
    ("<think>reason</think><answer>42</answer> trailing", False),  # text after the answer
    ("preamble <think>reason</think><answer>42</answer>", False),  # text before the reasoning
    ("<answer>42</answer><think>reason</think>", False),  # wrong order
    ("<think>reason</think>between<answer>42</answer>", False),  # text between
    ("<think>a</think><think>b</think><answer>42</answer>", False),  # two think spans
    ("<think>reason</think><answer>4</answer><answer>2</answer>", False),  # two answer spans
    ("<think>reason <answer>41</answer></think><answer>42</answer>", False),  # nested answer
    ("<think></think><answer>42</answer>", False),  # empty think
    ("<think> \n </think><answer>42</answer>", False),  # whitespace think
    ("<think>reason</think><answer> </answer>", False),  # empty answer
    ("<think>reason</think>", False),  # no answer
    ("<answer>42</answer>", False),  # no think
    ("<think>reason<answer>42</answer>", False),  # unclosed think
    ("", False),
])
def test_strict_r1_zero_format(response, expected):
  assert format_ok(response) is expected


def test_format_options():
  assert format_ok("<think></think><answer>1</answer>", FormatSpec(require_nonempty_think=False))
  assert format_ok("<think>x</think><answer></answer>", FormatSpec(require_nonempty_answer=False))
  spec = FormatSpec(think_tag="reasoning", answer_tag="final")
  assert format_ok("<reasoning>x</reasoning><final>1</final>", spec)
  assert not format_ok("<think>x</think><answer>1</answer>", spec)
  # The prompt ends with <think>: the response starts inside the reasoning.
  opened = FormatSpec(think_open_in_prompt=True)
  assert format_ok("so 6*7=42</think><answer>42</answer>", opened)
  assert not format_ok("<think>so</think><answer>42</answer>", opened)  # opens it a second time
  assert not format_ok("</think><answer>42</answer>", opened)  # empty reasoning


def test_format_regex_template():
  spec = FormatSpec(pattern=r"Reasoning: (?P<think>.+?)\nAnswer: (?P<answer>.*)")
  assert format_ok("Reasoning: 6*7\nAnswer: 42", spec)
  assert not format_ok("Reasoning: 6*7\nAnswer: ", spec)  # empty answer group
  assert not format_ok("Answer: 42", spec)
  with pytest.raises(ConfigError, match="format.pattern"):
    FormatSpec(pattern="(unclosed")
  with pytest.raises(ConfigError, match="format.think_tag"):
    FormatSpec(think_tag="<think>")


def test_tag_contents():
  text = "<answer>1</answer> x <answer>\n2\n</answer> <answer>3"
  assert format_lib.tag_contents(text) == ["1", "\n2\n"]
  assert format_lib.last_tag_content(text) == "\n2\n"
  assert format_lib.last_tag_content("none") is None


# ---------------------------------------------------------------------------------------- language


def test_script_share_hand_computed():
  # Letters: a b c 中 文 -> 3 Latin of 5; digits/space/punctuation are neutral.
  assert format_lib.script_share("abc 中文 123!", "latin") == pytest.approx(3 / 5)
  assert format_lib.script_share("abc 中文 123!", "cjk") == pytest.approx(2 / 5)
  assert format_lib.script_share("abc 中文 123!", "han") == pytest.approx(2 / 5)
  # é is LATIN SMALL LETTER E WITH ACUTE; Ж is Cyrillic; ひ is Hiragana (CJK group, not Han).
  assert format_lib.script_share("éЖ", "latin") == pytest.approx(0.5)
  assert format_lib.script_share("ひ中", "han") == pytest.approx(0.5)
  assert format_lib.script_share("ひ中", "cjk") == pytest.approx(1.0)
  assert format_lib.script_share("12 + 3 = 15", "latin") == 0.0  # no letters, no reward
  with pytest.raises(ConfigError, match="language.script"):
    format_lib.script_share("abc", "klingon")


def test_language_consistency_reads_only_the_reasoning():
  response = "<think>Let us 计算</think><answer>答案 42</answer>"
  # Reasoning letters: L e t u s 计 算 -> 5 Latin of 7; the answer's CJK is not counted.
  assert format_lib.language_consistency(response, "latin") == pytest.approx(5 / 7)
  assert format_lib.language_consistency("<think></think><answer>a</answer>") == 0.0
  assert format_lib.language_consistency("no tags at all") == 0.0
  opened = "only English here</think><answer>1</answer>"
  assert format_lib.language_consistency(opened, think_open_in_prompt=True) == 1.0


# ------------------------------------------------------------------------------------------ length


@pytest.mark.parametrize("num_tokens,truncated,expected", [
    (0, False, 0.0), (80, False, 0.0),  # L <= L_max - L_cache = 80
    (81, False, -0.05),  # (80 - 81) / 20
    (90, False, -0.5),  # (80 - 90) / 20
    (99, False, -0.95), (100, False, -1.0),  # at the limit the soft term reaches -1
    (101, False, -1.0),  # beyond the limit
    (50, True, -1.0),  # truncated: full penalty whatever the length
])
def test_dapo_overlong_penalty(num_tokens, truncated, expected):
  value = length_lib.dapo_overlong_penalty(num_tokens, max_len=100, cache_len=20,
                                           truncated=truncated)
  assert value == pytest.approx(expected)


def test_dapo_bad_settings():
  with pytest.raises(ConfigError, match="cache_len"):
    length_lib.dapo_overlong_penalty(1, max_len=10, cache_len=20)
  with pytest.raises(ConfigError, match="cache_len"):
    length_lib.dapo_overlong_penalty(1, max_len=10, cache_len=0)
  with pytest.raises(ConfigError, match="num_tokens"):
    length_lib.dapo_overlong_penalty(-1, max_len=10, cache_len=2)


def test_kimi_length_rewards_hand_computed():
  # min 10, max 30: λ = 0.5 - (len - 10) / 20 = [0.5, 0.0, -0.5, 0.25]
  rewards = length_lib.kimi_length_rewards([10, 20, 30, 15], [True, False, True, False])
  assert rewards == pytest.approx([0.5, 0.0, -0.5, 0.0])  # wrong ones: min(0, λ)
  assert length_lib.kimi_length_rewards([100, 200], [False, False]) == pytest.approx([0.0, -0.5])
  assert length_lib.kimi_length_rewards([7, 7, 7], [True, False, True]) == [0.0, 0.0, 0.0]
  assert length_lib.kimi_length_rewards([], []) == []
  with pytest.raises(ConfigError):
    length_lib.kimi_length_rewards([1, 2], [True])


def test_lcpo_hand_computed():
  # Exact: 1 - 0.0003 * |1000 - 1200| = 1 - 0.06
  assert length_lib.lcpo_exact_reward(True, 1200, 1000) == pytest.approx(0.94)
  assert length_lib.lcpo_exact_reward(False, 800, 1000) == pytest.approx(-0.06)
  assert length_lib.lcpo_exact_penalty(1000, 1000) == 0.0
  assert length_lib.lcpo_exact_penalty(10, 20, alpha=0.5) == pytest.approx(-5.0)
  # Max: clip(0.0003 * (target - used) + 0.5, 0, 1), only when correct.
  assert length_lib.lcpo_max_reward(True, 1200, 1000) == pytest.approx(0.44)
  assert length_lib.lcpo_max_reward(True, 0, 1000) == pytest.approx(0.8)
  assert length_lib.lcpo_max_reward(True, 0, 3000) == pytest.approx(1.0)
  assert length_lib.lcpo_max_reward(True, 4000, 1000) == pytest.approx(0.0)
  assert length_lib.lcpo_max_reward(False, 0, 3000) == 0.0
  with pytest.raises(ConfigError, match="alpha"):
    length_lib.lcpo_exact_penalty(1, 1, alpha=-1.0)
