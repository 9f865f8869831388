"""Learned reward models: Hugging Face `*ForSequenceClassification` checkpoints scored in JAX.

What is loaded. A Hugging Face directory whose config.json names `LlamaForSequenceClassification`
or `Qwen2ForSequenceClassification` in `architectures`: the decoder body (`model.*` tensors) goes
into this project's `Transformer`, read by `checkpoints.load_hf_weights(..., lm_head=False)` (such a
checkpoint has no `lm_head.weight`); the score head `score.weight` [num_labels, hidden] is a linear
map without bias. `num_labels` is config.json's `num_labels`, else the size of its `id2label`, else
transformers' default 2; it must equal the head's rows. The tokenizer is the directory's, read by
`reasoning_rl.models.tokenizers.Tokenizer.from_hf_dir`.

The score. The reward model of Ouyang et al. 2022 ("Training language models to follow
instructions with human feedback", InstructGPT, arXiv:2203.02155, section 3.5): a language model
with its unembedding layer replaced by a scalar head, reading the hidden state of the final token:
scores[b] = score.weight · h_b, h_b the final-normed hidden state of row b at the pooled position.
Pooling follows transformers' sequence-classification forward exactly: with a `pad_token_id` in
config.json, the pooled position is the rightmost token of the right-padded row that is not
`pad_token_id` (so a row whose text ends in tokens equal to the pad id, e.g. an EOS used as
padding, is pooled before them, as transformers does); without one, the last token, and then only
one row may be scored per call (transformers refuses a larger batch).
`score_texts` takes label 0 as the reward.

Text. `score_texts(prompts, responses)` renders each pair with the tokenizer's chat template when
it has one: messages [{"role": "user", "content": prompt}, {"role": "assistant", "content":
response}], no generation prompt, encoded without adding special tokens (the template writes them).
Without a chat template it encodes the plain concatenation prompt + response, with the tokenizer's
own special tokens (BOS where the tokenizer adds one).

Compilation. Rows are right-padded to a power-of-two length (at least 16) and the batch to a power
of two of rows (at most `max_batch`; longer lists run in chunks), so a few shapes compile, not one
per batch.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reasoning_rl.errors import ConfigError
from reasoning_rl.models import checkpoints
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.safetensors_io import SafetensorsDirectory
from reasoning_rl.models.tokenizers import Tokenizer
from reasoning_rl.models.transformer import Transformer

# architectures[0] of config.json -> the model_type it must carry.
SUPPORTED_ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
}

SCORE_TENSOR = "score.weight"
MIN_LENGTH_BUCKET = 16
_TRANSFORMERS_DEFAULT_NUM_LABELS = 2  # PretrainedConfig's default when config.json names none


def _power_of_two_at_least(n: int, floor: int = 1) -> int:
  return max(floor, 1 << max(0, n - 1).bit_length())


def config_num_labels(hf: dict[str, Any]) -> int:
  """num_labels as transformers reads config.json: `num_labels`, else len(id2label), else 2."""
  if hf.get("num_labels") is not None:
    return int(hf["num_labels"])
  if hf.get("id2label"):
    return len(hf["id2label"])
  return _TRANSFORMERS_DEFAULT_NUM_LABELS


def check_architecture(hf: dict[str, Any], *, source: str) -> str:
  """The architecture named by config.json, if it is a supported sequence classifier whose
  model_type agrees with it; else ConfigError naming the field and what to load instead."""
  architectures = hf.get("architectures") or []
  name = architectures[0] if architectures else None
  supported = ", ".join(SUPPORTED_ARCHITECTURES)
  if name not in SUPPORTED_ARCHITECTURES:
    raise ConfigError(
        f"{source}: architectures {architectures!r} is not a supported reward model; a reward "
        f"model must be one of {supported} (a *ForCausalLM policy checkpoint has no score head: "
        "load it with reasoning_rl.models.load instead)")
  family = SUPPORTED_ARCHITECTURES[name]
  if hf.get("model_type") != family:
    raise ConfigError(
        f"{source}: architectures names {name} but model_type is {hf.get('model_type')!r}; "
        f"set model_type to {family!r} or fix architectures")
  return name


def _forward(graphdef, state, score, token_ids, attention_mask, pool_index):
  """Scores [B, num_labels] float32: score · final-normed hidden state at pool_index of each row."""
  model = nnx.merge(graphdef, state)
  hidden = model.hidden_states(token_ids, attention_mask)  # [B, T, D]
  pooled = jnp.take_along_axis(hidden, pool_index[:, None, None], axis=1)[:, 0]  # [B, D]
  return jnp.dot(pooled.astype(jnp.float32), score.astype(jnp.float32).T,
                 precision=jax.lax.Precision.HIGHEST)


_forward_jit = jax.jit(_forward, static_argnums=0)


@dataclasses.dataclass
class RewardModel:
  """A sequence-classification reward model: body, score head, tokenizer (see module docstring).

  Attributes:
    model: the decoder body (a `Transformer` without LM head; use `hidden_states`).
    score: the head, [num_labels, hidden] (a jax array in the model's weight dtype).
    config: the body's ModelConfig; `pad_token_id` is the pooling rule's pad id.
    tokenizer: the directory's tokenizer.
    hf_config: config.json as read.
    source: the config.json it was read from (named in errors).
    max_batch: rows per compiled call (a power of two); longer inputs are scored in chunks.
  """

  model: Transformer
  score: jax.Array
  config: ModelConfig
  tokenizer: Tokenizer | None
  hf_config: dict[str, Any]
  max_batch: int = 16
  source: str = "config.json"

  @classmethod
  def load(cls, path: str | os.PathLike, *, dtype: str = "float32", mesh=None,
           max_batch: int = 16) -> "RewardModel":
    """Loads a `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification` directory.

    Args:
      path: a Hugging Face directory (config.json, *.safetensors with `score.weight`, tokenizer
        files).
      dtype: compute and weight dtype, "float32" or "bfloat16".
      mesh: as for `reasoning_rl.models.load`: each body parameter placed on its sharding (the
        head is replicated); None: the default device.
      max_batch: the most rows one compiled call scores (rounded up to a power of two).

    Raises:
      ConfigError: config.json names another architecture, or a model_type that disagrees with
        it; `score.weight` is missing; its rows differ from config.json's num_labels, or its
        width from hidden_size.
      CheckpointError: the body's tensors or the tokenizer files are missing or damaged.
    """
    directory = pathlib.Path(path)
    config, hf = checkpoints.read_hf_config(directory)
    source = str(directory / "config.json")
    check_architecture(hf, source=source)
    num_labels = config_num_labels(hf)
    files = SafetensorsDirectory(directory)
    if SCORE_TENSOR not in files:
      raise ConfigError(
          f"{directory}: tensor {SCORE_TENSOR!r} (the score head) is missing from the safetensors "
          "files; a reward model is saved by transformers' *ForSequenceClassification."
          "save_pretrained, which writes it: re-export the checkpoint from that class")
    shape = tuple(files.shape(SCORE_TENSOR))
    if len(shape) != 2 or shape[1] != config.hidden_size:
      raise ConfigError(
          f"{directory}: {SCORE_TENSOR!r} has shape {shape}; expected [num_labels, hidden_size="
          f"{config.hidden_size}]; the head does not belong to this config.json")
    if shape[0] != num_labels:
      raise ConfigError(
          f"{source}: num_labels is {num_labels} (num_labels / id2label) but {SCORE_TENSOR!r} has "
          f"{shape[0]} rows; set num_labels (and id2label) in config.json to {shape[0]}")
    score_host = files.tensor(SCORE_TENSOR)
    checkpoints.require_finite(score_host, tensor=SCORE_TENSOR, source=files.path(SCORE_TENSOR))
    score_host = np.array(score_host, dtype=jnp.dtype(dtype), copy=True)
    del files
    tokenizer = Tokenizer.from_hf_dir(directory)
    model, _ = checkpoints.load_hf_weights(directory, dtype=dtype, mesh=mesh, lm_head=False)
    if mesh is not None:
      score = jax.device_put(score_host, jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec()))
    else:
      score = jnp.asarray(score_host)
    return cls(model=model, score=score, config=model.config, tokenizer=tokenizer, hf_config=hf,
               max_batch=_power_of_two_at_least(max_batch), source=source)

  @property
  def num_labels(self) -> int:
    return int(self.score.shape[0])

  @property
  def pad_token_id(self) -> int | None:
    """config.json's pad_token_id: what transformers pools by (not the tokenizer's pad)."""
    return self.config.pad_token_id

  # ------------------------------------------------------------------------------ scoring

  def pool_index(self, row: Sequence[int]) -> int:
    """The position transformers pools in `row`: the rightmost token that is not pad_token_id
    (0 when every token is), or the last token when config.json has no pad_token_id."""
    pad = self.pad_token_id
    if pad is None:
      return len(row) - 1
    for index in range(len(row) - 1, -1, -1):
      if row[index] != pad:
        return index
    return 0

  def score_tokens(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Scores [len(token_ids), num_labels] (float32) of unpadded rows of token ids.

    Raises:
      ConfigError: more than one row and config.json has no pad_token_id.
      ValueError: an empty row, or an id outside the vocabulary.
    """
    rows = [[int(t) for t in row] for row in token_ids]
    if not rows:
      return np.zeros((0, self.num_labels), np.float32)
    if len(rows) > 1 and self.pad_token_id is None:
      raise ConfigError(
          f"{self.source}: pad_token_id is not set, and "
          f"scoring {len(rows)} rows in a batch needs it (transformers pools each row at its last "
          "token that is not pad_token_id, and refuses batches without one); set pad_token_id in "
          "config.json to the pad id the reward model was trained with (often the tokenizer's "
          "pad or EOS id), or score one row per call")
    vocab = self.config.vocab_size
    for i, row in enumerate(rows):
      if not row:
        raise ValueError(f"score_tokens: row {i} is empty; a reward model scores ≥ 1 token")
      if min(row) < 0 or max(row) >= vocab:
        raise ValueError(f"score_tokens: row {i} holds ids outside the vocabulary [0, {vocab})")
    out = []
    for start in range(0, len(rows), self.max_batch):
      out.append(self._score_chunk(rows[start:start + self.max_batch]))
    return np.concatenate(out, axis=0)

  def _score_chunk(self, rows: list[list[int]]) -> np.ndarray:
    batch = _power_of_two_at_least(len(rows))
    length = _power_of_two_at_least(max(len(r) for r in rows), MIN_LENGTH_BUCKET)
    fill = self.pad_token_id if self.pad_token_id is not None else 0
    ids = np.full((batch, length), fill, np.int32)
    mask = np.zeros((batch, length), np.int32)
    pool = np.zeros((batch,), np.int32)
    for b, row in enumerate(rows):
      ids[b, :len(row)] = row
      mask[b, :len(row)] = 1
      pool[b] = self.pool_index(row)
    mask[len(rows):, 0] = 1  # filler rows: one real token each, scored and dropped
    graphdef, state = nnx.split(self.model)
    scores = _forward_jit(graphdef, state, self.score, ids, mask, pool)
    return np.asarray(jax.device_get(scores))[:len(rows)]

  def encode_pair(self, prompt: str, response: str) -> list[int]:
    """Token ids of one (prompt, response) pair, by the template rule of the module docstring."""
    if self.tokenizer is None:
      raise ConfigError("this reward model has no tokenizer; score token ids (score_tokens)")
    if self.tokenizer.chat_template is not None:
      text = self.tokenizer.apply_chat_template(
          [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
          add_generation_prompt=False)
      return self.tokenizer.encode(text, add_special_tokens=False)
    return self.tokenizer.encode(prompt + response, add_special_tokens=True)

  def score_texts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """The reward (label 0's score) of each (prompt, response) pair, encoded by `encode_pair`."""
    if len(prompts) != len(responses):
      raise ValueError(f"score_texts: {len(prompts)} prompts but {len(responses)} responses")
    rows = [self.encode_pair(p, r) for p, r in zip(prompts, responses)]
    return [float(s) for s in self.score_tokens(rows)[:, 0]]


__all__ = ["RewardModel", "SUPPORTED_ARCHITECTURES", "check_architecture", "config_num_labels"]
