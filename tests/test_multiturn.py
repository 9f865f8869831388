"""Multi-turn episodes on the engine (`sampler.multiturn`), on a tiny random model.

The reference is the whole conversation (prompt, model turns, observations) run through the
training forward in one pass: every model token's sampled log-prob must equal the log-prob the
trainer computes there, which holds only if each observation was appended to the right cache
entries at the right positions, and the tokens a stop string cut off were forgotten.
"""

import dataclasses
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl.errors import SamplingError
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.sampler import Engine, SamplingParams
from reasoning_rl.sampler.multiturn import generate_episodes, stream_episodes
from tests.support.sampler import tiny_model


VOWELS = ("a", "e", "i", "o", "u")


class LetterTokenizer:
  """Token i reads as one letter; text encodes letter by letter. A vowel ends a model turn, so
  turns are a few tokens long under sampling (5 of 26 letters)."""

  def decode(self, ids, skip_special_tokens=False):
    return "".join(chr(ord("a") + int(i) % 26) for i in ids)

  def encode(self, text, add_special_tokens=True):
    return [ord(c) % 97 for c in text]


@dataclasses.dataclass(frozen=True)
class Turn:
  observation: str | None
  done: bool
  reward_parts: dict
  info: dict


class CountingEpisode:
  """Answers each turn with text derived from (seed, turn text); done after `turns` turns."""

  def __init__(self, turns: int, seed: int, delay_s: float = 0.0,
               gate: threading.Event | None = None):
    self.turns, self.seed, self.delay_s, self.gate, self.seen = turns, seed, delay_s, gate, []
    self.gate_opened = []  # per step: whether the gate opened (False: it waited 120 s)

  def step(self, model_text: str):
    time.sleep(self.delay_s)
    if self.gate is not None:
      self.gate_opened.append(self.gate.wait(timeout=120))
    self.seen.append(model_text)
    if len(self.seen) >= self.turns:
      return Turn(None, True, {"correct": float(len(self.seen))}, {"calls": len(self.seen)})
    return Turn(f"{len(model_text)}:{self.seed % 10}", False, {}, {"calls": len(self.seen)})


class CountingEnvironment:
  name = "counting"
  turn_stop_strings = VOWELS

  def __init__(self, delay_for: dict | None = None, gate_for: dict | None = None):
    self.delay_for = delay_for or {}  # turns -> seconds each step of such episodes sleeps
    self.gate_for = gate_for or {}  # turns -> a threading.Event each step of such episodes waits on
    self.finished, self.episodes = [], []
    self.lock = threading.Lock()

  def reset(self, example, *, seed):
    turns = example["turns"]
    episode = CountingEpisode(turns, seed, self.delay_for.get(turns, 0.0),
                              self.gate_for.get(turns))
    self.episodes.append(episode)
    return episode

  def finish(self, episode):
    with self.lock:
      self.finished.append(episode)
    return Turn(None, True, {"correct": -1.0}, {"finished_by": "rollout"})


def observation_text(observation: str) -> str:
  return f"[{observation}]"


PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 7], list(range(10, 22))]
EXAMPLES = [{"turns": 3}, {"turns": 2}, {"turns": 4}]
RUN = dict(examples=EXAMPLES, format_observation=observation_text, tokenizer=LetterTokenizer(),
           max_new_tokens=12, max_turns=6, max_total_tokens=60)


@pytest.fixture(scope="module")
def model():
  return tiny_model(3)


@pytest.fixture(scope="module")
def engine(model):
  return Engine(model, max_concurrent_decodes=3, max_prefill_length=16, max_decode_length=64,
                steps_per_call=4)


def teacher_forced(model, episodes):
  """The trainer's log-probs [N, T] and greedy tokens for the whole conversations at once."""
  prompt_len = max(len(e.prompt_tokens) for e in episodes)
  length = max(len(e.completion_ids) for e in episodes)
  tokens = np.zeros((len(episodes), prompt_len + length), np.int32)
  mask = np.zeros_like(tokens)
  for row, e in enumerate(episodes):
    tokens[row, prompt_len - len(e.prompt_tokens):prompt_len] = e.prompt_tokens
    tokens[row, prompt_len:prompt_len + len(e.completion_ids)] = e.completion_ids
    mask[row, prompt_len - len(e.prompt_tokens):prompt_len + len(e.completion_ids)] = 1
  logprobs, _ = completion_logprobs(model, jnp.asarray(tokens), jnp.asarray(mask), length)
  return np.asarray(logprobs)


def observation_spans(episode):
  """(start, end) of each run of observation tokens in the completion."""
  mask, spans, start = episode.loss_mask, [], None
  for index, bit in enumerate(mask + [1]):
    if bit == 0 and start is None:
      start = index
    if bit == 1 and start is not None:
      spans.append((start, index))
      start = None
  return spans


@pytest.fixture(scope="module")
def sampled(engine):
  environment = CountingEnvironment()
  episodes = generate_episodes(engine, PROMPTS, environment=environment, num_samples=2, seed=5,
                               sampling=SamplingParams(temperature=1.0), **RUN)
  return episodes, environment


def test_sampled_log_probs_equal_the_whole_conversation_in_one_forward(model, sampled):
  episodes, _ = sampled
  trainer = teacher_forced(model, episodes)
  appended = 0
  for row, e in enumerate(episodes):
    mask = np.asarray(e.loss_mask, bool)
    assert len(e.loss_mask) == len(e.completion_ids) == len(e.logprobs)
    np.testing.assert_allclose(np.asarray(e.logprobs)[mask], trainer[row, :len(mask)][mask],
                               atol=1e-4)
    assert np.all(np.asarray(e.logprobs)[~mask] == 0.0)
    appended += len(observation_spans(e))
  assert appended >= 6  # the check covered many appended observations


def test_turns_observations_and_outcomes(sampled):
  episodes, _ = sampled
  tokenizer = LetterTokenizer()
  for e in episodes:
    turns = EXAMPLES[e.prompt_id]["turns"]
    if e.episode_end == "done":
      assert len(e.turns) == turns and e.reward_parts == {"correct": float(turns)}
    spans = observation_spans(e)
    # Every turn but the last got its observation appended, exactly as formatted and encoded.
    assert len(spans) == len(e.turns) - 1
    for turn, (start, end) in zip(e.turns, spans):
      assert e.completion_ids[start:end] == tokenizer.encode(observation_text(turn["observation"]))
    model_text = "".join(turn["model_text"] for turn in e.turns)
    kept = [t for t, bit in zip(e.completion_ids, e.loss_mask) if bit]
    assert tokenizer.decode(kept) == model_text
    for turn in e.turns[:-1]:  # a turn that got an answer ended at a vowel (its stop string)
      if turn["finish_reason"] == "stop_string":
        assert turn["model_text"][-1] in VOWELS
        assert not any(v in turn["model_text"][:-1] for v in VOWELS)


def test_episodes_do_not_depend_on_slots_steps_per_call_or_waiting(model, sampled):
  """One slot; another number of decode steps per call (the engine draws a different number of
  tokens past a turn's stop string before the host sees it); an environment that makes one
  episode wait: the same episodes."""
  episodes, _ = sampled
  one_slot = Engine(model, max_concurrent_decodes=1, max_prefill_length=16,
                    max_decode_length=64, steps_per_call=4)
  longer_calls = Engine(model, max_concurrent_decodes=3, max_prefill_length=16,
                        max_decode_length=64, steps_per_call=7)
  slow = CountingEnvironment(delay_for={2: 0.2})
  for engine in (one_slot, longer_calls):
    again = generate_episodes(engine, PROMPTS, environment=slow, num_samples=2, seed=5,
                              sampling=SamplingParams(temperature=1.0), **RUN)
    for a, b in zip(episodes, again):
      assert a.completion_ids == b.completion_ids and a.loss_mask == b.loss_mask
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_other_slots_decode_while_an_environment_step_runs(engine):
  """Prompt 1's environment steps wait on a gate that opens only once the other prompts'
  episodes are done: they finish while its step is pending (had the loop waited for that step,
  the gate would have timed out instead)."""
  gate = threading.Event()
  environment = CountingEnvironment(gate_for={2: gate})
  order = []
  for episode in stream_episodes(engine, PROMPTS, environment=environment, num_samples=1,
                                 seed=5, sampling=SamplingParams(temperature=1.0), **RUN):
    order.append(episode.prompt_id)
    if sorted(order) == [0, 2]:
      gate.set()
  assert order[-1] == 1
  gated = [e for e in environment.episodes if e.gate is not None]
  assert gated and all(all(e.gate_opened) for e in gated) and gated[0].gate_opened


def test_limits_end_episodes_through_the_environment(engine):
  environment = CountingEnvironment()
  examples = [{"turns": 50}] * 3
  capped = generate_episodes(engine, PROMPTS, environment=environment, seed=2,
                             sampling=SamplingParams(temperature=1.0),
                             **dict(RUN, examples=examples, max_turns=2))
  for e in capped:
    assert e.episode_end in ("max_turns", "turn_budget") and len(e.turns) <= 2
    assert e.reward_parts == {"correct": -1.0}  # the environment's finish gave the outcome
  assert len(environment.finished) == 3
  tight = generate_episodes(engine, PROMPTS, environment=CountingEnvironment(), seed=2,
                            sampling=SamplingParams(temperature=1.0),
                            **dict(RUN, examples=examples, max_total_tokens=20))
  for e in tight:
    assert len(e.completion_ids) <= 20
    assert e.episode_end in ("token_budget", "turn_budget")


def test_greedy_turns_continue_the_conversation(model, engine):
  """Greedy: after each observation the model's next token is the full forward's argmax there."""
  episodes = generate_episodes(engine, PROMPTS, environment=CountingEnvironment(), seed=0,
                               sampling=SamplingParams(temperature=0.0), **RUN)
  trainer = teacher_forced(model, episodes)
  for row, e in enumerate(episodes):
    mask = np.asarray(e.loss_mask, bool)
    # A greedy token has the highest log-prob, so its own log-prob matches the trainer's.
    np.testing.assert_allclose(np.asarray(e.logprobs)[mask], trainer[row, :len(mask)][mask],
                               atol=1e-4)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_turns=0), "max_turns"),
    (dict(max_total_tokens=0), "max_total_tokens"),
    (dict(examples=EXAMPLES[:1]), "examples"),
    (dict(max_new_tokens=65), "max_new_tokens"),
])
def test_bad_arguments_raise_before_decoding(engine, kwargs, field):
  with pytest.raises(SamplingError, match=field):
    stream_episodes(engine, PROMPTS, environment=CountingEnvironment(), **dict(RUN, **kwargs))


def test_append_to_slot_refuses_what_does_not_fit(engine):
  state = engine.init_decode_state()
  with pytest.raises(SamplingError, match="no room"):
    engine.append_to_slot(engine.params, state, 0, [1] * 80, start=4, max_new_tokens=4,
                          draws_kept=0)
  with pytest.raises(SamplingError, match="empty"):
    engine.append_to_slot(engine.params, state, 0, [], start=4, max_new_tokens=4, draws_kept=0)
