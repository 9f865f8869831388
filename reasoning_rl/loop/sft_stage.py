"""The SFT stages of the R1 recipe (DeepSeek-AI 2025, §2.3), run by the same loop as RL.

- `sft`: cold-start supervised fine-tuning on {prompt, completion} JSONL traces.
- `rejection_sft`: sample from the starting model, keep the verified-correct traces (distinct
  texts; optionally only the shortest per prompt) and fine-tune on them.

The loss is next-token cross-entropy on completion tokens only (`TrainStep` with algorithm
"sft"); checkpoints are the RL stage's, so a stage starts from the previous one with
`--config.model.path=PREVIOUS_WORKDIR`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time

import jax
import numpy as np

from reasoning_rl import storage
from reasoning_rl.errors import ConfigError
from reasoning_rl.loop.parts import RunParts
from reasoning_rl.loop.rl_stage import take_examples
from reasoning_rl.loop.rollouts import RolloutCollector
from reasoning_rl.loop.state import LoopState
from reasoning_rl.rl import batching
from reasoning_rl.rl import stats as stats_lib

log = logging.getLogger("reasoning_rl")


def load_sft_rows(path: pathlib.Path) -> list[tuple[str, str]]:
  """(prompt, completion) texts of a JSONL file; a bad row raises ConfigError naming file:line."""
  if not path.is_file():
    raise ConfigError(f"{path}: no such SFT data file")
  rows = []
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except ValueError as error:
      raise ConfigError(f"{path}:{number}: not JSON ({error})") from None
    prompt = row.get("prompt", row.get("question"))
    completion = row.get("completion", row.get("response"))
    if not isinstance(prompt, str) or not isinstance(completion, str):
      raise ConfigError(f"{path}:{number}: needs string fields 'prompt' (or 'question') and "
                        "'completion' (or 'response')")
    rows.append((prompt, completion))
  return rows


class SFTStage:
  """`sft` and `rejection_sft`: `start()` prepares the (prompt, completion) pairs, `step()` trains
  on the next `sft.batch_size` of them."""

  def __init__(self, run: RunParts, collector: RolloutCollector, workdir: pathlib.Path):
    self.run = run
    self.collector = collector
    self.workdir = workdir
    self.pairs: list[tuple[list[int], list[int]]] = []

  def start(self, loop: LoopState) -> None:
    """(prompt ids, completion ids + EOS) pairs: from sft.data_path, or — for rejection_sft —
    from the verified-correct samples of the starting model (written once to the workdir, so a
    resumed run fine-tunes on the same traces)."""
    config, tokenizer = self.run.config, self.run.tokenizer
    if config.stage == "rejection_sft":
      path = self.workdir / "rejection_sampling.jsonl"
      if not path.exists():
        self._rejection_sample(path, loop)
    else:
      path = storage.path(config.sft.data_path)
    for prompt, completion in load_sft_rows(path):
      completion_ids = tokenizer.encode(completion, add_special_tokens=False)
      self.pairs.append((self.run.template.encode(prompt), completion_ids + [tokenizer.eos_id]))
    if not self.pairs:
      raise ConfigError(f"{path}: no training rows (for rejection_sft: no sampled trace was "
                        "verified correct; sample more prompts or start from a stronger model)")

  def _rejection_sample(self, path: pathlib.Path, loop: LoopState):
    """Samples rejection.num_samples completions for rejection.num_prompts training prompts and
    keeps the verified-correct ones: distinct texts, optionally only the shortest per prompt."""
    r = self.run.config.rejection
    examples = take_examples(self.run, loop, r.num_prompts)
    rollouts, _, _ = self.collector.collect(
        examples, num_samples=r.num_samples,
        # the rollout's filters (top-k / top-p / min-p) at the rejection stage's own temperature
        sampling=dataclasses.replace(self.run.sampling, temperature=r.temperature))
    rows, sampled, correct = [], 0, 0
    size = rollouts.group_size
    for g, (_, example) in enumerate(examples):
      kept = {}
      samples = slice(g * size, (g + 1) * size)
      for text, length, ok in zip(rollouts.responses[samples],
                                  rollouts.completion_ids.lengths[samples],
                                  rollouts.parts["correct"][samples]):
        sampled += 1
        if ok >= 1.0:
          correct += 1
          kept.setdefault(text, int(length))
      ordered = sorted(kept.items(), key=lambda item: (item[1], item[0]))
      if r.keep == "shortest":
        ordered = ordered[:1]
      rows += [{"prompt": example.prompt, "completion": text, "answer": example.answer,
                "task": example.task} for text, _ in ordered]
    storage.atomic_write(path, "".join(json.dumps(row) + "\n" for row in rows))
    summary = {"sampled": sampled, "correct": correct, "kept": len(rows),
               "prompts": len(examples), "keep": r.keep}
    storage.atomic_write(self.workdir / "rejection_sampling.json", json.dumps(summary, indent=2))
    log.info("rejection sampling: %s", summary)

  def step(self, step: int, state, loop: LoopState):
    """(new train state, metrics row): one SFT step over the next `sft.batch_size` pairs of a
    seeded per-epoch order."""
    del step
    c, run = self.run.config, self.run
    start = time.perf_counter()
    n = len(self.pairs)
    chosen = []
    for position in range(loop.data_position, loop.data_position + c.sft.batch_size):
      epoch, offset = divmod(position, n)
      order = np.random.default_rng([c.seed, epoch]).permutation(n)
      chosen.append(self.pairs[order[offset]])
    loop.data_position += c.sft.batch_size
    tokens, attention, completion_mask = batching.pad_rows(
        [p for p, _ in chosen], [q for _, q in chosen], num_rows=c.sft.batch_size,
        prompt_length=c.rollout.max_prefill_length, completion_length=c.rollout.max_new_tokens,
        pad_id=run.tokenizer.pad_id)
    batch = {"tokens": tokens, "attention_mask": attention, "completion_mask": completion_mask}
    state, stats = run.step_fn(state, run.step_fn.host_batch(batch, pad_id=run.tokenizer.pad_id))
    stats = stats_lib.finalize(jax.device_get(stats))
    run.weight_sync.publish(state, loop)
    truncated = np.mean([len(q) > c.rollout.max_new_tokens for _, q in chosen])
    return state, {
        "loss": stats["loss"], "nll": stats["nll"], "entropy": stats["entropy"],
        "skipped_update": stats["skipped_update"], "train/grad_norm": stats["grad_norm"],
        "train/learning_rate": stats["learning_rate"], "sft/epoch": loop.data_position / n,
        "sft/truncated_frac": float(truncated), "data_position": loop.data_position,
        "policy_version": loop.policy_version, "time/step_s": time.perf_counter() - start}

  def rollout_records(self, step: int) -> list[dict]:
    del step
    return []  # SFT samples nothing
