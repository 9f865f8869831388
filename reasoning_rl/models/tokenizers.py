"""One tokenizer interface over SentencePiece models, tokenizer.json directories and GGUF vocabularies.

`Tokenizer` encodes and decodes with the same ids Hugging Face transformers' `AutoTokenizer` gives for
the same source, renders chat templates the way transformers does, exposes the ids a sampler needs
(BOS, EOS and every stop id, padding) and saves itself as files transformers loads. `load_tokenizer`
picks the constructor from the path.

Sources:
- `Tokenizer.from_sentencepiece(path)`: a bare SentencePiece `.model`; `encode(text,
  add_special_tokens=False)` equals `sentencepiece.SentencePieceProcessor.encode(text)`, and
  `add_special_tokens=True` puts BOS in front, as Llama and Mistral do.
- `Tokenizer.from_hf_dir(directory)`: tokenizer.json or tokenizer.model plus their JSON configs (see
  `tokenization.hf_files`).
- `Tokenizer.from_gguf(path_or_reader)`: the vocabulary inside a GGUF file (see
  `tokenization.gguf_vocab`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import os
import pathlib
from typing import TYPE_CHECKING, Any


from reasoning_rl.errors import CheckpointError
from reasoning_rl.models.tokenization import backends
from reasoning_rl.models.tokenization import chat_template as chat_template_lib
from reasoning_rl.models.tokenization import gguf_vocab
from reasoning_rl.models.tokenization import hf_files

if TYPE_CHECKING:
  import gguf  # loaded only by a process that reads a GGUF file (tokenization.gguf_vocab)

# Tokens that close a chat turn in common templates. Models stop on them although sources often
# declare a different EOS (Qwen2: eos <|endoftext|>, turns end with <|im_end|>), so a special token
# from this list that the chat template writes is also a stop id.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")


class Tokenizer:
  """Text <-> token ids, chat templates and special ids for one model.

  Build it with `from_sentencepiece`, `from_hf_dir`, `from_gguf` or `load_tokenizer`.
  """

  def __init__(self, parts: backends.TokenizerParts):
    self._parts = parts
    self._backend = parts.backend
    self._source = parts.source
    self._bos_id = parts.bos_id
    self._eos_id = parts.eos_id
    self._unk_id = parts.unk_id
    self._declared_pad_id = parts.pad_id
    self._chat_template = parts.chat_template
    backend_special = self._backend.special_token_ids()
    end_of_turn = []
    for text in _END_OF_TURN_TOKENS:
      token_id = self._backend.token_to_id(text)
      if token_id in backend_special and self._chat_template and text in self._chat_template:
        end_of_turn.append(token_id)
    stop_ids = [self._eos_id] if self._eos_id is not None else []
    stop_ids += list(parts.extra_eos_ids) + end_of_turn
    self._eos_ids = tuple(dict.fromkeys(stop_ids))
    named = {self._bos_id, self._eos_id, self._unk_id, self._declared_pad_id} - {None}
    self._special_ids = frozenset(backend_special | named | set(self._eos_ids))

  # Constructors.

  @classmethod
  def from_sentencepiece(cls, path: str | os.PathLike) -> "Tokenizer":
    """A bare SentencePiece model file; BOS is added by `encode` unless add_special_tokens=False."""
    path = pathlib.Path(path)
    if not path.is_file():
      raise CheckpointError(f"{path}: SentencePiece model not found; pass the path of a .model file")
    try:
      backend = backends.SentencePieceBackend.from_file(
          path, add_bos=True, add_eos=False, parse_special_text=False
      )
    except (OSError, RuntimeError) as error:
      raise CheckpointError(f"{path}: not a readable SentencePiece model ({error})") from error
    processor = backend.processor

    def declared(token_id: int) -> int | None:
      return token_id if token_id >= 0 else None

    return cls(
        backends.TokenizerParts(
            backend=backend,
            source=str(path),
            bos_id=declared(processor.bos_id()),
            eos_id=declared(processor.eos_id()),
            unk_id=declared(processor.unk_id()),
            pad_id=declared(processor.pad_id()),
        )
    )

  @classmethod
  def from_hf_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
    """A Hugging Face directory: tokenizer.json or tokenizer.model plus tokenizer_config.json etc."""
    return cls(hf_files.read_hf_dir(directory))

  @classmethod
  def from_gguf(cls, source: str | os.PathLike | gguf.GGUFReader) -> "Tokenizer":
    """The vocabulary stored in a GGUF file (`gpt2` byte-level BPE or `llama` SentencePiece)."""
    return cls(gguf_vocab.read_gguf_tokenizer(source))

  # Text <-> ids.

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the source asks for them.

    Special tokens written in the text (e.g. "<|im_start|>") become their ids, as in transformers —
    except for a bare SentencePiece model, which spells them out exactly as `sentencepiece` does.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return self._backend.encode(text, add_special_tokens=add_special_tokens)

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
    """Text of `ids` (any iterable of integers, e.g. a list or a numpy/JAX vector)."""
    ids = [int(token_id) for token_id in ids]
    bad = [token_id for token_id in ids if not 0 <= token_id < self.vocab_size]
    if bad:
      raise ValueError(f"decode: ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
    return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    """The id of a vocabulary entry spelled as the vocabulary spells it, or None."""
    return self._backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    """The vocabulary entry of `token_id`, or None when out of range."""
    return self._backend.id_to_token(token_id)

  # Chat.

  def apply_chat_template(
      self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
  ) -> str:
    """Renders `messages` with the source's chat template, as transformers'
    `apply_chat_template(messages, tokenize=False, ...)` does.

    Extra keyword arguments become template variables (e.g. `enable_thinking=False`, `tools=[...]`).
    The result contains the special tokens as text; `encode(result, add_special_tokens=False)` turns
    them into their ids (templates usually write BOS themselves).

    Raises:
      CheckpointError: the source has no chat template.
    """
    if self._chat_template is None:
      raise CheckpointError(
          f"{self._source}: has no chat template; format the prompt yourself (generate.py:"
          " --no_chat_template), or use a tokenizer source that has one (tokenizer_config.json"
          " 'chat_template', chat_template.jinja, or GGUF 'tokenizer.chat_template')"
      )
    return chat_template_lib.render_chat_template(
        self._chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=self._named_special_tokens(),
        **extra,
    )

  def with_chat_template(self, template: str | None) -> "Tokenizer":
    """A tokenizer sharing this one's vocabulary whose chat template is `template`."""
    return Tokenizer(dataclasses.replace(self._parts, chat_template=template))

  # Properties.

  @property
  def source(self) -> str:
    """The file or directory this tokenizer was read from."""
    return self._source

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included (the model's embedding may be larger)."""
    return self._backend.vocab_size

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    return self._eos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every stop id: EOS, then ids declared as stops (GGUF eot/eom, generation_config.json), then
    end-of-turn tokens the chat template writes (e.g. <|im_end|>). Empty only if none is known."""
    return self._eos_ids

  @property
  def unk_id(self) -> int | None:
    return self._unk_id

  @property
  def pad_id(self) -> int | None:
    """The declared padding id; when the source declares none, EOS (padding is masked out anyway)."""
    return self._declared_pad_id if self._declared_pad_id is not None else self._eos_id

  @property
  def chat_template(self) -> str | None:
    return self._chat_template

  @property
  def special_ids(self) -> frozenset[int]:
    """Ids of special tokens: control/added-special tokens, BOS/EOS/UNK/PAD and all stop ids."""
    return self._special_ids

  # Saving.

  def save(self, directory: str | os.PathLike) -> list[pathlib.Path]:
    """Writes tokenizer files for `transformers.AutoTokenizer.from_pretrained(directory)`.

    BPE sources: tokenizer.json, tokenizer_config.json, special_tokens_map.json; SentencePiece sources:
    tokenizer.model, tokenizer_config.json, special_tokens_map.json. The chat template goes into
    tokenizer_config.json. generation_config.json (stop ids) is added only if the directory has none.

    Returns:
      The paths written.
    """
    return hf_files.write_hf_files(
        pathlib.Path(directory),
        backend=self._backend,
        special_tokens=self._named_special_tokens(),
        chat_template=self._chat_template,
        bos_id=self._bos_id,
        eos_ids=self._eos_ids,
        pad_id=self._declared_pad_id,
    )

  def _named_special_tokens(self) -> dict[str, str]:
    """Texts of the declared BOS/EOS/UNK/PAD tokens, keyed as transformers names them."""
    named = {}
    for field, token_id in (
        ("bos_token", self._bos_id),
        ("eos_token", self._eos_id),
        ("unk_token", self._unk_id),
        ("pad_token", self._declared_pad_id),
    ):
      if token_id is not None:
        named[field] = self._backend.id_to_token(token_id)
    return named

  def __repr__(self) -> str:
    return (
        f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, bos_id={self._bos_id},"
        f" eos_ids={self._eos_ids}, pad_id={self.pad_id})"
    )


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """The tokenizer at `path`: a Hugging Face directory, a tokenizer.json, a `.model` or a `.gguf` file.

  Raises:
    CheckpointError: nothing usable at `path`; the message names the file and what to pass instead.
  """
  path = pathlib.Path(path)
  if not path.exists():
    raise CheckpointError(
        f"{path}: does not exist; pass a Hugging Face model directory, a tokenizer .model or a .gguf file"
    )
  if path.is_dir():
    return Tokenizer.from_hf_dir(path)
  with path.open("rb") as file:
    is_gguf = file.read(4) == b"GGUF"  # GGUF's magic number.
  if is_gguf or path.suffix == ".gguf":
    return Tokenizer.from_gguf(path)
  # SentencePiece files are named *.model, or *.model.vN as mistral-common names its versions.
  if path.suffix == ".model" or ".model." in path.name:
    return Tokenizer.from_sentencepiece(path)
  if path.name == "tokenizer.json":
    return Tokenizer.from_hf_dir(path.parent)
  raise CheckpointError(
      f"{path}: not a tokenizer source; pass a model directory, tokenizer.json, a SentencePiece .model"
      " file or a .gguf file"
  )
