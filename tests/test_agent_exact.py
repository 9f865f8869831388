"""Exact agent turns (`rollout.exact_logprobs` with `agent.entry`, reasoning_rl/agents/exact_turns.py)
through the real `openai` client: the tokens an agent receives are canonical draws and the
recorded log-probs the canonical forward's, bit for bit, whatever the episode was decoded beside.

References: the run's `CanonicalScorer` applied turn by turn to the recorded episode (bitwise,
int32 views of the float32 log-probs), the trainer's `completion_logprobs` over the whole row
(up to rounding), and plain autoregressive Gumbel-max sampling from the policy's own forward one
token at a time (a JAX/numpy loop) for a draft engine whose weights differ.
"""

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from reasoning_rl import config as config_lib
from reasoning_rl.agents.driver import EngineDriver
from reasoning_rl.agents.exact_turns import ExactTurns
from reasoning_rl.agents.server import RolloutServer
from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.transformer import create_model
from reasoning_rl.rl.logprobs import completion_logprobs
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.exact import CanonicalScorer
from reasoning_rl.sampler.sampling import SamplingParams, sample_key
from tests.support.agents import DIGIT_TOOLS_TEMPLATE
from tests.support.configs import debug_config
from tests.support.runs import train
from tests.support.sampler import CONFIG, perturbed

SEED = 3
PROMPT_LENGTH, NEW_TOKENS = 64, 64  # the trained row's budgets (max_prefill_length, max_new_tokens)
SAMPLING = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.8, top_k=20)

TOOLS = [{"type": "function", "function": {"name": "12", "parameters": {}}}]


def bits(x):
  return np.asarray(x, np.float32).view(np.int32)


def policy_model(vocab_size, extra_noise=0.0):
  model = perturbed(create_model(dataclasses.replace(CONFIG, vocab_size=vocab_size), seed=0), 0)
  if extra_noise:  # a draft: every weight moved by N(0, extra_noise²)
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(
        lambda x: x + extra_noise * jax.random.normal(next(keys), x.shape), state))
  return model


def exact_server(model, tokenizer, sampling, *, target_params=None, max_tokens=5,
                 tool_syntax="", prompt_length=PROMPT_LENGTH, new_tokens=NEW_TOKENS):
  """An engine sized as an agent run sizes it (prefill: the prompt plus the episode's tokens),
  the run's one scorer over that layout, and a server that verifies every turn."""
  engine = Engine(model, max_concurrent_decodes=4, max_prefill_length=prompt_length + new_tokens,
                  max_decode_length=new_tokens, steps_per_call=3)
  scorer = CanonicalScorer(nnx.graphdef(model), max_prompt_length=prompt_length + new_tokens,
                           max_completion_length=new_tokens)
  driver = EngineDriver(engine, tokenizer=tokenizer)
  exact = ExactTurns(driver, scorer, tokenizer=tokenizer, target_params=target_params)
  server = RolloutServer(driver, tokenizer, sampling=sampling, max_tokens=max_tokens,
                         max_session_tokens=new_tokens, max_segment_prompt=prompt_length,
                         seed=SEED, tool_syntax=tool_syntax, exact=exact)
  return server, driver, exact, scorer, engine


@pytest.fixture(scope="module")
def served():
  tokenizer = debug_arithmetic_tokenizer().with_chat_template(DIGIT_TOOLS_TEMPLATE)
  model = policy_model(tokenizer.vocab_size)
  server, driver, exact, scorer, engine = exact_server(model, tokenizer, WARPED,
                                                       tool_syntax="hermes")
  yield model, tokenizer, server, driver, exact, scorer, engine
  server.stop()
  driver.stop()
  exact.close()


async def tool_episode(server, driver, position, question):
  """Episode 0 of data position `position`: the question, the model's reply, a tool call the
  client made and its result, the model's second reply, a user turn and a third reply."""
  session = f"p{position}"
  driver.own_episode(session, seed=SEED, prompt_id=position, sample_index=0)
  client = openai.AsyncOpenAI(base_url=server.session_url(session), api_key="local",
                              max_retries=0)
  try:
    messages = [{"role": "user", "content": question}]
    replies = []
    for follow_up in ("tool", "user", None):
      reply = await client.chat.completions.create(model="policy", messages=messages,
                                                   tools=TOOLS, max_tokens=4)
      replies.append(reply.choices[0])
      message = {"role": "assistant", "content": reply.choices[0].message.content}
      if follow_up == "tool":
        message["tool_calls"] = [{"id": "call_1", "type": "function",
                                  "function": {"name": "12", "arguments": '{"a": 5}'}}]
        messages += [message, {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
      elif follow_up == "user":
        messages += [message, {"role": "user", "content": "1+1"}]
  finally:
    await client.close()
    driver.release_episode(session)
  return replies, server.pop_session(session)


def turns_of(session):
  """(segment, prompt, completion, first draw) of every turn of the session, in order: its
  prompt the segment's tokens before it, its first draw the episode's model tokens before it."""
  out, drawn = [], 0
  for segment in session.segments:
    positions = np.flatnonzero(np.asarray(segment.loss_mask) == 1)
    at = 0
    for turn in segment.turns:
      start = int(positions[at])
      n = turn["num_tokens"]
      assert positions[at + n - 1] == start + n - 1  # a turn's tokens are contiguous
      out.append((segment, segment.prompt_tokens + segment.tokens[:start],
                  segment.tokens[start:start + n], drawn))
      drawn += n
      at += n
  return out


def test_exact_turns_are_the_canonical_forwards_whatever_the_batch(served):
  model, tokenizer, server, driver, exact, scorer, engine = served
  questions = ["2+3", "45+6", "7*8", "9-1", "3*3"]

  async def together():
    return await asyncio.gather(*(tool_episode(server, driver, p, q)
                                  for p, q in enumerate(questions)))

  exact.take_stats()
  alone_replies, alone = asyncio.run(tool_episode(server, driver, 0, questions[0]))
  assert exact.take_stats()["sequences"] == 3
  driver.most_live = 0
  episodes = asyncio.run(together())
  assert driver.most_live >= 2  # the episodes shared decode batches
  stats = exact.take_stats()
  # the decode path's log-probs did differ from the canonical ones: there was something to fix
  assert stats["sequences"] == 3 * len(questions) and stats["draft_mismatch_max"] > 0
  replies, batched = episodes[0]

  # what the client received is what the session recorded
  for session, received in ((alone, alone_replies), (batched, replies)):
    turns = turns_of(session)
    assert [t[2] for t in turns] == [r.model_extra["token_ids"] for r in received]
  # the episode alone and beside four others: the same tokens, the same log-probs bit for bit
  assert len(alone.segments) == len(batched.segments)
  for a, b in zip(alone.segments, batched.segments):
    assert (a.prompt_tokens, a.tokens, a.loss_mask) == (b.prompt_tokens, b.tokens, b.loss_mask)
    np.testing.assert_array_equal(bits(a.logprobs), bits(b.logprobs))
    np.testing.assert_array_equal(bits(a.sampling_logprobs), bits(b.sampling_logprobs))

  params = engine.params
  for _, session in [(None, alone)] + episodes[1:]:
    turns = turns_of(session)
    assert len(turns) == 3
    key = sample_key(SEED, int(session.id[1:]), 0)
    for segment, prompt, completion, first_draw in turns:
      # the run's scorer, turn by turn over the recorded episode, with the episode's draw numbers
      scores = scorer.score(params, [prompt], [completion], [key], WARPED,
                            first_draws=[first_draw])
      n, start = len(completion), len(prompt) - len(segment.prompt_tokens)
      np.testing.assert_array_equal(bits(segment.logprobs[start:start + n]),
                                    bits(scores.logprobs[0, :n]))
      np.testing.assert_array_equal(bits(segment.sampling_logprobs[start:start + n]),
                                    bits(scores.sampling_logprobs[0, :n]))
      assert scores.draws[0, :n].tolist() == completion  # each token the canonical draw
    for segment in session.segments:
      # the trainer's own forward over the whole row, at the model's tokens
      row = jnp.asarray([segment.prompt_tokens + segment.tokens])
      trainer, _ = completion_logprobs(model, row, jnp.ones_like(row), len(segment.tokens))
      mask = np.asarray(segment.loss_mask, bool)
      np.testing.assert_allclose(np.asarray(segment.logprobs)[mask],
                                 np.asarray(trainer[0])[mask], atol=2e-5)
      assert np.all(np.asarray(segment.logprobs)[~mask] == 0)


def test_a_context_longer_than_the_exact_layout_is_refused_naming_the_field(served):
  _, tokenizer, server, _, _, scorer, _ = served

  async def ask():
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="local", max_retries=0)
    try:
      await client.completions.create(model="policy", prompt=[5] * (scorer.max_prompt_length + 1),
                                      max_tokens=2)
    finally:
      await client.close()

  with pytest.raises(openai.BadRequestError, match=r"rollout\.max_prefill_length"):
    asyncio.run(ask())


REFERENCE_LENGTH = 48


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def reference_sample(model, prompt, key, first_draw, *, max_tokens, stop_ids):
  """Autoregressive Gumbel-max sampling from the policy's own forward at temperature 1, one
  token per forward: token t = argmax(logits + Gumbel noise of fold_in(key, first_draw + t)).
  (Each forward runs over the sequence right-padded to REFERENCE_LENGTH: causal attention, so
  the logits after the last real token are the sequence's own.)"""
  tokens = []
  while len(tokens) < max_tokens:
    sequence = list(prompt) + tokens
    padded = jnp.asarray([sequence + [0] * (REFERENCE_LENGTH - len(sequence))])
    logits = np.asarray(_forward(model, padded), np.float32)[0, len(sequence) - 1]
    noise = np.asarray(jax.random.gumbel(jax.random.fold_in(key, first_draw + len(tokens)),
                                         logits.shape), np.float32)
    tokens.append(int(np.argmax(logits + noise)))
    if tokens[-1] in stop_ids:
      break
  return tokens


def test_a_wrong_draft_engine_still_serves_exact_samples():
  tokenizer = debug_arithmetic_tokenizer()
  policy = policy_model(tokenizer.vocab_size)
  draft = policy_model(tokenizer.vocab_size, extra_noise=0.05)
  server, driver, exact, _, _ = exact_server(draft, tokenizer, SAMPLING,
                                             target_params=nnx.state(policy), prompt_length=16,
                                             new_tokens=32)
  prompts = [tokenizer.encode(f"<bos>{q}<eos><answer>", add_special_tokens=False)
             for q in ("2+3", "45+6", "7*8", "9-1")]
  context = tokenizer.encode("<eos><bos>5<eos><answer>", add_special_tokens=False)

  async def episode(position):
    session = f"draft{position}"
    driver.own_episode(session, seed=SEED, prompt_id=position, sample_index=1)
    client = openai.AsyncOpenAI(base_url=server.session_url(session), api_key="local",
                                max_retries=0)
    try:
      first = await client.completions.create(model="policy", prompt=prompts[position],
                                              max_tokens=7)
      turn_1 = first.choices[0].model_extra["token_ids"]
      second = await client.completions.create(
          model="policy", prompt=prompts[position] + turn_1 + context, max_tokens=7)
      return turn_1, second.choices[0].model_extra["token_ids"]
    finally:
      await client.close()
      driver.release_episode(session)

  async def all_episodes():
    return await asyncio.gather(*(episode(p) for p in range(len(prompts))))

  try:
    served_turns = asyncio.run(all_episodes())
    stats = exact.take_stats()
  finally:
    server.stop()
    driver.stop()
    exact.close()
  stop_ids = set(tokenizer.eos_ids)
  for position, (turn_1, turn_2) in enumerate(served_turns):
    key = sample_key(SEED, position, 1)
    assert turn_1 == reference_sample(policy, prompts[position], key, 0, max_tokens=7,
                                      stop_ids=stop_ids)
    # turn 2 draws on from the tokens turn 1 kept, after the client's context
    assert turn_2 == reference_sample(policy, prompts[position] + turn_1 + context, key,
                                      len(turn_1), max_tokens=7, stop_ids=stop_ids)
  assert stats["repairs"] >= 3 and stats["draft_mismatch_mean"] > 0.01  # the draft was wrong


def test_exact_mode_is_refused_for_in_process_multi_turn_but_not_for_agents():
  exact = {"rollout.exact_logprobs": True}
  with pytest.raises(ConfigError, match=r"config\.rollout\.exact_logprobs=True: exact rollouts "
                                        r"verify single-turn completions and the turns an agent"
                                        r".*environment\.name='guess_number'"):
    config_lib.validate(debug_config(**exact, **{"environment.name": "guess_number"}),
                        num_devices=8)
  config_lib.validate(debug_config(**exact, **{
      "agent.entry": "tests.support.agents:completion_agent"}), num_devices=8)


def test_a_debug_agent_run_in_exact_mode_trains_and_reports_its_verification(tmp_path):
  train(tmp_path, "--config.total_steps=2", "--config.rollout.exact_logprobs=True",
        "--config.agent.entry=tests.support.agents:completion_agent")
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "episode/failed_frac" in r]
  assert len(steps) == 2
  for r in steps:
    assert np.isfinite(r["loss"]) and r["train/grad_norm"] > 0 and r["skipped_update"] == 0
    assert r["episode/failed_frac"] == 0.0
    # every turn of every episode verified: 2 turns x num_prompts x num_samples
    assert r["sampler/exact_sequences"] > 0 and r["sampler/exact_tokens"] > 0
    assert r["sampler/exact_repairs"] >= 0 and r["sampler/exact_draft_mismatch_max"] > 0
    assert r["time/exact_score_s"] > 0


def test_exact_turns_come_with_a_verifying_backend_and_refuse_moe_models():
  dense = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(moe=None)))
  moe = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(moe=object())))
  assert ExactTurns.for_backend(SimpleNamespace(scorer=None), dense, None) is None
  with pytest.raises(ConfigError, match=r"config\.rollout\.exact_logprobs: .*mixture-of-experts"):
    ExactTurns.for_backend(SimpleNamespace(scorer=object()), moe, None)
