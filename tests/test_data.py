"""Task sources, held-out filtering, prompt templates and the debug vocabulary (reasoning_rl.data)."""

import json

import ml_collections
import pytest

from reasoning_rl import registry  # noqa: F401  (every built-in task source, guess_number too)
from reasoning_rl.data import debug_vocab, tasks, templates
from reasoning_rl.data.tasks import Example, PromptStream, build_source
from reasoning_rl.data.templates import PromptTemplate
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.tokenizers import Tokenizer

BASIC_ARITHMETIC = dict(kind="reasoning_gym", name="basic_arithmetic", seed=3, size=50,
                        params=dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2,
                                    operators=("+", "-", "*")))


@pytest.fixture(scope="module")
def debug_tokenizer():
  return debug_vocab.debug_arithmetic_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_path):
  return Tokenizer.from_gguf(smollm2_gguf_path)


def _example(prompt="3+4=", answer="7"):
  return Example(uid="u", prompt=prompt, answer=answer, task="synthetic_arithmetic")


# ----------------------------------------------------------------------------- sources


def test_synthetic_arithmetic_answers_are_the_arithmetic_of_the_prompt():
  source = build_source(dict(kind="synthetic_arithmetic", seed=5, max_operand=9, ops="+-*"))
  seen_ops = set()
  for index in range(200):
    example = source.example(index)
    a, op, b = example.prompt[0], example.prompt[1], example.prompt[2]
    assert example.prompt == f"{a}{op}{b}=" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
    assert int(example.answer) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                   "*": int(a) * int(b)}[op]
    assert example.metadata == {"operands": [int(a), int(b)], "op": op, "source_index": index}
    assert example.uid == f"synthetic_arithmetic/5/{index}"
    seen_ops.add(op)
  assert seen_ops == {"+", "-", "*"}
  default = build_source(dict(kind="synthetic_arithmetic"))
  assert {default.example(i).prompt[1] for i in range(50)} == {"+"}


def test_same_index_same_example_and_seeds_differ():
  config = ml_collections.ConfigDict(dict(kind="synthetic_arithmetic", seed=0))
  first, second = build_source(config), build_source(dict(config))
  assert [first.example(i) for i in (7, 0, 123456)] == [second.example(i) for i in (7, 0, 123456)]
  other = build_source(dict(kind="synthetic_arithmetic", seed=1))
  assert [first.example(i).prompt for i in range(20)] != [other.example(i).prompt for i in range(20)]


def test_reasoning_gym_basic_arithmetic_is_reasoning_gyms_own_data_and_scores():
  import reasoning_gym

  from reasoning_rl.verifiers.logic import evaluate_arithmetic

  source = build_source(ml_collections.ConfigDict(BASIC_ARITHMETIC), field="data.train")
  reference = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=50,
                                           **BASIC_ARITHMETIC["params"])
  for index in range(50):
    example, entry = source.example(index), reference[index]
    assert (example.prompt, example.answer) == (entry["question"], entry["answer"])
    assert example.task == "basic_arithmetic"
    assert example.metadata["source_dataset"] == "basic_arithmetic"
    json.dumps(example.metadata)  # JSON-able
    # reasoning-gym's own scorer accepts the ground truth and rejects a wrong answer.
    assert reference.score_answer(example.answer, {**entry, "metadata": example.metadata}) == 1.0
    assert reference.score_answer(str(int(example.answer) + 1), entry) < 1.0
  # Past `size` the stream continues with a new epoch: new seed, same options, new problems.
  wrapped = [source.example(50 + i) for i in range(50)]
  assert source.epoch_seed(1) != 3 and wrapped[0].uid == f"basic_arithmetic/{source.epoch_seed(1)}/0"
  assert [e.prompt for e in wrapped] != [source.example(i).prompt for i in range(50)]
  epoch_reference = reasoning_gym.create_dataset("basic_arithmetic", seed=source.epoch_seed(1),
                                                 size=50, **BASIC_ARITHMETIC["params"])
  for example, entry in zip(wrapped, epoch_reference):
    assert (example.prompt, example.answer) == (entry["question"], entry["answer"])
  # Every label is the exact value of its expression (an independent evaluator), all 100.
  for example in [source.example(i) for i in range(50)] + wrapped:
    value, _ = evaluate_arithmetic(example.metadata["expression"], allow_unary_minus=True)
    assert value == int(example.answer) and set(example.metadata["expression"]) <= set(
        "0123456789+-*() ")
  assert source.example(57) == wrapped[7]  # Random access into a later epoch is stable.


def test_reasoning_gym_countdown_keeps_the_metadata_verifiers_need():
  source = build_source(dict(kind="reasoning_gym", name="countdown", seed=1, size=4))
  example = source.example(2)
  assert example.task == "countdown"
  assert isinstance(example.metadata["numbers"], list) and isinstance(
      example.metadata["target"], int)


def test_jsonl_rows(tmp_path):
  path = tmp_path / "tasks.jsonl"
  rows = [
      {"prompt": "2+2=", "answer": "4"},
      {"question": "Half of 9?", "answer": 4.5, "task": "gsm", "level": 2},
      {"prompt": "def f(): ...", "tests": ["assert f() is None"], "task": "code", "id": "c1",
       "metadata": {"entry_point": "f"}},
  ]
  path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
  source = build_source(dict(kind="jsonl", path=str(path)))
  assert source.example(0) == Example(uid="tasks.jsonl:1", prompt="2+2=", answer="4", task="math")
  assert source.example(1) == Example(uid="tasks.jsonl:2", prompt="Half of 9?", answer="4.5",
                                      task="gsm", metadata={"level": 2})
  assert source.example(2) == Example(uid="c1", prompt="def f(): ...", answer="", task="code",
                                      metadata={"entry_point": "f"},
                                      tests=("assert f() is None",))
  assert source.example(3) == source.example(0)  # Epoch 2, file order.
  shuffled = build_source(dict(kind="jsonl", path=str(path), shuffle=True, seed=4))
  epochs = [[shuffled.example(e * 3 + i).uid for i in range(3)] for e in range(6)]
  assert all(sorted(epoch) == sorted(["tasks.jsonl:1", "tasks.jsonl:2", "c1"]) for epoch in epochs)
  assert len({tuple(epoch) for epoch in epochs}) > 1  # Reshuffled per epoch.


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x"', "not valid JSON"),
    ('["x", "1"]', "expected a JSON object"),
    ('{"answer": "1"}', "field 'prompt' (or 'question')"),
    ('{"prompt": "  ", "answer": "1"}', "field 'prompt' (or 'question')"),
    ('{"prompt": "x"}', "field 'answer'"),
    ('{"prompt": "x", "answer": true}', "field 'answer'"),
    ('{"prompt": "x", "answer": "1", "tests": "assert 1"}', "field 'tests'"),
    ('{"prompt": "x", "answer": "1", "task": 3}', "field 'task'"),
    ('{"prompt": "x", "answer": "1", "metadata": [1]}', "field 'metadata'"),
])
def test_jsonl_bad_rows_name_file_line_and_field(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "ok", "answer": "1"}\n\n' + line + "\n")
  with pytest.raises(ConfigError) as error:
    build_source(dict(kind="jsonl", path=str(path)))
  assert f"{path}:3: " in str(error.value) and message in str(error.value)


@pytest.mark.parametrize("config, message", [
    (dict(kind="parquet"), "config.data.train.kind='parquet': unknown task source; use one of "
     "['synthetic_arithmetic', 'reasoning_gym', 'jsonl', 'mixture', 'agent', "
     "'guess_number']"),
    (dict(seed=1), "config.data.train.kind=None"),
    (dict(kind="reasoning_gym"), "config.data.train.name is missing; set it to a reasoning-gym"),
    (dict(kind="reasoning_gym", name="no_such_task"), "config.data.train.name='no_such_task'"),
    (dict(kind="reasoning_gym", name="basic_arithmetic", params=dict(min_terms=3, max_terms=2)),
     "config.data.train.params="),
    (dict(kind="reasoning_gym", name="basic_arithmetic", size=0), "config.data.train.size=0"),
    (dict(kind="synthetic_arithmetic", max_operands=9), "config.data.train.max_operands: not a"),
    (dict(kind="synthetic_arithmetic", ops="/"), "config.data.train.ops='/'"),
    (dict(kind="synthetic_arithmetic", seed="0"), "config.data.train.seed='0'"),
    (dict(kind="jsonl"), "config.data.train.path is missing; set it to the path of a JSONL"),
    (dict(kind="jsonl", path="/no/such.jsonl"), "config.data.train.path='/no/such.jsonl'"),
    (dict(kind="mixture", sources=[]), "config.data.train.sources=[]"),
    (dict(kind="mixture", sources=[dict(kind="synthetic_arithmetic", sed=1)]),
     "config.data.train.sources[0].sed"),
    (dict(kind="mixture", sources=[dict(kind="synthetic_arithmetic")], weights=[1, 2]),
     "config.data.train.weights=[1, 2]"),
])
def test_bad_source_configs_name_the_field(config, message):
  with pytest.raises(ConfigError) as error:
    build_source(ml_collections.ConfigDict(config) if "kind" in config else config,
                 field="data.train")
  assert message in str(error.value)


def test_mixture_interleaves_by_weight_and_reads_each_source_in_order():
  a = dict(kind="synthetic_arithmetic", seed=1)
  b = dict(kind="synthetic_arithmetic", seed=2, ops="-")
  mixture = build_source(dict(kind="mixture", sources=[a, b], weights=[0.75, 0.25]))
  # Weights 3:1 -> a period of 4 slots; smooth round robin places b third (hand-derived:
  # credits (3,1) -> a; (2,2) -> a (tie, first); (1,3) -> b; (4,0) -> a).
  assert mixture.slots == [(0, 0), (0, 1), (1, 0), (0, 2)]
  assert [mixture.locate(i) for i in range(8)] == [(0, 0), (0, 1), (1, 0), (0, 2),
                                                   (0, 3), (0, 4), (1, 1), (0, 5)]
  first, second = build_source(a), build_source(b)
  assert mixture.example(6) == second.example(1) and mixture.example(7) == first.example(5)
  counts = [mixture.locate(i)[0] for i in range(4000)]
  assert counts.count(1) == 1000


# ----------------------------------------------------------------------------- streams


def test_stream_positions_are_deterministic_and_resumable():
  source = build_source(dict(kind="synthetic_arithmetic", seed=0))
  stream = PromptStream(source)
  first, second = stream.take(5), stream.take(3)
  assert [i for i, _ in first + second] == list(range(8)) and stream.position == 8
  resumed = PromptStream(build_source(dict(kind="synthetic_arithmetic", seed=0)), position=5)
  assert resumed.take(3) == second
  assert PromptStream(source, position=5).take(3) == PromptStream(source, position=5).take(3)


def test_stream_skips_held_out_prompts():
  train = build_source(dict(kind="synthetic_arithmetic", seed=0, max_operand=3))
  held_out = build_source(dict(kind="synthetic_arithmetic", seed=10_000, max_operand=3))
  eval_examples = [held_out.example(i) for i in range(6)]
  exclude = tasks.held_out_prompts(eval_examples)
  assert 1 < len(exclude) <= 6  # 16 possible prompts, so the two sources overlap a lot.
  taken = PromptStream(train, exclude=exclude).take(40)
  assert all(tasks.normalize_prompt(e.prompt) not in exclude for _, e in taken)
  indices = [i for i, _ in taken]
  skipped = [i for i in range(indices[-1]) if i not in indices]
  assert skipped and all(train.example(i).prompt in exclude for i in skipped)
  assert all(train.example(i) == e for i, e in taken)


def test_held_out_filter_ignores_whitespace_differences(tmp_path):
  assert tasks.normalize_prompt(" Calculate  3 +\n4.\t") == "Calculate 3 + 4."
  path = tmp_path / "train.jsonl"
  prompts = ["Calculate  3 +\n4.", " Calculate 5 - 1. ", "Calculate 2 * 2."]
  path.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
  stream = PromptStream(build_source(dict(kind="jsonl", path=str(path))),
                        exclude=["Calculate 3 + 4.", "Calculate 5 -  1."])
  assert [(i, e.prompt) for i, e in stream.take(2)] == [(2, prompts[2]), (5, prompts[2])]
  assert stream.position == 6


def test_stream_fails_clearly_when_train_is_all_held_out():
  source = build_source(dict(kind="synthetic_arithmetic", seed=0, max_operand=0))  # only "0+0="
  with pytest.raises(ConfigError, match="held-out set"):
    PromptStream(source, exclude={"0+0="}, max_consecutive_skips=100).take(1)


# ----------------------------------------------------------------------------- templates


def test_r1zero_template_is_the_papers_text(debug_tokenizer):
  expected = (
      "A conversation between User and Assistant. The user asks a question, and the Assistant "
      "solves it. The assistant first thinks about the reasoning process in the mind and then "
      "provides the user with the answer. The reasoning process and answer are enclosed within "
      "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
      "process here </think> <answer> answer here </answer>. User: Calculate 5 - 3. "
      "Assistant:")
  template = PromptTemplate("r1zero", debug_tokenizer, unknown_tokens="allow")
  assert template.render(_example("Calculate 5 - 3")) == expected
  with pytest.raises(ConfigError, match="cannot spell"):
    PromptTemplate("r1zero", debug_tokenizer).encode(_example("Calculate 5 - 3"))


def test_plain_template_with_debug_vocab(debug_tokenizer):
  template = PromptTemplate("plain", debug_tokenizer)
  assert template.render(_example()) == "3+4="
  assert template.encode(_example()) == [debug_tokenizer.token_to_id(c) for c in "3+4="]
  braces = PromptTemplate("plain", debug_tokenizer, instruction='{"q": {prompt}} ')
  assert braces.render(_example()) == '{"q": 3+4=} '


def test_chat_template_with_smollm2(smollm2_tokenizer):
  im_start = smollm2_tokenizer.token_to_id("<|im_start|>")
  template = PromptTemplate("chat", smollm2_tokenizer, instruction="Solve: {prompt}",
                            system_prompt="Be brief.")
  text = template.render(_example("2+2"))
  assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSolve: 2+2"
                  "<|im_end|>\n<|im_start|>assistant\n")
  ids = template.encode(_example("2+2"))
  assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)
  assert ids[0] == im_start and ids.count(im_start) == 3
  assert smollm2_tokenizer.decode(ids) == text
  # No system prompt: SmolLM2's template writes its own default system message.
  assert PromptTemplate("chat", smollm2_tokenizer).render(_example("Q")).startswith(
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
  plain = PromptTemplate("plain", smollm2_tokenizer)
  assert plain.encode(_example("2+2")) == smollm2_tokenizer.encode("2+2")


def test_chat_template_that_writes_bos_gets_exactly_one(tmp_path, sentencepiece_model_path):
  # A Llama/Mistral-style tokenizer adds BOS on encode, and its chat template writes BOS too.
  source = Tokenizer.from_sentencepiece(sentencepiece_model_path).with_chat_template(
      "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
  source.save(tmp_path)
  tokenizer = Tokenizer.from_hf_dir(tmp_path)
  bos = tokenizer.bos_id
  assert tokenizer.encode("hi")[0] == bos  # this tokenizer does add BOS on its own
  template = PromptTemplate("chat", tokenizer)
  assert template.render(_example()) == "<s>[INST] 3+4= [/INST]"
  ids = template.encode(_example())
  assert ids[0] == bos and ids.count(bos) == 1
  assert ids[1:] == tokenizer.encode("[INST] 3+4= [/INST]", add_special_tokens=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kind="jinja"), "config.data.template='jinja'"),
    (dict(kind="plain", instruction="Solve it"), "config.data.instruction='Solve it'"),
    (dict(kind="plain", system_prompt="S"), "config.data.system_prompt='S'"),
    (dict(kind="chat"), "has no chat template"),
])
def test_bad_template_settings(debug_tokenizer, kwargs, message):
  kind = kwargs.pop("kind")
  with pytest.raises(ConfigError) as error:
    PromptTemplate(kind, debug_tokenizer, **kwargs)
  assert message in str(error.value)


# ----------------------------------------------------------------------------- debug vocabulary


def test_debug_tokenizer_is_character_level_with_single_tag_tokens(debug_tokenizer):
  tok = debug_tokenizer
  ids = tok.encode("<answer>12</answer>")
  assert ids == [tok.token_to_id("<answer>"), tok.token_to_id("1"), tok.token_to_id("2"),
                 tok.token_to_id("</answer>")]
  assert len(set(ids)) == 4
  for text in ["<think> 3*4 </think><answer>-12</answer>", "9-9=0", "0123456789+-*= "]:
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text) - sum(
        (len(t) - 1) * text.count(t) for t in debug_vocab.TAG_TOKENS)
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (1, 2, 0, 3)
  assert tok.eos_ids == (2,) and tok.encode("7") == [tok.token_to_id("7")]  # no BOS/EOS added
  assert tok.vocab_size == 4 + 4 + 15
  # Tags survive skip_special_tokens (the verifier reads them); <eos>/<pad> do not.
  assert tok.decode(ids + [tok.eos_id, tok.pad_id], skip_special_tokens=True) == "<answer>12</answer>"
  assert tok.decode([tok.eos_id]) == "<eos>"
  assert tok.encode("a") == [tok.unk_id]


def test_debug_tokenizer_saves_and_loads_identically(debug_tokenizer, tmp_path):
  debug_tokenizer.save(tmp_path)
  loaded = Tokenizer.from_hf_dir(tmp_path)
  for name in ("vocab_size", "bos_id", "eos_id", "eos_ids", "pad_id", "unk_id", "special_ids",
               "chat_template"):
    assert getattr(loaded, name) == getattr(debug_tokenizer, name), name
  assert [loaded.id_to_token(i) for i in range(loaded.vocab_size)] == [
      debug_tokenizer.id_to_token(i) for i in range(debug_tokenizer.vocab_size)]
  text = "<think>1+2</think> <answer>3</answer><eos>"
  assert loaded.encode(text) == debug_tokenizer.encode(text)
  assert loaded.decode(loaded.encode(text)) == text


def test_named_tokenizers(tmp_path):
  tokenizer = debug_vocab.load_named_tokenizer("debug_arithmetic")
  assert tokenizer.encode("3+4=") == debug_vocab.debug_arithmetic_tokenizer().encode("3+4=")
  with pytest.raises(ConfigError, match="config.model.tokenizer='gpt2'"):
    debug_vocab.load_named_tokenizer("gpt2")
  # a path names a tokenizer too (a random model with a real model's vocabulary)
  debug_vocab.debug_arithmetic_tokenizer().save(tmp_path)
  from_path = debug_vocab.load_named_tokenizer(str(tmp_path))
  assert from_path.vocab_size == tokenizer.vocab_size
  assert from_path.encode("3+4=") == tokenizer.encode("3+4=")


def test_debug_config_prompts_encode_with_the_debug_vocab(debug_tokenizer):
  """configs/debug_cpu.py's sources and template fit its tokenizer, within its prefill length."""
  template = PromptTemplate("plain", debug_tokenizer)
  source = build_source(dict(kind="synthetic_arithmetic", seed=0, max_operand=9))
  for index in range(100):
    ids = template.encode(source.example(index))
    assert len(ids) == 4 and debug_tokenizer.unk_id not in ids
  assert templates.TEMPLATE_KINDS == ("plain", "chat", "r1zero")


def test_mixture_weights_are_reduced_to_small_integers():
  three = [dict(kind="synthetic_arithmetic", seed=s) for s in range(3)]
  mixture = build_source(dict(kind="mixture", sources=three, weights=[5, 1, 0.5]))
  assert mixture.weights == [10, 2, 1]
  assert [sum(1 for k, _ in mixture.slots if k == s) for s in range(3)] == [10, 2, 1]
  with pytest.raises(ConfigError, match=r"config.data.weights=\[1, 1e-05\]: a weight below"):
    build_source(dict(kind="mixture", sources=three[:2], weights=[1, 1e-5]))
