"""Tokenizer layer: ids, decoding and chat templates against transformers and sentencepiece.

References are independent implementations: transformers' `AutoTokenizer` (its own GGUF converter and
tokenizer.json loader) and the `sentencepiece` library on the original model file.
"""

import json

import gguf
import jinja2
import pytest
import sentencepiece
from sentencepiece import sentencepiece_model_pb2
import tokenizers
import tokenizers.processors

from reasoning_rl.errors import CheckpointError
from reasoning_rl.models.tokenization import gguf_vocab
from reasoning_rl.models.tokenizers import Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

# Digits, accents, CJK, emoji, whitespace runs, tabs, newlines, R1-style tags and chat special tokens.
TEXTS = [
    "Hello world",
    "12345 + 678 = 13023, pi is 3.14159 and 2024-06-01",
    "Café naïve résumé über façade",
    "東京タワーは333メートルです。中文测试",
    "emoji 🤖🎉👍🏽 and ZWJ 👩‍💻",
    "  two  spaces,\n\nblank line\ttab\t\t and trailing   ",
    "<think>2 + 2 is 4</think><answer>42</answer>",
    "<|im_start|>user\nWhat is 7*6?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after end<repo_name>",
    "",
    " ",
    "\n",
]

SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 17 * 23? Think in <think></think> tags."},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "Café ☕ costs 3.50€ — is 2×3.50 = 7?"},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
  return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf_path):
  return transformers.AutoTokenizer.from_pretrained(
      str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name
  )


@pytest.fixture(scope="module")
def smollm2_saved_dir(smollm2, tmp_path_factory):
  directory = tmp_path_factory.mktemp("smollm2_tokenizer")
  smollm2.save(directory)
  return directory


# GGUF (SmolLM2, byte-level BPE).


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_transformers(smollm2, smollm2_reference, text):
  assert smollm2.encode(text) == smollm2_reference.encode(text)
  assert smollm2.encode(text, add_special_tokens=False) == smollm2_reference.encode(
      text, add_special_tokens=False
  )


def test_gguf_special_tokens_in_text_become_single_ids(smollm2):
  ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>\n")
  assert ids[0] == smollm2.token_to_id("<|im_start|>") == 1
  assert ids[-2] == smollm2.token_to_id("<|im_end|>") == 2
  # SmolLM2's GGUF says add_bos_token = false: nothing is prepended.
  assert smollm2.encode("Hello world") == [19556, 905]


def test_gguf_numerals_follow_the_smollm_pre_tokenizer(smollm2):
  # llama.cpp's `smollm` rule isolates every numeric character (\p{N}, e.g. "²", "½") before GPT-2's
  # split, as SmolLM2's own tokenizer.json does. transformers' GGUF loader ignores the rule and would
  # give "Ġ" + "½" as "ĠÂ", "½"; ASCII digits are unaffected (the test above).
  pieces = [smollm2.id_to_token(i) for i in smollm2.encode("x² ½")]
  assert pieces == ["x", "Â²", "Ġ", "Â½"]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_round_trip_matches_transformers(smollm2, smollm2_reference, text):
  ids = smollm2.encode(text)
  assert smollm2.decode(ids) == text == smollm2_reference.decode(ids)
  assert smollm2.decode(ids, skip_special_tokens=True) == smollm2_reference.decode(
      ids, skip_special_tokens=True
  )


@pytest.mark.parametrize("messages", [SYSTEM_AND_USER, MULTI_TURN], ids=["system_user", "multi_turn"])
def test_gguf_chat_template_matches_transformers(smollm2, smollm2_reference, messages):
  expected = smollm2_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert smollm2.apply_chat_template(messages) == expected
  assert smollm2.apply_chat_template(messages, add_generation_prompt=False) == (
      smollm2_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
  )
  assert expected.endswith("<|im_start|>assistant\n")


def test_gguf_special_ids(smollm2, smollm2_reference):
  assert smollm2.vocab_size == len(smollm2_reference) == 49152
  assert smollm2.bos_id == smollm2_reference.bos_token_id == 1
  assert smollm2.eos_id == smollm2_reference.eos_token_id == 2
  assert smollm2.token_to_id("<|im_end|>") in smollm2.eos_ids
  assert smollm2.pad_id == 2  # Declared by tokenizer.ggml.padding_token_id.
  # The 17 control tokens of the file (<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, …).
  assert smollm2.special_ids == frozenset(range(17))
  assert set(smollm2_reference.all_special_ids) <= smollm2.special_ids
  assert smollm2.chat_template == smollm2_reference.chat_template


def test_chat_template_environment_matches_transformers(smollm2, smollm2_reference):
  # Exercises trim_blocks/lstrip_blocks, loopcontrols, tojson (no ASCII/HTML escaping), namespace,
  # special-token variables, extra variables and strftime_now.
  template = (
      "{{ bos_token }}{% set ns = namespace(n=0) %}\n"
      "  {% for m in messages %}\n"
      "    {% if m['role'] == 'assistant' %}{% continue %}{% endif %}\n"
      "    {% set ns.n = ns.n + 1 %}\n"
      "{{ m['role'] }}: {{ m | tojson }}\n"
      "    {% if loop.index >= 4 %}{% break %}{% endif %}\n"
      "  {% endfor %}\n"
      "n={{ ns.n }} eos={{ eos_token }} pad={{ pad_token }} flag={{ flavour }}"
      " year={{ strftime_now('%Y') | length }}\n"
      "{% if add_generation_prompt %}<gen>{% endif %}"
  )
  messages = MULTI_TURN + [
      {"role": "user", "content": "<b>&'ünï\"</b>"},
      {"role": "user", "content": "after the break"},
  ]
  expected = smollm2_reference.apply_chat_template(
      messages, chat_template=template, tokenize=False, add_generation_prompt=True, flavour="mint"
  )
  tokenizer = smollm2.with_chat_template(template)
  assert tokenizer.apply_chat_template(messages, flavour="mint") == expected
  assert '"<b>&\'ünï\\"</b>"' in expected and "after the break" not in expected


def test_chat_template_raise_exception(smollm2):
  tokenizer = smollm2.with_chat_template("{{ raise_exception('roles must alternate') }}")
  with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
    tokenizer.apply_chat_template(MULTI_TURN)


def test_chat_template_rejects_non_dict_messages(smollm2):
  with pytest.raises(TypeError, match=r"messages\[1\]"):
    smollm2.apply_chat_template([{"role": "user", "content": "x"}, "not a message"])


# tokenizer.json written by save().


def test_saved_tokenizer_json_loads_identically(smollm2, smollm2_saved_dir):
  assert sorted(p.name for p in smollm2_saved_dir.iterdir()) == [
      "generation_config.json",
      "special_tokens_map.json",
      "tokenizer.json",
      "tokenizer_config.json",
  ]
  ours = Tokenizer.from_hf_dir(smollm2_saved_dir)
  reference = transformers.AutoTokenizer.from_pretrained(str(smollm2_saved_dir))
  for text in TEXTS:
    assert ours.encode(text) == reference.encode(text) == smollm2.encode(text), text
    assert ours.decode(ours.encode(text)) == text
  for messages in (SYSTEM_AND_USER, MULTI_TURN):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected == smollm2.apply_chat_template(messages)
  assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.special_ids) == (
      smollm2.bos_id,
      smollm2.eos_ids,
      smollm2.pad_id,
      smollm2.special_ids,
  )
  assert load_tokenizer(smollm2_saved_dir / "tokenizer.json").encode(TEXTS[1]) == smollm2.encode(TEXTS[1])


def test_hf_dir_stop_ids_from_generation_config_and_template(smollm2_saved_dir, tmp_path):
  # A Qwen-like source: EOS is <|endoftext|>, turns end with <|im_end|> (written by the template),
  # and generation_config.json adds a further stop id.
  for name in ("tokenizer.json", "special_tokens_map.json"):
    (tmp_path / name).write_bytes((smollm2_saved_dir / name).read_bytes())
  config = json.loads((smollm2_saved_dir / "tokenizer_config.json").read_text())
  config["eos_token"] = "<|endoftext|>"
  del config["pad_token"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
  special_map = json.loads((tmp_path / "special_tokens_map.json").read_text())
  del special_map["pad_token"]
  (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))
  tokenizer = Tokenizer.from_hf_dir(tmp_path)
  assert tokenizer.eos_id == 0
  assert tokenizer.eos_ids == (0, 5, 2)
  assert tokenizer.pad_id == 0  # No pad token declared: falls back to EOS.


def test_hf_dir_bos_follows_tokenizer_json_post_processor(smollm2_saved_dir, tmp_path):
  # As in transformers 5: with tokenizer.json, its post-processor decides and the config's
  # add_bos_token is ignored.
  backend = tokenizers.Tokenizer.from_file(str(smollm2_saved_dir / "tokenizer.json"))
  backend.post_processor = tokenizers.processors.TemplateProcessing(
      single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
  )
  backend.save(str(tmp_path / "tokenizer.json"))
  config = json.loads((smollm2_saved_dir / "tokenizer_config.json").read_text())
  config["add_bos_token"] = False
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  ours = Tokenizer.from_hf_dir(tmp_path)
  reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert ours.encode("Hello world") == reference.encode("Hello world") == [0, 19556, 905]
  assert ours.encode("Hello world", add_special_tokens=False) == [19556, 905]


# SentencePiece.


@pytest.fixture(scope="module")
def spm_reference(sentencepiece_model_path):
  return sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model_path))


@pytest.fixture(scope="module")
def mistral(sentencepiece_model_path):
  return load_tokenizer(sentencepiece_model_path)


SPM_TEXTS = TEXTS + [
    "[INST] What is 2+2? [/INST]",
    "a<s>b</s>c <unk>",
    "\x00\x07 control bytes \x7f and zero\u200bwidth",
    "    def f(x):\n        return x ** 2\n",
]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_ids_match_library(mistral, spm_reference, text):
  expected = spm_reference.encode(text)
  assert mistral.encode(text, add_special_tokens=False) == expected
  assert mistral.encode(text) == [spm_reference.bos_id()] + expected
  assert mistral.decode(expected) == text == spm_reference.decode(expected)
  assert mistral.decode(mistral.encode(text), skip_special_tokens=True) == text


def test_sentencepiece_special_ids_and_decode_of_control_tokens(mistral):
  assert (mistral.vocab_size, mistral.bos_id, mistral.eos_id, mistral.unk_id) == (32000, 1, 2, 0)
  assert mistral.eos_ids == (2,)
  assert mistral.pad_id == 2  # The model declares no padding piece.
  assert mistral.special_ids == frozenset({0, 1, 2})
  assert mistral.decode([1, 22557, 1526, 2]) == "<s>Hello world</s>"
  assert mistral.chat_template is None
  with pytest.raises(CheckpointError, match="tokenizer.model.v1: has no chat template"):
    mistral.apply_chat_template(MULTI_TURN)


def test_sentencepiece_save_loads_in_transformers_and_back(mistral, tmp_path):
  mistral.save(tmp_path)
  assert (tmp_path / "tokenizer.model").is_file()
  ours = Tokenizer.from_hf_dir(tmp_path)
  reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  # transformers rebuilds a BPE from tokenizer.model that splits runs of spaces differently from
  # sentencepiece, so the comparison uses text without them (ours equals sentencepiece, above).
  for text in [t for t in SPM_TEXTS if "  " not in t and t != " "]:
    assert ours.encode(text) == reference.encode(text), text
  # In a directory, "<s>" written in the text is a token, as in transformers.
  assert ours.encode("a<s>b") == [1, 264, 1, 287]


def test_gguf_llama_vocabulary_matches_sentencepiece(sentencepiece_model_path, spm_reference, tmp_path):
  # A GGUF holding Mistral's SentencePiece vocabulary, written the way llama.cpp's converter writes it.
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(sentencepiece_model_path.read_bytes())
  path = tmp_path / "mistral_vocab.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tokenizer_model("llama")
  writer.add_token_list([piece.piece for piece in proto.pieces])
  writer.add_token_scores([piece.score for piece in proto.pieces])
  writer.add_token_types([piece.type for piece in proto.pieces])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_unk_token_id(0)
  writer.add_add_bos_token(True)
  writer.add_chat_template(
      "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
  )
  _write(writer)

  tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
  assert tokenizer.source == str(path)
  for text in SPM_TEXTS:
    if "<s>" not in text and "<unk>" not in text:
      assert tokenizer.encode(text) == [1] + spm_reference.encode(text), text
  assert tokenizer.encode("a<s>b", add_special_tokens=False) == [264, 1, 287]
  assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"


def test_gguf_byte_level_flags_and_token_types(tmp_path):
  # A tiny byte-level vocabulary: BOS/EOS requested by the file, a control token and a user-defined one.
  path = tmp_path / "tiny.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("gpt-2")
  writer.add_token_list(["<s>", "</s>", "a", "b", "ab", "<think>"])
  writer.add_token_types([3, 3, 1, 1, 1, 4])
  writer.add_token_merges(["a b"])
  writer.add_bos_token_id(0)
  writer.add_eos_token_id(1)
  writer.add_add_bos_token(True)
  writer.add_add_eos_token(True)
  _write(writer)
  tokenizer = Tokenizer.from_gguf(path)
  assert tokenizer.encode("abba") == [0, 4, 3, 2, 1]
  assert tokenizer.encode("b<think>ab", add_special_tokens=False) == [3, 5, 4]
  # <think> is user-defined: matched whole, but not special, so it survives skip_special_tokens.
  assert tokenizer.special_ids == frozenset({0, 1})
  assert tokenizer.decode([0, 5, 4, 1], skip_special_tokens=True) == "<think>ab"
  assert tokenizer.pad_id == 1  # No padding id in the file: EOS.


def test_gguf_token_type_numbers_are_the_gguf_packages():
  # gguf_vocab writes them out so that a process reading no GGUF file never imports gguf
  from reasoning_rl.models.tokenization import gguf_vocab

  assert (gguf_vocab._CONTROL, gguf_vocab._USER_DEFINED, gguf_vocab._BYTE) == (
      gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED, gguf.TokenType.BYTE)


# The pre-tokenizers chosen by `tokenizer.ggml.pre`, against splits worked out by hand from each rule.


@pytest.mark.parametrize(
    "pre_name, expected",
    [
        ("gpt-2", ["Hello", "Ġ", "Ġworld", "Ġ2024", "!", "ĠI", "'", "M"]),
        ("smollm", ["Hello", "Ġ", "Ġworld", "Ġ", "2", "0", "2", "4", "!", "ĠI", "'", "M"]),
        ("llama-bpe", ["Hello", "Ġ", "Ġworld", "Ġ", "202", "4", "!", "ĠI", "'M"]),
        ("qwen2", ["Hello", "Ġ", "Ġworld", "Ġ", "2", "0", "2", "4", "!", "ĠI", "'M"]),
    ],
)
def test_gguf_pre_tokenizer_splits(pre_name, expected):
  make_pre_tokenizer, _ = gguf_vocab._BYTE_LEVEL_PRE_TOKENIZERS[pre_name]
  pieces = [piece for piece, _ in make_pre_tokenizer().pre_tokenize_str("Hello  world 2024! I'M")]
  assert pieces == expected


# Bad input.


def test_missing_sources_name_the_file(tmp_path):
  with pytest.raises(CheckpointError, match="nope.gguf: does not exist"):
    load_tokenizer(tmp_path / "nope.gguf")
  with pytest.raises(CheckpointError, match="nope.gguf: GGUF file not found"):
    Tokenizer.from_gguf(tmp_path / "nope.gguf")
  with pytest.raises(CheckpointError, match="x.model: SentencePiece model not found"):
    Tokenizer.from_sentencepiece(tmp_path / "x.model")
  with pytest.raises(CheckpointError, match="neither tokenizer.json nor tokenizer.model"):
    load_tokenizer(tmp_path)
  (tmp_path / "notes.txt").write_text("hello")
  with pytest.raises(CheckpointError, match="notes.txt: not a tokenizer source"):
    load_tokenizer(tmp_path / "notes.txt")
  (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
  with pytest.raises(CheckpointError, match="broken.gguf: not a readable GGUF file"):
    load_tokenizer(tmp_path / "broken.gguf")
  (tmp_path / "broken.model").write_bytes(b"\x00not a protobuf")
  with pytest.raises(CheckpointError, match="broken.model: not a readable SentencePiece model"):
    load_tokenizer(tmp_path / "broken.model")


def test_unsupported_gguf_tokenizers_name_the_file(tmp_path):
  bert = tmp_path / "bert.gguf"
  writer = gguf.GGUFWriter(str(bert), "bert")
  writer.add_tokenizer_model("bert")
  writer.add_token_list(["[PAD]", "[UNK]", "hello"])
  _write(writer)
  with pytest.raises(CheckpointError, match=r"bert.gguf: GGUF tokenizer model 'bert'.*not supported"):
    load_tokenizer(bert)

  odd_pre = tmp_path / "odd_pre.gguf"
  writer = gguf.GGUFWriter(str(odd_pre), "llama")
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("made-up")
  writer.add_token_list(["a", "b", "ab"])
  writer.add_token_merges(["a b"])
  _write(writer)
  with pytest.raises(CheckpointError, match=r"odd_pre.gguf: GGUF pre-tokenizer 'made-up'"):
    Tokenizer.from_gguf(odd_pre)

  no_vocab = tmp_path / "no_vocab.gguf"
  writer = gguf.GGUFWriter(str(no_vocab), "llama")
  _write(writer)
  with pytest.raises(CheckpointError, match=r"no_vocab.gguf: GGUF metadata has no 'tokenizer.ggml.model'"):
    Tokenizer.from_gguf(no_vocab)


def test_hf_dir_with_unknown_special_token_names_the_field(smollm2_saved_dir, tmp_path):
  (tmp_path / "tokenizer.json").write_bytes((smollm2_saved_dir / "tokenizer.json").read_bytes())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not_there|>"}))
  with pytest.raises(CheckpointError, match=r"tokenizer_config.json: eos_token '<\|not_there\|>'"):
    Tokenizer.from_hf_dir(tmp_path)


def test_decode_rejects_out_of_range_ids(smollm2):
  with pytest.raises(ValueError, match=r"ids \[49152\]"):
    smollm2.decode([5, 49152])


def _write(writer: gguf.GGUFWriter) -> None:
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
