"""The two tokenizer engines behind `Tokenizer`.

`TokenizersBackend` wraps a HF `tokenizers.Tokenizer` (tokenizer.json files and GGUF BPE vocabularies);
its post-processor decides where BOS/EOS go. `SentencePieceBackend` wraps a `sentencepiece` model and adds
BOS/EOS itself, as Llama and Mistral tokenizers do.
"""

from collections.abc import Iterable
import dataclasses
import pathlib
import re

import sentencepiece
import tokenizers
from tokenizers import processors


class TokenizersBackend:
  """A HF `tokenizers.Tokenizer`; ids are exactly what its `encode` returns."""

  def __init__(self, tokenizer: tokenizers.Tokenizer):
    self.tokenizer = tokenizer

  def set_bos_eos(self, bos: str | None, eos: str | None, *, add_bos: bool, add_eos: bool) -> None:
    """Replaces the post-processor by one that adds `bos` before and/or `eos` after each sequence."""
    used = {}
    if add_bos and bos is not None:
      used["bos"] = bos
    if add_eos and eos is not None:
      used["eos"] = eos

    def sequence_template(sequence: str, type_id: int) -> list[str]:
      parts = [f"${sequence}:{type_id}"]
      if "bos" in used:
        parts.insert(0, f"{used['bos']}:{type_id}")
      if "eos" in used:
        parts.append(f"{used['eos']}:{type_id}")
      return parts

    self.tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(sequence_template("A", 0)),
        pair=" ".join(sequence_template("A", 0) + sequence_template("B", 1)),
        special_tokens=[(token, self.tokenizer.token_to_id(token)) for token in dict.fromkeys(used.values())],
    )

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    return self.tokenizer.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.tokenizer.id_to_token(token_id)

  def special_token_ids(self) -> set[int]:
    """Ids of the added tokens flagged special (skipped by `decode(..., skip_special_tokens=True)`)."""
    return {
        token_id
        for token_id, token in self.tokenizer.get_added_tokens_decoder().items()
        if token.special
    }

  def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def save(self, directory: pathlib.Path) -> list[pathlib.Path]:
    path = directory / "tokenizer.json"
    self.tokenizer.save(str(path))
    return [path]


class SentencePieceBackend:
  """A `sentencepiece` model; BOS/EOS are added here, not by sentencepiece.

  With `parse_special_text=False` the text goes to sentencepiece as is, so `encode(text,
  add_special_tokens=False)` equals `SentencePieceProcessor.encode(text)` exactly (a literal "<s>" in
  the text is spelled out in pieces, as sentencepiece does). With `parse_special_text=True` (HF
  directories and GGUF files, whose chat templates write "<s>"/"</s>" into the prompt text) control
  and unknown pieces written in the text become their ids, and the text between them is encoded
  piece by piece — transformers' "legacy" behaviour.
  """

  def __init__(
      self, model_proto: bytes, *, add_bos: bool, add_eos: bool, parse_special_text: bool
  ):
    self.model_proto = model_proto
    self.processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    self.add_bos = add_bos
    self.add_eos = add_eos
    self.bos_id = self.processor.bos_id()
    self.eos_id = self.processor.eos_id()
    self._special_ids = {
        token_id
        for token_id in range(self.processor.get_piece_size())
        if self.processor.is_control(token_id) or self.processor.is_unknown(token_id)
    }
    self._special_pattern = None
    if parse_special_text:
      texts = sorted(
          {self.processor.id_to_piece(token_id) for token_id in self._special_ids}, key=len, reverse=True
      )
      texts = [text for text in texts if text]
      if texts:
        self._special_pattern = re.compile("|".join(re.escape(text) for text in texts))

  @classmethod
  def from_file(
      cls, path: pathlib.Path, *, add_bos: bool, add_eos: bool, parse_special_text: bool
  ) -> "SentencePieceBackend":
    return cls(
        path.read_bytes(), add_bos=add_bos, add_eos=add_eos, parse_special_text=parse_special_text
    )

  @property
  def vocab_size(self) -> int:
    return self.processor.get_piece_size()

  def token_to_id(self, token: str) -> int | None:
    token_id = self.processor.piece_to_id(token)
    # sentencepiece answers unk_id for pieces it does not know (−1 when the model has no unknown
    # piece).
    if token_id < 0 or (token_id == self.processor.unk_id()
                        and token != self.processor.id_to_piece(token_id)):
      return None
    return token_id

  def id_to_token(self, token_id: int) -> str | None:
    if not 0 <= token_id < self.vocab_size:
      return None
    return self.processor.id_to_piece(token_id)

  def special_token_ids(self) -> set[int]:
    """Ids of control and unknown pieces."""
    return set(self._special_ids)

  def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
    if self._special_pattern is None:
      ids = list(self.processor.encode(text))
    else:
      ids, start = [], 0
      for match in self._special_pattern.finditer(text):
        if match.start() > start:
          ids.extend(self.processor.encode(text[start:match.start()]))
        ids.append(self.processor.piece_to_id(match.group()))
        start = match.end()
      if start < len(text):
        ids.extend(self.processor.encode(text[start:]))
    if add_special_tokens:
      if self.add_bos and self.bos_id >= 0:
        ids.insert(0, self.bos_id)
      if self.add_eos and self.eos_id >= 0:
        ids.append(self.eos_id)
    return ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool) -> str:
    """Decodes with sentencepiece; special pieces are dropped or written out as their text."""
    ids = [int(token_id) for token_id in ids]
    if skip_special_tokens:
      return self.processor.decode([i for i in ids if i not in self._special_ids])
    parts, run = [], []
    for token_id in ids:
      if token_id in self._special_ids:
        if run:
          parts.append(self.processor.decode(run))
          run = []
        parts.append(self.processor.id_to_piece(token_id))
      else:
        run.append(token_id)
    if run:
      parts.append(self.processor.decode(run))
    return "".join(parts)

  def save(self, directory: pathlib.Path) -> list[pathlib.Path]:
    path = directory / "tokenizer.model"
    path.write_bytes(self.model_proto)
    return [path]


Backend = TokenizersBackend | SentencePieceBackend


@dataclasses.dataclass
class TokenizerParts:
  """Everything a `Tokenizer` is built from, as read from one source.

  Attributes:
    backend: the engine that maps text to ids.
    source: the file or directory it came from (named in error messages).
    bos_id / eos_id / unk_id: the source's declared ids, None when it declares none.
    pad_id: the declared padding id, None when the source declares none.
    extra_eos_ids: further stop ids the source declares (GGUF eot/eom ids, generation_config.json).
    chat_template: the jinja2 chat template, None when the source has none.
  """

  backend: Backend
  source: str
  bos_id: int | None = None
  eos_id: int | None = None
  unk_id: int | None = None
  pad_id: int | None = None
  extra_eos_ids: tuple[int, ...] = ()
  chat_template: str | None = None
