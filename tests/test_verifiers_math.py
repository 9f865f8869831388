"""Math verifier: extraction, equivalence classes (positive and negative), hedges, timeouts."""

import concurrent.futures
import multiprocessing
import threading

import pytest

from reasoning_rl.errors import ConfigError
from reasoning_rl.verifiers import final_answer
from reasoning_rl.verifiers import math_answers as math_lib
from reasoning_rl.verifiers.math_answers import boxed_contents, check, extract_candidates, is_correct


def _respond(answer: str) -> str:
  return f"<think>Working it out carefully.</think>\n<answer>{answer}</answer>"


# (ground truth, answer, equivalent?) — grouped by the equivalence class they exercise.
EQUIVALENCE_CASES = {
    "fraction_decimal": [
        (r"\frac{1}{2}", "0.5", True), ("0.25", r"\frac{1}{4}", True), ("1/3", "0.333333", True),
        (r"\frac{3}{4}", "0.75", True), ("2.5", r"\frac{5}{2}", True), ("0.125", "1/8", True),
        (r"\frac{2}{3}", "0.666667", True), ("3.5", r"3\frac{1}{2}", True),
        (r"\frac{1}{3}", "0.33", False), (r"\frac12", "0.51", False), ("0.25", r"\frac{1}{5}", False),
        (r"\frac{2}{3}", "0.6", False),
    ],
    "latex_forms": [
        (r"\frac{3}{4}", r"\dfrac{3}{4}", True), (r"\frac{3}{4}", r"\tfrac34", True),
        (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", True),
        (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt2}{2}", True), ("1024", "2^{10}", True),
        (r"\frac{\pi}{2}", r"\dfrac{\pi}{2}", True),
        (r"2\sqrt{2}", r"\sqrt{6}", False), (r"\frac{3}{4}", r"\frac{4}{3}", False),
        (r"\frac{\pi}{2}", "1.5708", False), ("1024", "2^{11}", False),
    ],
    "percentages": [
        (r"50\%", "0.5", True), (r"50\%", "50", True), (r"25\%", "25%", True), ("0.3", r"30\%", True),
        (r"12.5\%", r"\frac{1}{8}", True),
        (r"50\%", "0.05", False), (r"50\%", "5", False), (r"25\%", "0.52", False),
    ],
    "sets_intervals": [
        (r"\{1, 2\}", r"\{2, 1\}", True), (r"\{1,2\}", "1, 2", True), ("(1, 2)", "(1,2)", True),
        (r"[0, \infty)", r"[0,\infty)", True), (r"(-\infty, 3]", r"(-\infty,3]", True),
        (r"\{3,4\}", r"3 \text{ or } 4", True),
        (r"\{1,2\}", r"\{1,3\}", False), (r"\{1,2\}", r"\{1\}", False), ("(1,2)", "[1,2]", False),
        (r"[0,\infty)", r"(0,\infty)", False), ("3", r"\{3,4\}", False), ("3", "3, 4", False),
    ],
    "units_thousands": [
        ("1000", "1,000", True), ("1000", "1{,}000", True), ("1000", r"1\,000", True),
        ("12345678", "12,345,678", True), ("18", r"18\text{ dollars}", True), ("18", r"\$18", True),
        ("5", "5 cm", True), ("5", r"5\,\text{cm}", True), ("60", r"60^\circ", True),
        ("1000", "1,001", False), ("1000", "100", False), ("18", r"19\text{ dollars}", False),
        ("5", "50 cm", False), ("12345678", "12,345,679", False),
    ],
    "negatives": [
        ("-3", "-3", True), ("-3", "- 3", True), (r"-\frac{1}{2}", "-0.5", True), ("-7", "\u22127", True),
        ("-2", "x = -2", True),
        ("-3", "3", False), (r"-\frac12", "0.5", False), ("-2", "x = 2", False), ("3", "-3", False),
    ],
    "wrong_answers": [
        ("42", "42", True), ("42", r"6 \times 7 = 42", True),
        ("42", "41", False), ("42", "420", False), ("42", "4.2", False), ("42", "x", False),
        ("42", "41 = 42", False), ("42", "x = 41 = 42", False),
    ],
}
ALL_CASES = [(cls, *case) for cls, cases in EQUIVALENCE_CASES.items() for case in cases]


def test_case_count_and_balance():
  assert len(ALL_CASES) >= 60
  for cls, cases in EQUIVALENCE_CASES.items():
    assert any(ok for _, _, ok in cases) and any(not ok for _, _, ok in cases), cls


@pytest.mark.parametrize("cls,truth,answer,expected", ALL_CASES,
                         ids=[f"{c[0]}:{c[2]}" for c in ALL_CASES])
def test_equivalence(cls, truth, answer, expected):
  del cls
  assert is_correct(_respond(answer), truth) is expected


@pytest.mark.parametrize("response", [
    "I think the answer is 42.",  # no answer at all
    "<think>42</think><answer></answer>",  # empty answer span
    "<think>so</think><answer>  </answer>",
    r"The answer is \boxed{42",  # truncated box
    "<answer>42",  # unclosed tag
    "",
])
def test_missing_answer_earns_nothing(response):
  result = check(response, "42")
  assert not result.correct and result.status == "no_answer"


@pytest.mark.parametrize("response", [
    _respond("3 or 4"), _respond(r"3 \text{ or } 4"), _respond(r"x = 3 \lor x = 4"),
    _respond(r"\boxed{3}\boxed{4}"), r"\boxed{3} and then \boxed{4}", _respond("3, 4"),
    _respond(r"\{3, 4, 5\}"), _respond("1 2 3 4 5"), _respond(r"3 \; 4"), _respond("3\n4\n5"),
    "<answer>4</answer><answer>3</answer>", _respond(" = ".join(str(i) for i in range(10))),
    _respond(" ".join(r"\boxed{%d}" % i for i in range(20))),
])
def test_several_different_candidates_earn_nothing(response):
  assert not is_correct(response, "3")


def test_agreeing_candidates_are_fine():
  assert is_correct(r"So \boxed{42}. Double-checking: \boxed{42}", "42")
  assert is_correct(r"First \boxed{\frac12}, i.e. \boxed{0.5}", "0.5")


def test_boxed_contents_nested_and_escaped_braces():
  text = r"a \boxed{\frac{1}{2}} b \boxed{\{1, 2\}} c \fbox{x^{2}} d \boxed{open"
  assert boxed_contents(text) == [r"\frac{1}{2}", r"\{1, 2\}", "x^{2}"]


def test_extraction_modes():
  response = r"<think>maybe \boxed{7}</think><answer>\boxed{5}</answer> \boxed{6}"
  assert extract_candidates(response, "answer_or_boxed") == ["5"]
  assert extract_candidates(response, "answer") == ["5"]
  assert extract_candidates(response, "boxed") == ["5", "6"]  # the chain of thought never answers
  no_tags = r"so \boxed{5}"
  assert extract_candidates(no_tags, "answer_or_boxed") == ["5"]
  assert extract_candidates(no_tags, "answer") == []
  assert extract_candidates("<answer> $\\frac{1}{2}$. </answer>") == [r"\frac{1}{2}"]
  assert is_correct(no_tags, "5") and not is_correct(no_tags, "5", extract="answer")
  assert is_correct("<ans>5</ans>", "5", answer_tag="ans")


@pytest.mark.parametrize("extract", math_lib.EXTRACT_MODES)
@pytest.mark.parametrize("response", [
    r"<think>\boxed{42}</think> The final answer is 41.",
    r"<think>The answer is 42. <answer>42</answer></think> The final answer is 41.",
    r"\boxed{42} is what I first thought.</think> The final answer is 41.",  # prompt opened it
    r"The final answer is 41. <think>but maybe \boxed{42}",  # an unclosed chain of thought
    r"<think><think>\boxed{42}</think> 42 </think> The final answer is 41.",  # nested
])
def test_the_chain_of_thought_never_answers_in_any_mode(response, extract):
  assert not is_correct(response, "42", extract=extract)
  assert "42" not in extract_candidates(response, extract)


def test_a_custom_think_tag_hides_its_content_and_must_differ_from_the_answer_tag():
  response = r"<reasoning>\boxed{42}</reasoning> \boxed{41}"
  assert not is_correct(response, "42", think_tag="reasoning")
  assert is_correct(response, "41", think_tag="reasoning")
  with pytest.raises(ConfigError, match="must differ"):
    is_correct("<answer>1</answer>", "1", think_tag="answer")


def test_the_candidate_cap_comes_before_any_candidate_is_cleaned(monkeypatch):
  cleaned = []
  real_clean = math_lib.clean_for_parsing
  monkeypatch.setattr(math_lib, "clean_for_parsing",
                      lambda c: cleaned.append(c) or real_clean(c))
  nested = "\\boxed{" * 2000 + "1" + "}" * 2000  # 2000 distinct nested candidates
  result = math_lib.check(nested, "1")
  assert result.status == "multiple_answers"
  assert len(result.candidates) == math_lib.MAX_CANDIDATES
  assert len(cleaned) == math_lib.MAX_CANDIDATES  # not one per candidate


def test_ground_truth_may_be_a_full_solution():
  assert is_correct(_respond("0.75"), r"We get $\boxed{\dfrac{3}{4}}$.")


def test_absurd_numbers_are_refused_without_evaluation():
  assert check(_respond(r"10^{10^{10}}"), "3").status == "too_large"
  assert check(_respond(r"(10^{10})!"), "3").status == "too_large"
  assert check(_respond("7" * 2000), "3").status == "too_large"


_SLOW = _respond(r"\int_0^1 e^{x^2}\sin(x^{100}) dx")  # sympy grinds on this for minutes


def test_timeout_in_main_thread_then_normal_operation():
  assert threading.current_thread() is threading.main_thread()
  assert check(_SLOW, "3", timeout_s=0.3).status == "timeout"
  assert is_correct(_respond("0.5"), r"\frac12")  # no stray exception left behind


def test_timeout_and_correctness_in_worker_threads():
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    slow = pool.submit(check, _SLOW, "3", timeout_s=0.3)
    fast = [pool.submit(is_correct, _respond(a), t) for t, a, _ in EQUIVALENCE_CASES["latex_forms"]]
    assert slow.result().status == "timeout"
    assert [f.result() for f in fast] == [ok for _, _, ok in EQUIVALENCE_CASES["latex_forms"]]


def _check_in_process(args):
  response, truth, timeout_s = args
  return math_lib.check(response, truth, timeout_s=timeout_s).status


def test_works_in_worker_process():
  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
    statuses = list(pool.map(_check_in_process, [(_respond("0.5"), r"\frac12", 5.0),
                                                 (_respond("3 or 4"), "3", 5.0),
                                                 (_SLOW, "3", 0.3)]))
  assert statuses == ["correct", "multiple_answers", "timeout"]


def test_bad_arguments():
  with pytest.raises(ConfigError, match="extract"):
    is_correct("x", "1", extract="last_word")
  with pytest.raises(ConfigError, match="timeout_s"):
    is_correct("x", "1", timeout_s=0)


@pytest.mark.parametrize("response,candidates", [
    ("6 - 2 = 4.", ["4"]),
    ("The answer is -28", ["-28"]),
    ("That makes 1,234 apples", ["1234"]),
    ("x2 and then 3.5", ["3.5"]),  # a digit inside a word is no number
    ("12 * 3 = 36\n\nIn math, 36 is 6 squared", ["6"]),  # rambling after the answer costs it
    ("6-2", ["2"]),  # a hyphen after a digit is subtraction, not a sign
    ("no digits here", []),
])
def test_last_number_extraction(response, candidates):
  assert extract_candidates(response, "last_number") == candidates


def test_last_number_correctness():
  assert is_correct("So 17 + 25 = 42.", "42", extract="last_number")
  assert not is_correct("So 17 + 25 = 42, or maybe 43", "42", extract="last_number")
  assert not is_correct("I do not know", "42", extract="last_number")


# ------------------------------------------------------------------------------ free-text answers

# Honest ways a chat model states the right answer 42 (and, with 41 written instead, a wrong one).
HONEST_PHRASINGS = [
    "{a}", "The answer is {a}.", "17 + 25 = {a}", "So 17 + 25 = {a}.", "17 + 25 equals {a}.",
    "The sum of 17 and 25 is {a}.", "Adding 17 and 25 gives {a}.", "Answer: {a}", "**Answer:** {a}",
    "The answer is **{a}**.", "The result is {a}", "x = {a}", "So, x = {a}.",
    "Janet has {a} apples.", "17 plus 25 makes {a} in total.", "It's {a}.",
    "The final answer is ${a}$.", "We get $17 + 25 = {a}$.", "Therefore, the answer is \\({a}\\).",
    "17 + 25 = {a}\n\nSo, the answer is {a}.",
    "To find the answer, add 17 and 25.\n\n17 + 25 = {a}\n\nSo, the answer is {a}.",
    "To calculate 17 + 25, we add them together: 17 + 25 = {a}.\n\nThis",
    "I think the answer is {a}.", "The answer is {a} (no rounding needed).", "{a}.0",
]


@pytest.mark.parametrize("phrasing", HONEST_PHRASINGS)
def test_free_text_honest_answers(phrasing):
  right = phrasing.format(a=42)
  assert check(right, "42", extract="final_answer").status == "correct", right
  wrong = phrasing.replace("{a}", "41").replace("17 + 25", "17 + 24")
  assert not is_correct(wrong, "42", extract="final_answer"), wrong


def test_the_issue_examples():
  assert is_correct("<answer>So the total cost is 3*4 = 12 dollars.</answer>", "12")
  assert is_correct("So the total cost is 3*4 = 12 dollars.", "12", extract="final_answer")
  assert is_correct("17 + 25 = 42", "42", extract="final_answer")
  assert is_correct("The answer is 42.", "42", extract="final_answer")
  assert not is_correct("41 = 42", "42", extract="final_answer")
  assert not is_correct("x = 41 = 42", "42", extract="final_answer")


@pytest.mark.parametrize("response,status", [
    ("She has 41 or 42 apples.", "multiple_answers"),
    ("The answer is 41, or maybe 42.", "hedged"),
    ("I am not sure, maybe 42.", "hedged"),
    ("Perhaps 42.", "hedged"),
    ("The answer is not 42.", "hedged"),
    ("It isn't 42.", "hedged"),
    ("The answer is 42, not 41.", "hedged"),
    ("Is it 42?", "no_answer"),
    ("The answer is 41. Actually, it is 42.", "multiple_answers"),
    ("The answer is 41. The answer is 42.", "multiple_answers"),
    ("The answer is 41.\n42", "multiple_answers"),
    ("The answer is 42. To check: 42 - 25 = 17.", "multiple_answers"),  # a second answer after it
    ("The answer is $41$ or $42$.", "multiple_answers"),
    ("She has between 41 and 43 apples.", "wrong"),  # two candidates, neither right
    ("So 41 = 42.", "wrong"),
    ("So x = 41 = y = 42.", "wrong"),
    (r"\text{41} = 42", "wrong"),  # a first link with digits must hold, not name the quantity
    ("41x = 42", "wrong"),
    (r"She has about 41 \approx 42 apples.", "wrong"),
    ("She has 40 + 2 apples.", "unevaluated"),
    ("Calculate 40 + 2.", "unevaluated"),
    ("<think>The answer is 42.</think>", "no_answer"),  # reasoning is not the answer
    (r"\boxed{41} Actually it is 42.", "wrong"),  # a box is the answer; prose after it is not
    ("Janet has 42 apples and buys 0 more. How many apples does she have?", "multiple_answers"),
])
def test_free_text_hedges_earn_nothing(response, status):
  result = check(response, "42", extract="final_answer")
  assert not result.correct and result.status == status, result


@pytest.mark.parametrize("response,truth,status", [
    ("AZYUK2A", "2", "no_answer"), ("AZYUK 2", "2", "correct"),  # a name holds no number
    ("The answer is 14,916. It is divisible by 3 and 4.", "14916", "correct"),
    ("The answer is 14,916. It is divisible by 3 and 4.", "3", "wrong"),  # no second shot
    ("The answer is 14,916. Actually, it is 3.", "14916", "multiple_answers"),
    ("He spends $5. The answer is $8$.", "8", "correct"),
    ("He spends $5. The answer is $8$.", "5", "wrong"),
    ("The answer is $41 or else $42$.", "42", "multiple_answers"),  # dollars split no hedge off
    (r"$\boxed{200}$ is the interest. The final answer is 10,455.", "10455", "correct"),
    (r"$\boxed{200}$ is the interest. The final answer is 10,455.", "200", "wrong"),
    (r"\boxed{42} So the answer is 41.", "42", "wrong"),  # a working box is no second shot
    ("The answer is (B).", "B", "correct"), ("The answer is (B).", r"\text{(B)}", "correct"),
    ("The answer is (B).", "C", "wrong"), ("The answer is (A) or (B).", "B", "multiple_answers"),
    ("The answer is (A), (B), (C) or (D).", "B", "wrong"), ("I think it is B.", "B", "no_answer"),
    # A bound after the verb is a hedge; words such as "least" or "more" elsewhere are not.
    ("She has at least 42 apples.", "42", "hedged"), ("It is 42 or more.", "42", "hedged"),
    ("The answer is 42 or so.", "42", "hedged"), ("At most 42.", "42", "hedged"),
    ("The least common multiple is 42.", "42", "correct"),
    ("She has 3 more than Tom, so 42.", "42", "correct"),
    ("The numbers add up to 42.", "42", "correct"),
])
def test_names_and_asides_after_the_answer(response, truth, status):
  assert check(response, truth, extract="final_answer").status == status


def test_final_answer_mode_prefers_answer_tags_then_boxes():
  assert extract_candidates("<answer>41</answer> The answer is 42.", "final_answer") == ["41"]
  assert extract_candidates(r"The answer is \boxed{42}, i.e. 41 + 1.", "final_answer") == ["42"]
  assert extract_candidates("<think>maybe 7</think>So 6 + 1 = 7.", "final_answer") == ["6 + 1 = 7"]
  assert extract_candidates("<reasoning>7</reasoning> It is 8.", "final_answer") == ["8"]
  # Without tags or boxes the other modes read nothing from prose; last_number takes its last number.
  assert extract_candidates("So 6 + 1 = 7.", "answer_or_boxed") == []
  assert extract_candidates("So 6 + 1 = 7.", "last_number") == ["7"]


@pytest.mark.parametrize("text,candidates,refusal", [
    ("42", ("42",), None),
    (r"x = 41 \lor x = 42", (r"x = 41 \lor x = 42",), None),  # plain math stays whole
    ("$41$ $42$", ("41 42",), None),  # ... so its whitespace-separated numbers are caught
    ("5 cm", ("5",), None),
    ("The sum of 17 and 25 is 42.", ("42",), None),
    ("42 is the answer.", ("42",), None),  # no math after the verb: the statement's math
    ("Step 2: 17 + 25 = 42", ("17 + 25 = 42",), None),
    ("The ratio is 7:32.", ("7:32",), None),
    ("Final Answer: The final answer is $14 {, }916$. I hope it is correct.", ("14 {, }916",),
     None),
    (r"Weight = $\frac{7}{9} \times 10$ = $\frac{70}{9}$",
     (r"\frac{7}{9} \times 10 = \frac{70}{9}",), None),
    ("So 15 cm^2 in all.", ("15",), None),  # "^2" after a unit is no candidate
    ("The answer is not 42.", ("42",), "hedged"),
    ("Maybe it is 42.", ("42",), "hedged"),
    ("Since 42 is not prime, the answer is 41.", ("41",), None),  # negation before the verb
    ("No numbers here.", (), None),
    # A word run into digits is a name, not a number; a single letter run into digits stays math.
    ("AZYUK2A", (), None), ("The code is AB12.", (), None), ("x2 = 5", ("x2 = 5",), None),
    # After the named answer, numbers mentioned among words past a verb are no second answer ...
    ("The final answer is $14916$. Note: it checks divisibility by 3 and 4.", ("14916",), None),
    # ... but a value stated after a verb, or bare, is.
    ("The final answer is $14916$. Note: it is 3.", ("14916", "3"), None),
    ("The final answer is $14916$. Or 3.", ("14916", "3"), None),
    # `$` as a currency sign: a `$…$` holding prose was two dollar signs, not math.
    ("He spends $5. The answer is $8$.", ("8",), None),
    ("Final Answer: The final answer is $10,455$. I hope it is correct.", ("10,455",), None),
    ("She pays $5 for apples and $3 for pears, so the total is $8.", ("8",), None),
    ("The answer is $41 and then $42$.", ("41", "42"), None),  # two answers, still
    ("The perimeter is $AB + BC + CA = 8$.", ("AB + BC + CA = 8",), None),  # variables: math
    (r"So $x = 5 \text{ and } y = 3$.", (r"x = 5 \text{ and } y = 3",), None),
    # Boxes followed by a statement naming the answer were steps of the working ...
    (r"So $2 \cdot 100 = \boxed{200}$ dollars. The final answer is $10,455$.", ("10,455",), None),
    (r"It lies between $\boxed{12 $ and $13}$. The final answer is \"$12$ and $13$\".",
     ("12", "13"), None),
    # ... but a box in a statement naming the answer still counts, and prose not naming it, or
    # nested boxes, leave the boxes the answer.
    (r"The answer is \boxed{41}. So the answer is 42.", ("41", "42"), None),
    (r"\boxed{41} Actually it is 42.", ("41",), None),
    (r"\boxed{4\boxed{2}} The answer is 42.", (r"4\boxed{2}", "2"), None),
])
def test_read_final_answer(text, candidates, refusal):
  assert final_answer.read_final_answer(text) == final_answer.FinalAnswer(candidates, refusal)


@pytest.mark.parametrize("answer,truth,status", [
    ("6 \\times 7 = 42", "42", "correct"), ("x = 2 \\cdot 21 = 42", "42", "correct"),
    ("P(A) = 1/2 + 1/6 = 2/3", "2/3", "correct"), ("a_{37} = 19", "19", "correct"),
    (r"\frac{70}{9} \approx 7.78", "7.78", "correct"),
    (r"\frac{70}{9} \approx 7.8", "7.8", "correct"),
    (r"\frac{70}{9} \approx 7.7", "7.7", "wrong"), ("41.6 \\approx 42", "42", "correct"),
    # A slip in the working is no second answer: the chain still states one value, its last link
    # (or the exact value a false rounding rounds), and earns only on a truth equal to it.
    ("40 + 2 = 41", "41", "correct"), ("40 + 2 = 41", "42", "wrong"),
    ("z = 3+3 = 2", "2", "correct"), ("z = 3+3 = 2", "6", "wrong"),
    (r"x = 1/3 \approx 1.3", "1/3", "correct"), (r"x = 1/3 \approx 1.3", "1.3", "wrong"),
    (r"41 \approx 42", "41", "correct"), (r"41 \approx 42", "42", "wrong"),
    (r"x = 40 + 2 \approx 41", "42", "unevaluated"),  # the rounded value must be stated
    # A false link between two stated values commits to both: wrong for either.
    ("x = 5+5+1 = 7 = 11", "11", "wrong"), ("x = 5+5+1 = 7 = 11", "7", "wrong"),
    # A truth written as an assignment states its value.
    ("11", "$x = 11$", "correct"), ("y = 11", "$x = 11$", "correct"),
    ("2", "$z = 1 + 1 = 2$", "correct"), ("3", "$z = 1 + 1 = 2$", "wrong"),
    ("42 = 40 + 2", "42", "unevaluated"),
    ("6 \\times 7", "42", "unevaluated"), ("(9+1)", "10", "unevaluated"),
    ("3 \\times 10^{5}", "300000", "correct"), ("2^{10}", "1024", "correct"),
    (r"1 - \frac{1}{e}", r"1 - \frac{1}{e}", "correct"),  # not a numeric truth: no rule
    (" = ".join(["42"] * 20), "42", "wrong"),  # too long a chain is spam
])
def test_chains_and_arithmetic_left_undone(answer, truth, status):
  assert check(_respond(answer), truth).status == status


@pytest.mark.parametrize("response,truth,expected", [
    (r"\boxed{1} and \boxed{2} and \boxed{3}", r"\{1,2,3\}", True),
    (r"\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}", "(2, 2), (6, 2)", True),
    (r"\boxed{1}, \boxed{2}, \boxed{4}", r"\{1,2,3\}", False),
    (r"\boxed{1}, \boxed{2}", r"\{1,2,3\}", False),
    (r"\boxed{1,2}", r"\boxed{1} \text{ and } \boxed{2}", True),  # several boxes in a truth: a set
    (r"\boxed{3} and \boxed{4}", "3", False),  # a single truth: still a hedge
])
def test_several_candidates_answer_a_set(response, truth, expected):
  assert is_correct(response, truth) is expected


@pytest.mark.parametrize("answer,truth,expected", [
    ("1 000", "1000", True), ("12 345 678", "12345678", True), ("41 420", "41420", True),
    ("1000,99", "1000.99", True), ("41,42", "41.42", True), ("41,42", "42", False),
    (r"1 - \frac{1}{\mathrm{e}}", r"1 - \frac{1}{e}", True), (r"x \in [-2,7]", "[-2, 7]", True),
    # scientific notation as programs print it: the number, not a product with Euler's e
    ("5.619080000000000e+02", "561.908", True), ("1e-3", "0.001", True), ("-2.5E+01", "-25", True),
    ("5.6e+02", "561.908", False), ("2e", "2", False),
])
def test_number_notations(answer, truth, expected):
  assert is_correct(_respond(answer), truth) is expected


@pytest.mark.parametrize("answer,truth,status", [
    # Bounds on one variable are the interval they describe (both ways round) ...
    (r"x \geq 3", r"[3, \infty)", "correct"), (r"3 \leq k", r"[3,\infty)", "correct"),
    (r"-1 < x \leq 2", "(-1, 2]", "correct"), (r"[3, \infty)", r"x \geq 3", "correct"),
    (r"x \neq 2", r"(-\infty, 2) \cup (2, \infty)", "correct"),
    # ... the same interval only,
    ("x > 3", r"[3, \infty)", "wrong"), (r"-1 < x \leq 2", "[-1, 2]", "wrong"),
    (r"(3, \infty)", r"x \geq 3", "wrong"),
    # and only bounds: the inequality left unsolved, or two variables, are no interval.
    (r"x^2 \geq 4", r"(-\infty, -2] \cup [2, \infty)", "wrong"),
    (r"x \geq 3, y \leq 2", r"[3, \infty)", "wrong"),
    # A bound does not state a number.
    (r"x \geq 42", "42", "wrong"), ("41 < x < 43", "42", "wrong"), (r"x \le 42", "42", "wrong"),
])
def test_bounds_and_intervals(answer, truth, status):
  assert check(_respond(answer), truth).status == status


def test_fractional_exponents_are_not_too_large():
  answer = r"10^{\frac{\sqrt{13} - 5}{6}}"
  assert check(_respond(answer), r"10^{\frac{-5+\sqrt{13}}{6}}").status == "correct"


def test_answer_value_is_the_last_link():
  assert math_lib.answer_value("17 + 25 = 42") == "42"
  assert math_lib.answer_value(r"\sum_{k=0}^{3} k = 6") == "6"  # "=" inside braces is no link
  assert math_lib.answer_value(r"\frac{70}{9} \approx 7.78") == "7.78"
  assert math_lib.answer_value("x \\leq 2") == "x \\leq 2"


def test_long_free_text_is_read_from_its_tail():
  text = "$x$ " * 60_000 + "So the answer is 42."
  assert check(text, "42", extract="final_answer").status == "correct"
