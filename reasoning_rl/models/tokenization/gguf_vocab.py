"""Tokenizers rebuilt from the vocabulary stored in a GGUF file's metadata.

A GGUF file (llama.cpp's format) carries its tokenizer as `tokenizer.ggml.*` metadata: the token list,
token types, BPE merges or SentencePiece scores, the special ids, whether to add BOS, the name of the
pre-tokenizer (`tokenizer.ggml.pre`), and `tokenizer.chat_template`. Two vocabulary models are rebuilt:

- `gpt2` (byte-level BPE, e.g. SmolLM2, Llama 3, Qwen2): a HF `tokenizers` BPE over the stored vocabulary
  and merges, with the pre-tokenizer llama.cpp uses for the stored `pre` name (see
  `_BYTE_LEVEL_PRE_TOKENIZERS`). Control tokens become special added tokens and user-defined tokens plain
  added tokens, so both are matched whole in the text, as llama.cpp does.
- `llama` (SentencePiece, e.g. Llama 2, Mistral): a SentencePiece `ModelProto` rebuilt from the pieces,
  scores and types (GGUF token types use SentencePiece's numbering), read by the `sentencepiece` library.
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING, Any

from sentencepiece import sentencepiece_model_pb2
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from reasoning_rl.errors import CheckpointError
from reasoning_rl.models.tokenization import backends

if TYPE_CHECKING:
  import gguf

# The split rule of Llama 3's tokenizer (also in llama.cpp as `llama-bpe`): contractions, letter runs with
# one leading non-letter, numbers of at most three digits, punctuation runs, newlines, other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's rule: as Llama 3's, but every digit stands alone.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  # llama.cpp's `smollm`/`starcoder` rule: each numeric character alone, then GPT-2's split. It is the
  # same pre-tokenizer as in SmolLM2's own tokenizer.json.
  return pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
  ])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])


# `tokenizer.ggml.pre` -> (pre-tokenizer factory, BPE `ignore_merges`). Llama 3 looks whole words up in
# the vocabulary before merging (tiktoken's rule), which `ignore_merges` reproduces.
_BYTE_LEVEL_PRE_TOKENIZERS = {
    "gpt-2": (_gpt2_pre_tokenizer, False),
    "gpt2": (_gpt2_pre_tokenizer, False),
    # llama.cpp gives these names one rule (each numeric character alone, then GPT-2's split).
    **{
        name: (_digits_then_gpt2_pre_tokenizer, False)
        for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
    },
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), False),
}

# GGUF token types (SentencePiece's numbering; gguf.TokenType), written out so that a process
# reading no GGUF file does not load the gguf package (0.8 s: it imports mistral_common)
_CONTROL = 3
_USER_DEFINED = 4
_BYTE = 6
_MISSING = object()


class _Metadata:
  """Typed access to a GGUF reader's key/value fields, with errors that name the file."""

  def __init__(self, reader: gguf.GGUFReader, source: str):
    self._reader = reader
    self.source = source

  def get(self, key: str, default: Any = _MISSING) -> Any:
    field = self._reader.fields.get(key)
    if field is None:
      if default is _MISSING:
        raise CheckpointError(
            f"{self.source}: GGUF metadata has no {key!r}, so its tokenizer cannot be rebuilt; load the"
            " tokenizer from the model's Hugging Face directory (tokenizer.json) instead"
        )
      return default
    value = field.contents()
    return list(value) if isinstance(value, tuple) else value


def _open(source: str | os.PathLike | gguf.GGUFReader) -> tuple[gguf.GGUFReader, str]:
  import gguf  # only a process that reads a GGUF file loads the package (see _CONTROL)

  if isinstance(source, gguf.GGUFReader):
    # GGUFReader keeps no path of its own; its memory map knows the file name.
    return source, str(getattr(source.data, "filename", None) or "<GGUFReader>")
  path = pathlib.Path(source)
  if not path.is_file():
    raise CheckpointError(f"{path}: GGUF file not found; pass the path of an existing .gguf file")
  try:
    return gguf.GGUFReader(str(path)), str(path)
  except Exception as error:  # the gguf package raises ValueError, struct.error, … on bad files.
    raise CheckpointError(
        f"{path}: not a readable GGUF file ({error}); re-download or re-convert it"
    ) from error


def _byte_level_backend(metadata: _Metadata, tokens: list[str], token_types: list[int]):
  pre_name = metadata.get("tokenizer.ggml.pre", "gpt-2")
  if pre_name == "default":
    # Files without a specific rule: GPT-2's split, as transformers' GGUF loader uses for every file.
    pre_name = "gpt-2"
  if pre_name not in _BYTE_LEVEL_PRE_TOKENIZERS:
    raise CheckpointError(
        f"{metadata.source}: GGUF pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported;"
        f" supported: {sorted(_BYTE_LEVEL_PRE_TOKENIZERS)}. Load the tokenizer from the model's Hugging Face"
        " directory (tokenizer.json) instead"
    )
  make_pre_tokenizer, ignore_merges = _BYTE_LEVEL_PRE_TOKENIZERS[pre_name]
  vocab: dict[str, int] = {}
  for token_id, token in enumerate(tokens):
    if token in vocab:
      raise CheckpointError(
          f"{metadata.source}: token {token!r} appears twice in tokenizer.ggml.tokens (ids {vocab[token]}"
          f" and {token_id}); a byte-level vocabulary must be unique, load tokenizer.json instead"
      )
    vocab[token] = token_id
  merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges")]
  tokenizer = tokenizers.Tokenizer(
      models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, byte_fallback=False)
  )
  tokenizer.pre_tokenizer = make_pre_tokenizer()
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens([
      tokenizers.AddedToken(tokens[i], special=True, normalized=False)
      for i, kind in enumerate(token_types)
      if kind == _CONTROL
  ])
  tokenizer.add_tokens([
      tokenizers.AddedToken(tokens[i], special=False, normalized=False)
      for i, kind in enumerate(token_types)
      if kind == _USER_DEFINED
  ])
  return backends.TokenizersBackend(tokenizer)


def _sentencepiece_proto(
    metadata: _Metadata, tokens: list[str], token_types: list[int], special: dict[str, int | None]
) -> bytes:
  scores = metadata.get("tokenizer.ggml.scores")
  proto = sentencepiece_model_pb2.ModelProto()
  # llama.cpp's `llama` vocabulary is merged by score, i.e. SentencePiece's BPE model.
  proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
  proto.trainer_spec.vocab_size = len(tokens)
  proto.trainer_spec.byte_fallback = _BYTE in token_types
  for name in ("unk", "bos", "eos"):
    token_id = special[name]
    setattr(proto.trainer_spec, f"{name}_id", -1 if token_id is None else token_id)
    if token_id is not None:
      setattr(proto.trainer_spec, f"{name}_piece", tokens[token_id])
  proto.trainer_spec.pad_id = -1
  proto.normalizer_spec.name = "identity"
  proto.normalizer_spec.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
  proto.normalizer_spec.remove_extra_whitespaces = False
  proto.normalizer_spec.escape_whitespaces = True
  for token_id, (token, score, kind) in enumerate(zip(tokens, scores, token_types)):
    piece = proto.pieces.add()
    piece.piece = token
    piece.score = score
    # GGUF numbers token types like SentencePiece (1 normal … 6 byte); 0 means "not given".
    piece.type = kind or sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    if token_id == special["unk"]:
      # SentencePiece finds its unknown piece by type; llama.cpp's Gemma 3 files type <unk> as a
      # control token, which would leave the processor without one (unk_id() == -1).
      piece.type = sentencepiece_model_pb2.ModelProto.SentencePiece.UNKNOWN
  return proto.SerializeToString()


def read_gguf_tokenizer(source: str | os.PathLike | gguf.GGUFReader) -> backends.TokenizerParts:
  """Reads the tokenizer stored in a GGUF file (a path or an open `gguf.GGUFReader`).

  Raises:
    CheckpointError: the file is missing or unreadable, has no vocabulary, or uses a tokenizer model or
      pre-tokenizer not listed in the module docstring.
  """
  reader, name = _open(source)
  metadata = _Metadata(reader, name)
  model_name = metadata.get("tokenizer.ggml.model")
  tokens = metadata.get("tokenizer.ggml.tokens")
  token_types = [int(kind) for kind in metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
  special = {
      role: metadata.get(f"tokenizer.ggml.{key}", None)
      for role, key in (
          ("bos", "bos_token_id"),
          ("eos", "eos_token_id"),
          ("unk", "unknown_token_id"),
          ("pad", "padding_token_id"),
          ("eot", "eot_token_id"),
          ("eom", "eom_token_id"),
      )
  }
  for role, token_id in special.items():
    if token_id is not None and not 0 <= token_id < len(tokens):
      raise CheckpointError(
          f"{name}: tokenizer.ggml {role} id {token_id} is outside the vocabulary of {len(tokens)} tokens"
      )
  add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
  if model_name == "gpt2":
    backend = _byte_level_backend(metadata, tokens, token_types)
    # llama.cpp adds no BOS to a byte-level vocabulary unless the file asks for it.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    backend.set_bos_eos(
        None if special["bos"] is None else tokens[special["bos"]],
        None if special["eos"] is None else tokens[special["eos"]],
        add_bos=add_bos,
        add_eos=add_eos,
    )
  elif model_name == "llama":
    # Files written before the flag existed get BOS, as llama.cpp gives a SentencePiece vocabulary.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    backend = backends.SentencePieceBackend(
        _sentencepiece_proto(metadata, tokens, token_types, special),
        add_bos=add_bos,
        add_eos=add_eos,
        parse_special_text=True,
    )
  else:
    raise CheckpointError(
        f"{name}: GGUF tokenizer model {model_name!r} (tokenizer.ggml.model) is not supported; supported:"
        " 'gpt2' (byte-level BPE) and 'llama' (SentencePiece). Load the tokenizer from the model's Hugging"
        " Face directory (tokenizer.json or tokenizer.model) instead"
    )
  return backends.TokenizerParts(
      backend=backend,
      source=name,
      bos_id=special["bos"],
      eos_id=special["eos"],
      unk_id=special["unk"],
      pad_id=special["pad"],
      extra_eos_ids=tuple(i for i in (special["eot"], special["eom"]) if i is not None),
      chat_template=metadata.get("tokenizer.chat_template", None),
  )
