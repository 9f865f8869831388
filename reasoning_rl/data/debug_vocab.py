"""A character-level vocabulary for the synthetic debug task, and the registry of named tokenizers.

`debug_arithmetic_tokenizer()` has one token per character the synthetic arithmetic task writes
(digits, "+-*=", space) and one token per reasoning tag, so a tiny random model can emit
"<answer>7</answer>" in four tokens and the math verifier has something to reward.

Token ids: 0 "<pad>", 1 "<bos>", 2 "<eos>", 3 "<unk>" (special: skipped by
`decode(..., skip_special_tokens=True)`); then the tags "<think>", "</think>", "<answer>",
"</answer>" (ordinary added tokens: kept when special tokens are skipped, because the verifier
reads them); then the characters. EOS is the only stop id; `encode` adds no BOS or EOS.
A character outside the vocabulary encodes as "<unk>".

It is built with the HF `tokenizers` library (WordLevel model, one pre-token per character, a
decoder that concatenates tokens), so `Tokenizer.save(dir)` writes a tokenizer.json that
`Tokenizer.from_hf_dir(dir)` and transformers' `AutoTokenizer` read back.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from reasoning_rl.errors import ConfigError
from reasoning_rl.models.tokenization import backends
from reasoning_rl.models.tokenizers import Tokenizer, load_tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
CHARACTERS = tuple("0123456789") + ("+", "-", "*", "=", " ")
DEBUG_SOURCE = "builtin:debug_arithmetic"


def debug_arithmetic_tokenizer() -> Tokenizer:
  """The built-in character-level tokenizer of the synthetic arithmetic task (see module doc)."""
  names = SPECIAL_TOKENS + TAG_TOKENS + CHARACTERS
  vocab = {token: token_id for token_id, token in enumerate(names)}
  hf_tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  # Every character is its own pre-token, so WordLevel maps characters one to one.
  hf_tokenizer.pre_tokenizer = pre_tokenizers.Split(
      tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  # WordLevel's default decoding joins tokens with spaces; characters must be concatenated.
  hf_tokenizer.decoder = decoders.Fuse()
  # The ids are already in the vocabulary; registering them as added tokens makes the tags and
  # specials match as whole words in text before the per-character split.
  hf_tokenizer.add_special_tokens(
      [tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
  hf_tokenizer.add_tokens(
      [tokenizers.AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
  backend = backends.TokenizersBackend(hf_tokenizer)
  backend.set_bos_eos(BOS, EOS, add_bos=False, add_eos=False)
  return Tokenizer(
      backends.TokenizerParts(
          backend=backend,
          source=DEBUG_SOURCE,
          bos_id=vocab[BOS],
          eos_id=vocab[EOS],
          unk_id=vocab[UNK],
          pad_id=vocab[PAD],
      ))


# The debug vocabulary's chat template (agent runs talk to the model in chat messages): every
# non-assistant message between <bos> and <eos>, the assistant's after <answer>, ended by <eos>.
# A conversation renders as its earlier turns followed by the new one, so agent sessions extend.
DEBUG_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<answer>{{ m.content }}<eos>"
    "{% else %}<bos>{{ m.content }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<answer>{% endif %}")


def debug_arithmetic_chat_tokenizer() -> Tokenizer:
  """The debug vocabulary with `DEBUG_CHAT_TEMPLATE`: the tiny random model behind chat
  requests (agent runs on the debug model; letters of their messages encode as <unk>)."""
  return debug_arithmetic_tokenizer().with_chat_template(DEBUG_CHAT_TEMPLATE)


NAMED_TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {
    "debug_arithmetic": debug_arithmetic_tokenizer,
    "debug_arithmetic_chat": debug_arithmetic_chat_tokenizer,
}


def load_named_tokenizer(name: str) -> Tokenizer:
  """A built-in tokenizer by name, or the tokenizer at a path (a Hugging Face directory, a
  tokenizer.json, a SentencePiece .model or a .gguf file): `config.model.tokenizer` for randomly
  initialised models.

  Raises:
    ConfigError: `name` is neither a built-in tokenizer nor an existing path.
  """
  if name not in NAMED_TOKENIZERS and pathlib.Path(name).exists():
    return load_tokenizer(name)
  if name not in NAMED_TOKENIZERS:
    raise ConfigError(
        f"config.model.tokenizer={name!r}: not a built-in tokenizer; use one of "
        f"{sorted(NAMED_TOKENIZERS)} or a tokenizer path, or set config.model.path to a model "
        "that has its own")
  return NAMED_TOKENIZERS[name]()
