"""The rollout server (reasoning_rl/agents): the real `openai` client against it, concurrent
requests sharing the engine, sessions recording exact tokens, and history mismatches."""

import asyncio
import dataclasses

import jax
import numpy as np
import openai
import pytest
from flax import nnx

from reasoning_rl.agents import chat
from reasoning_rl.agents import sessions as sessions_lib
from reasoning_rl.agents.collector import history_rewrite_warning
from reasoning_rl.agents.driver import DecodeRequest, EngineDriver, request_key
from reasoning_rl.agents.server import RolloutServer
from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer
from reasoning_rl.models.tokenizers import load_tokenizer
from reasoning_rl.models.transformer import create_model
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.exact import CanonicalScorer
from reasoning_rl.sampler.sampling import SamplingParams
from tests.support.agents import DIGIT_TOOLS_TEMPLATE, PLAIN_TEMPLATE, THINK_TEMPLATE
from tests.support.sampler import CONFIG, perturbed

SAMPLING = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def served():
  tokenizer = debug_arithmetic_tokenizer().with_chat_template(PLAIN_TEMPLATE)
  model = perturbed(create_model(dataclasses.replace(CONFIG, vocab_size=tokenizer.vocab_size),
                                 seed=0), 0)
  engine = Engine(model, max_concurrent_decodes=4, max_prefill_length=64, max_decode_length=16,
                  steps_per_call=4)
  driver = EngineDriver(engine, tokenizer=tokenizer)
  servers = {policy: RolloutServer(driver, tokenizer, sampling=SAMPLING, max_tokens=6,
                                   history_mismatch=policy, seed=3)
             for policy in ("split", "refuse")}
  yield model, engine, driver, servers, tokenizer
  for server in servers.values():
    server.stop()
  driver.stop()


def client(server, session=None):
  base = server.session_url(session) if session else f"{server.url}/v1"
  return openai.AsyncOpenAI(base_url=base, api_key="local", max_retries=0)


def test_the_openai_client_lists_the_model_and_gets_completions(served):
  _, _, _, servers, tokenizer = served
  server = servers["split"]

  async def talk():
    c = client(server)
    models = await c.models.list()
    chat = await c.chat.completions.create(model="policy", max_tokens=5, logprobs=True,
                                           messages=[{"role": "user", "content": "2+3"}])
    text = await c.completions.create(model="policy", prompt="<bos>4*4<eos><answer>",
                                      max_tokens=5, logprobs=0, n=2, seed=7)
    await c.close()
    return models, chat, text

  models, chat, text = asyncio.run(talk())
  assert [m.id for m in models.data] == ["policy"]
  choice = chat.choices[0]
  assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
  assert 1 <= len(choice.logprobs.content) <= 5
  assert all(np.isfinite(t.logprob) and t.logprob <= 0 for t in choice.logprobs.content)
  assert len(text.choices) == 2
  assert all(len(c.logprobs.token_logprobs) >= 1 for c in text.choices)
  # the same request with the same seed draws the same tokens
  again = asyncio.run(_completion(server, "<bos>4*4<eos><answer>", seed=7))
  assert again == [c.text for c in text.choices]


def test_sessions_by_header_or_user_streaming_and_refusals(served):
  _, _, _, servers, _ = served
  server = servers["split"]
  messages = [{"role": "user", "content": "8"}]

  async def talk():
    c = client(server)
    await c.chat.completions.create(model="policy", messages=messages, max_tokens=2,
                                    extra_headers={"X-Session-Id": "by-header"})
    await c.chat.completions.create(model="policy", messages=messages, max_tokens=2,
                                    user="by-user")
    stream = await c.chat.completions.create(model="policy", messages=messages, max_tokens=3,
                                             stream=True, seed=5)
    chunks = [chunk async for chunk in stream]
    whole = await c.chat.completions.create(model="policy", messages=messages, max_tokens=3,
                                            seed=5)
    errors = []
    for bad in (dict(messages=messages, max_tokens=99), dict(messages=messages, top_p=2.0),
                dict(messages=[{"role": "user", "content": "1" * 80}], max_tokens=2),
                dict(messages=messages, n=2, user="by-user")):
      try:
        await c.chat.completions.create(model="policy", **bad)
      except openai.BadRequestError as error:
        errors.append(error.message)
    await c.close()
    return chunks, whole, errors

  chunks, whole, errors = asyncio.run(talk())
  assert [s.turns for s in (server.pop_session("by-header"), server.pop_session("by-user"))] \
      == [1, 1]
  # the per-episode base URL wins over a header and a user id
  async def in_url():
    c = client(server, "by-url")
    await c.chat.completions.create(model="policy", messages=messages, max_tokens=2,
                                    user="u2", extra_headers={"X-Session-Id": "h2"})
    await c.close()

  asyncio.run(in_url())
  assert server.pop_session("by-url").turns == 1
  assert server.pop_session("h2") is None and server.pop_session("u2") is None
  assert "".join(c.choices[0].delta.content for c in chunks) == whole.choices[0].message.content
  assert len(errors) == 4
  assert "max_decode_length" in errors[0] and "top_p" in errors[1]
  assert "max_prefill_length" in errors[2] and "n=2" in errors[3]


def test_tools_reach_the_chat_template(served):
  tokenizer = served[4].with_chat_template(
      "{% for t in tools %}{{ t.function.name }}{% endfor %}|{{ messages[0].content }}")
  tools = [{"type": "function", "function": {"name": "12"}},
           {"type": "function", "function": {"name": "34"}}]
  # (the template shows no tool-call syntax: `agent.tool_syntax` names it)
  assert chat.render_prompt(tokenizer, [{"role": "user", "content": "5"}], tools=tools,
                            tool_syntax="hermes") == "1234|5"
  with pytest.raises(chat.ToolsUnsupported, match=r"config\.agent\.tool_syntax"):
    chat.render_prompt(tokenizer, [{"role": "user", "content": "5"}], tools=tools)


def test_tools_and_a_tool_call_history_through_the_openai_client(served):
  _, _, driver, servers, tokenizer = served
  tools = [{"type": "function", "function": {"name": "12", "parameters": {}}},
           {"type": "function", "function": {"name": "34", "parameters": {}}}]
  server = RolloutServer(driver, tokenizer.with_chat_template(DIGIT_TOOLS_TEMPLATE),
                         sampling=SAMPLING, max_tokens=4, tool_syntax="hermes", seed=3)
  user = {"role": "user", "content": "2+3"}

  async def episode():
    c = client(server, "tools")
    first = await c.chat.completions.create(model="policy", messages=[user], tools=tools)
    reply = first.choices[0].message
    history = [user, {"role": "assistant", "content": reply.content, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "12",
                                                          "arguments": '{"a": 5}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "7"}]
    second = await c.chat.completions.create(model="policy", messages=history, tools=tools)
    await c.close()
    outcome["turns"] = first, second
    # the same tools on a template that cannot take them, with no agent.tool_syntax
    plain = client(servers["split"])
    try:
      await plain.chat.completions.create(model="policy", messages=[user], tools=tools)
    finally:
      await plain.close()

  outcome = {}
  try:
    with pytest.raises(openai.BadRequestError, match=r"config\.agent\.tool_syntax"):
      asyncio.run(episode())
  finally:
    server.stop()
  first, second = outcome["turns"]
  assert first.choices[0].message.tool_calls is None  # (the debug vocabulary cannot write one)
  assert second.choices[0].message.content == tokenizer.decode(
      second.choices[0].model_extra["token_ids"]).removesuffix("<eos>")
  session = server.pop_session("tools")
  assert session.turns == 2 and session.malformed_tool_calls == 0
  rows = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
  assert rows[0].prompt_tokens == tokenizer.encode("<think>12 34 </think><bos>2+3<eos><answer>",
                                                   add_special_tokens=False)
  reply, turn_2 = first.choices[0].message.content, second.choices[0].model_extra["token_ids"]
  # what the engine decoded turn 2 from: the tool history as the template writes it
  seen = tokenizer.encode(
      f"<think>12 34 </think><bos>2+3<eos><answer>{reply}<think>12=5</think><eos><bos>=7<eos>"
      "<answer>", add_special_tokens=False)
  if first.choices[0].finish_reason == "length":
    # the reply is a prefix of the rendered history: the call the client wrote after it, the
    # result and the markers are context (mask 0)
    [row] = rows
    assert session.splits == 0 and row.prompt_tokens + row.completion_ids == seen + turn_2
    drawn = len(first.choices[0].model_extra["token_ids"])
    assert row.loss_mask == ([1] * drawn + [0] * (len(seen) - len(row.prompt_tokens) - drawn)
                             + [1] * len(turn_2))
  else:
    # the model ended its turn where the client wrote a call: trained apart
    assert session.splits == 1 and rows[1].prompt_tokens == seen


async def _completion(server, prompt, *, seed):
  c = client(server)
  out = await c.completions.create(model="policy", prompt=prompt, max_tokens=5, n=2, seed=seed)
  await c.close()
  return [choice.text for choice in out.choices]


def test_concurrent_requests_share_the_decode_slots_and_draw_what_they_draw_alone(served):
  _, _, driver, servers, _ = served
  server = servers["split"]
  prompts = [f"<bos>{d}+{d}<eos><answer>" for d in range(6)]

  async def send(indices):
    c = client(server)
    replies = await asyncio.gather(*(c.completions.create(
        model="policy", prompt=prompts[d], max_tokens=12, seed=d) for d in indices))
    await c.close()
    return [r.choices[0].model_extra["token_ids"] for r in replies]

  driver.most_live = 0
  together = asyncio.run(send(range(6)))
  # several requests decoded in one generate call: batched, not served one after another
  assert driver.most_live >= 2
  alone = [asyncio.run(send([d]))[0] for d in range(6)]
  assert together == alone
  assert len(set(map(tuple, alone))) > 1  # (the prompts and seeds do differ)


def test_a_two_turn_session_records_the_exact_tokens_and_logprobs(served):
  model, engine, _, servers, tokenizer = served
  server = servers["split"]

  async def episode():
    c = client(server, "two-turns")
    messages = [{"role": "user", "content": "3+4"}]
    first = await c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "5"}]
    second = await c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    await c.close()
    return first, second

  first, second = asyncio.run(episode())
  session = server.pop_session("two-turns")
  assert len(session.segments) == 1 and session.splits == 0
  [row] = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=True)
  ids_1 = first.choices[0].model_extra["token_ids"]
  ids_2 = second.choices[0].model_extra["token_ids"]
  prompt_1 = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user",
                                                               "content": "3+4"}]),
                              add_special_tokens=False)
  assert row.prompt_tokens == prompt_1
  # the episode: turn 1's tokens, the context the template added (mask 0), turn 2's tokens
  context = len(row.completion_ids) - len(ids_1) - len(ids_2)
  assert context > 0
  assert row.completion_ids[:len(ids_1)] == ids_1 and row.completion_ids[-len(ids_2):] == ids_2
  assert row.loss_mask == [1] * len(ids_1) + [0] * context + [1] * len(ids_2)
  assert all(lp == 0.0 for lp, m in zip(row.logprobs, row.loss_mask) if not m)
  # the second request's prompt is exactly the recorded sequence before turn 2
  messages = [{"role": "user", "content": "3+4"},
              {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "5"}]
  rendered = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
  assert rendered == row.prompt_tokens + row.completion_ids[:-len(ids_2)]
  # recorded log-probs are the training forward's over the whole sequence
  scorer = CanonicalScorer(nnx.graphdef(model), max_prompt_length=16, max_completion_length=48)
  scores = scorer.score(engine.params, [row.prompt_tokens], [row.completion_ids],
                        [jax.random.key(0)], SAMPLING)
  canonical = scores.logprobs[0][:len(row.completion_ids)]
  mask = np.array(row.loss_mask, bool)
  np.testing.assert_allclose(np.array(row.logprobs)[mask], canonical[mask], atol=2e-5)
  assert np.abs(np.array(row.logprobs)[mask]).min() > 0


def test_a_template_that_rewrites_history_splits_or_is_refused(served):
  _, _, _, servers, tokenizer = served
  think = tokenizer.with_chat_template(THINK_TEMPLATE)

  async def episode(server, session):
    c = client(server, session)
    messages = [{"role": "user", "content": "6"}]
    first = await c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "7"}]
    try:
      await c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    finally:
      await c.close()

  for server in servers.values():
    server.tokenizer = think
  try:
    asyncio.run(episode(servers["split"], "think-split"))
    session = servers["split"].pop_session("think-split")
    assert session.splits == 1 and len(session.segments) == 2
    rows = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
    # each segment starts from what the model saw at that turn, trained separately
    assert [sum(r.loss_mask) == len(r.completion_ids) for r in rows] == [True, True]
    assert rows[1].prompt_tokens[-2:] == [think.token_to_id("<answer>"),
                                          think.token_to_id("<think>")]
    with pytest.raises(openai.BadRequestError, match="does not extend the session's tokens"):
      asyncio.run(episode(servers["refuse"], "think-refuse"))
    session = servers["refuse"].pop_session("think-refuse")
    assert len(session.segments) == 1 and session.turns == 1  # the refused turn left no trace
  finally:
    for server in servers.values():
      server.tokenizer = tokenizer


def test_which_templates_keep_history(served):
  tokenizer = served[4]
  assert chat.keeps_history(tokenizer, "<think>1</think>2")
  assert not chat.keeps_history(tokenizer.with_chat_template(THINK_TEMPLATE), "<think>1</think>2")
  # without a think block the Qwen3-like template keeps the reply (but not its opening <think>)
  assert chat.keeps_history(tokenizer.with_chat_template(THINK_TEMPLATE.replace(
      "<answer><think>{% endif %}", "<answer>{% endif %}")), "12")


def test_a_run_is_told_at_start_when_its_template_would_split_every_episode(served):
  tokenizer = served[4]
  assert history_rewrite_warning(tokenizer) is None
  assert history_rewrite_warning(tokenizer.with_chat_template(None)) is None  # completions only
  warning = history_rewrite_warning(tokenizer.with_chat_template(THINK_TEMPLATE))
  assert warning.startswith("config.agent.segment_rows:") and "history_mismatch" in warning


def test_smollm2s_chatml_keeps_history_verbatim(smollm2_gguf_path):
  tokenizer = load_tokenizer(smollm2_gguf_path)
  # its template writes each message as it is: an earlier answer's think block and spaces stay
  assert chat.keeps_history(tokenizer, "<think>2+2 is 4</think> 4 ")


def test_the_session_rule_on_plain_lists():
  assert sessions_lib.extension([1, 2], [1, 2, 3]) == [3]
  assert sessions_lib.extension([1, 2], [1, 2]) == []
  assert sessions_lib.extension([1, 2], [1, 5, 3]) is None
  assert sessions_lib.extension([1, 2, 3], [1, 2]) is None
  assert sessions_lib.first_difference([1, 2, 3], [1, 5]) == 1
  session = sessions_lib.Session("s", on_mismatch="refuse")
  session.begin_turn([1, 2])
  session.end_turn(tokens=[7, 8], logprobs=[-1.0, -2.0], sampling_logprobs=[-1.0, -2.0],
                   versions=[0, 0], finish_reason="stop_id", text="x")
  session.begin_turn([1, 2, 7, 8, 4])
  with pytest.raises(sessions_lib.SessionBusy):
    session.begin_turn([1, 2, 7, 8, 4])
  session.end_turn(tokens=[9], logprobs=[-0.5], sampling_logprobs=[-0.5], versions=[1],
                   finish_reason="length", text="y")
  [row] = session.completions(prompt_id=3, sample_index=1, keep_sampling_logprobs=False)
  assert row.completion_ids == [7, 8, 4, 9] and row.loss_mask == [1, 1, 0, 1]
  assert row.logprobs == [-1.0, -2.0, 0.0, -0.5]
  assert row.token_versions == [0, 0, 0, 1] and row.policy_version == 0
  with pytest.raises(sessions_lib.HistoryMismatch, match="differ from token 2"):
    session.begin_turn([1, 2, 8])
  # a split that is then abandoned leaves the session as it was
  session.on_mismatch = "split"
  session.begin_turn([1, 2, 8])
  assert (len(session.segments), session.splits) == (2, 1)
  session.abandon_turn(drop_empty_segment=True)
  assert (len(session.segments), session.splits) == (1, 0)
  # an extension that is then abandoned takes its context back: the row is as before it
  session.begin_turn([1, 2, 7, 8, 4, 9, 5, 6])
  assert session.segments[-1].tokens == [7, 8, 4, 9, 5, 6]
  session.abandon_turn()
  [row] = session.completions(prompt_id=3, sample_index=1, keep_sampling_logprobs=False)
  assert row.completion_ids == [7, 8, 4, 9] and row.loss_mask == [1, 1, 0, 1]
  assert row.logprobs == [-1.0, -2.0, 0.0, -0.5]


def test_a_segment_prompt_longer_than_the_trained_prompt_is_refused(served):
  server = served[3]["refuse"]
  server.max_segment_prompt = 4
  try:
    async def talk():
      c = client(server, "too-long")
      try:
        await c.chat.completions.create(model="policy", max_tokens=2,
                                        messages=[{"role": "user", "content": "12+34"}])
      finally:
        await c.close()

    with pytest.raises(openai.BadRequestError, match="rollout.max_prefill_length=4"):
      asyncio.run(talk())
    assert server.pop_session("too-long").segments == []
  finally:
    server.max_segment_prompt = 0


def test_a_request_key_is_its_session_turn_and_choice():
  data = lambda *args: jax.random.key_data(request_key(*args)).tolist()
  assert data(0, "a", 1, 0) == data(0, "a", 1, 0)
  others = [data(1, "a", 1, 0), data(0, "b", 1, 0), data(0, "a", 2, 0), data(0, "a", 1, 1)]
  assert data(0, "a", 1, 0) not in others and len({str(o) for o in others}) == 4


def test_an_engine_failure_fails_its_requests_and_the_driver_goes_on(served, monkeypatch):
  _, engine, driver, _, _ = served
  request = lambda: DecodeRequest(prompt=[1, 5, 6], key=request_key(0, None, 0, 0),
                                  sampling=SAMPLING, max_new_tokens=3)

  def broken(**kwargs):
    raise RuntimeError("device lost")

  monkeypatch.setattr(engine, "prefill_many", broken)
  with pytest.raises(RuntimeError, match="device lost"):
    driver.submit(request()).result(timeout=60)
  monkeypatch.undo()
  assert len(driver.submit(request()).result(timeout=60).tokens) == 3


def test_continue_final_message_continues_the_assistant_turn_and_extends_the_session(served):
  _, _, _, servers, tokenizer = served
  server = servers["refuse"]
  user = {"role": "user", "content": "3+4"}
  keep_open = {"continue_final_message": True, "add_generation_prompt": False}

  async def episode():
    c = client(server, "continue")
    first = await c.chat.completions.create(
        model="policy", max_tokens=3, extra_body=keep_open,
        messages=[user, {"role": "assistant", "content": "12"}])
    partial = "12" + first.choices[0].message.content + "5"
    second = await c.chat.completions.create(
        model="policy", max_tokens=3, extra_body=keep_open,
        messages=[user, {"role": "assistant", "content": partial}])
    errors = []
    for messages, extra in (([user, {"role": "assistant", "content": "1"}],
                             {"continue_final_message": True, "add_generation_prompt": True}),
                            ([user], {"continue_final_message": True}),
                            ([user], {"continue_final_message": "yes"})):
      try:
        await c.chat.completions.create(model="policy", max_tokens=2, messages=messages,
                                        extra_body=extra)
      except openai.BadRequestError as error:
        errors.append(error.message)
    await c.close()
    return first, second, errors

  first, second, errors = asyncio.run(episode())
  session = server.pop_session("continue")
  assert session.splits == 0 and session.turns == 2
  [row] = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
  # no generation prompt after the partial reply, no end-of-turn marker either
  assert row.prompt_tokens == tokenizer.encode("<bos>3+4<eos><answer>12",
                                               add_special_tokens=False)
  ids_1 = first.choices[0].model_extra["token_ids"]
  ids_2 = second.choices[0].model_extra["token_ids"]
  assert first.choices[0].finish_reason == "length"  # (max_tokens: the text holds every token)
  assert row.completion_ids == ids_1 + [tokenizer.token_to_id("5")] + ids_2
  assert row.loss_mask == [1] * len(ids_1) + [0] + [1] * len(ids_2)
  assert "cannot both be true" in errors[0]
  assert "last message must be an assistant message" in errors[1]
  assert "continue_final_message='yes'" in errors[2]


def test_open_final_message_cuts_as_transformers_does(served):
  tokenizer = served[4]
  messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2 "}]
  assert chat.render_prompt(tokenizer, messages, add_generation_prompt=False,
                            continue_final_message=True) == "<bos>1<eos><answer>2 "
  trimming = tokenizer.with_chat_template(PLAIN_TEMPLATE.replace("m.content }}",
                                                                 "m.content | trim }}"))
  # the template trimmed the trailing space: the cut follows the trimmed content
  assert chat.render_prompt(trimming, messages, add_generation_prompt=False,
                            continue_final_message=True) == "<bos>1<eos><answer>2"
  # an empty reply opens where its content would go (transformers keeps the whole closed turn)
  assert chat.render_prompt(tokenizer, [messages[0], {"role": "assistant", "content": ""}],
                            add_generation_prompt=False, continue_final_message=True) \
      == "<bos>1<eos><answer>"
  with pytest.raises(ValueError, match="only whitespace"):
    chat.render_prompt(tokenizer, [messages[0], {"role": "assistant", "content": " "}],
                       add_generation_prompt=False, continue_final_message=True)


def test_a_stop_string_and_what_follows_it_are_not_in_the_text(served):
  server = served[3]["split"]

  async def draw(stop, seed):
    c = client(server)
    out = await c.completions.create(model="policy", prompt="<bos>2*3<eos><answer>",
                                     max_tokens=6, seed=seed, stop=stop)
    await c.close()
    return out.choices[0]

  # a seed whose draw has text to cut (the random model may end at once)
  seed, whole = next((seed, whole) for seed in range(50)
                     for whole in [asyncio.run(draw(None, seed))] if len(whole.text) >= 2)
  text = whole.text
  stopped = asyncio.run(draw([text[1]], seed))
  assert stopped.finish_reason == "stop"
  assert stopped.text == text[:text.index(text[1])]
  # the tokens drawn up to the stop string are all kept (what the session records)
  assert stopped.model_extra["token_ids"] == whole.model_extra["token_ids"][:text.index(text[1]) + 1]
