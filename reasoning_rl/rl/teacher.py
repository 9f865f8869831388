"""The teacher of on-policy distillation (`rl.distillation`, docs/distillation.md): a frozen model
that scores the student's sampled tokens.

`Teacher.score(rollouts)` adds `teacher_logprobs` to a rollout record: log π_T(y_t | prompt, y_<t)
for every completion token y_t of every sample, as sampled. It reads nothing but the record's
tokens, so it scores groups whatever produced them: a synchronous batch, one sampled ahead
(asynchronous rollouts), a partial-rollout round whose samples span several policy versions, a
LoRA student's.

The forward is the trainer's own (`rl.logprobs.completion_logprobs`, the time axis projected to the
vocabulary a chunk at a time) on rows laid out exactly as the training batch lays them out
(`batching.pad_rows`: the prompt's last `prompt_length` tokens left-padded, the completion
right-padded to `completion_length`), so the teacher sees the context the trainer's π_θ sees.
Rows go `max_batch` at a time, padded to a power of two of rows: a few shapes compile, not one per
batch. The teacher is placed where the caller loaded it (`build.build_teacher`: the sampler's
devices, like the reward models).

The same tokenizer is required: the teacher scores the student's token ids, which mean the same
text only under the same vocabulary. `check_same_vocabulary` refuses any other in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl.batching import pad_rows
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.rl.rollout_columns import Ragged, RolloutColumns


def check_same_vocabulary(student, teacher, *, field: str = "teacher.path") -> None:
  """ConfigError in one line unless tokenizers `student` and `teacher` (`models.tokenizers.
  Tokenizer`, or None for a checkpoint without tokenizer files) have the same vocabulary: the
  same size and the same token at every id. The message names both vocabularies, their sizes and
  the first id whose token differs."""
  if teacher is None:
    raise ConfigError(f"config.{field}: the teacher has no tokenizer files, so its vocabulary "
                      "cannot be checked against the student's; on-policy distillation scores "
                      "the student's token ids under the teacher, which needs the same tokenizer: "
                      "add the student's tokenizer files to the teacher's directory")
  sizes = (student.vocab_size, teacher.vocab_size)
  first = next((i for i in range(min(sizes))
                if student.id_to_token(i) != teacher.id_to_token(i)), None)
  if sizes[0] == sizes[1] and first is None:
    return
  where = (f"first difference at id {first}: student {student.id_to_token(first)!r}, teacher "
           f"{teacher.id_to_token(first)!r}" if first is not None
           else f"the first {min(sizes)} ids agree")
  raise ConfigError(
      f"config.{field}: the teacher's vocabulary ({teacher.source}, {sizes[1]} tokens) differs "
      f"from the student's ({student.source}, {sizes[0]} tokens); {where}. On-policy "
      "distillation scores the student's token ids under the teacher: use a teacher with the "
      "student's tokenizer")


def _power_of_two_at_least(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _logprobs(graphdef, state, tokens, attention_mask, completion_length, chunk_size):
  model = nnx.merge(graphdef, state)
  return completion_logprobs(model, tokens, attention_mask, completion_length,
                             chunk_size=chunk_size)[0]


_logprobs_jit = jax.jit(_logprobs, static_argnums=(0, 4, 5))


class Teacher:
  """A frozen model scoring completions token by token (module docstring).

  Args:
    model: the teacher `Transformer` (placed on its devices already).
    prompt_length, completion_length: P and T of the training batch's rows
      (`rollout.max_prefill_length`, `rollout.max_new_tokens`).
    pad_id: the token at padding positions (masked; any id of the vocabulary).
    max_batch: rows per forward (rounded up to a power of two).
    chunk_size: positions projected to the vocabulary at once (`algo.logprob_chunk`).
  """

  def __init__(self, model, *, prompt_length: int, completion_length: int, pad_id: int,
               max_batch: int = 16, chunk_size: int = 128):
    self.graphdef, self.state = nnx.split(model)
    self.vocab_size = model.config.vocab_size
    self.prompt_length = prompt_length
    self.completion_length = completion_length
    self.pad_id = pad_id
    self.max_batch = _power_of_two_at_least(max_batch)
    self.chunk_size = chunk_size

  def logprobs(self, prompts: Sequence[Sequence[int]],
               completions: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """log π_T of each completion's tokens given its prompt, one float32 array per pair."""
    for i, completion in enumerate(completions):
      if len(completion) > self.completion_length:
        raise ValueError(f"completion {i} has {len(completion)} tokens, more than the "
                         f"{self.completion_length} a row holds (rollout.max_new_tokens)")
      if len(completion) and (min(completion) < 0 or max(completion) >= self.vocab_size):
        raise ValueError(f"completion {i} holds token ids outside the teacher's vocabulary "
                         f"[0, {self.vocab_size})")
    out = []
    for start in range(0, len(completions), self.max_batch):
      chunk = slice(start, start + self.max_batch)
      out += self._score_rows(prompts[chunk], completions[chunk])
    return out

  def _score_rows(self, prompts, completions) -> list[np.ndarray]:
    rows = _power_of_two_at_least(len(completions))
    tokens, attention, _ = pad_rows(prompts, completions, num_rows=rows,
                                    prompt_length=self.prompt_length,
                                    completion_length=self.completion_length, pad_id=self.pad_id)
    logprobs = np.asarray(jax.device_get(_logprobs_jit(
        self.graphdef, self.state, tokens, attention, self.completion_length, self.chunk_size)))
    return [logprobs[row, :len(completion)].astype(np.float32)
            for row, completion in enumerate(completions)]

  def score(self, rollouts: RolloutColumns) -> RolloutColumns:
    """`rollouts` with `teacher_logprobs`: the teacher's log-prob of every completion token."""
    if not rollouts.num_samples:
      return rollouts
    prompts = rollouts.prompt_tokens.rows()
    completions = rollouts.completion_ids.rows()
    scored = self.logprobs([prompts[s // rollouts.group_size] for s in range(len(completions))],
                           completions)
    return rollouts.with_teacher_logprobs(Ragged.from_rows(scored, np.float32))
