"""Sessions (reasoning_rl/agents/sessions.py) on a real byte-level BPE vocabulary: SmolLM2's
(from its GGUF) with the Qwen2.5-style template of tests/data/chat_templates.

A model sampling at temperature 1 may draw a tokenization the tokenizer would not produce
("hel" + "lo" where encoding "hello" gives one token). The client sends that text back unchanged,
so the session must extend on the text and keep the sampled tokens; only a real rewrite of the
text splits or is refused. The sampled tokens are hand-picked (a random model would not draw them
on cue) and go in through the pure session API.
"""

import asyncio
import concurrent.futures
import json
import pathlib

import openai
import pytest

from reasoning_rl.agents import chat
from reasoning_rl.agents import sessions as sessions_lib
from reasoning_rl.agents import tool_calls
from reasoning_rl.agents.driver import DecodeResult
from reasoning_rl.agents.server import RolloutServer
from reasoning_rl.models.tokenizers import Tokenizer

TEMPLATES = pathlib.Path(__file__).parent / "data" / "chat_templates"
QWEN_TEMPLATE = (TEMPLATES / "qwen25_style.jinja").read_text()
# Qwen3's habit on the same markers: earlier answers lose their <think> block.
THINK_DROPPING = QWEN_TEMPLATE.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{{- '<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1]"
    " + '<|im_end|>\\n' }}")


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf_path):
  return Tokenizer.from_gguf(smollm2_gguf_path).with_chat_template(QWEN_TEMPLATE)


def ids(tokenizer, text):
  return tokenizer.encode(text, add_special_tokens=False)


def rendered(tokenizer, messages):
  text = chat.render_prompt(tokenizer, messages)
  return ids(tokenizer, text), text


def sample(session, tokens, text, finish_reason="stop_id"):
  """What the server does with a decode's result: made-up log-probs, version 0."""
  session.end_turn(tokens=tokens, logprobs=[-0.5] * len(tokens),
                   sampling_logprobs=[-0.5] * len(tokens), versions=[0] * len(tokens),
                   finish_reason=finish_reason, text=text)


USER = {"role": "user", "content": "Say hello."}


def non_canonical_hello(tokenizer):
  """"hello world" as "hel" + "lo" + " world", then <|im_end|>: not how "hello world" encodes."""
  sampled = ids(tokenizer, "hel") + ids(tokenizer, "lo") + ids(tokenizer, " world") + [
      tokenizer.eos_id]
  assert tokenizer.decode(sampled[:-1]) == "hello world"
  assert ids(tokenizer, "hello world") != sampled[:-1]
  return sampled


def test_a_non_canonical_tokenization_extends_on_the_text(tokenizer):
  session = sessions_lib.Session("s", on_mismatch="refuse", tokenizer=tokenizer)
  prompt, _ = rendered(tokenizer, [USER])
  assert session.begin_turn(prompt) == prompt
  sampled = non_canonical_hello(tokenizer)
  sample(session, sampled, "hello world")
  # the client sends the reply back as it got it
  messages = [USER, {"role": "assistant", "content": "hello world"},
              {"role": "user", "content": "Again?"}]
  second, second_text = rendered(tokenizer, messages)
  assert sessions_lib.extension(prompt + sampled, second) is None  # the ids differ
  to_decode = session.begin_turn(second, text=second_text)
  turn_2 = ids(tokenizer, "Hi there")
  sample(session, turn_2, "Hi there", finish_reason="length")
  assert session.splits == 0 and len(session.segments) == 1
  [row] = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
  context = ids(tokenizer, "\n<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n")
  # trained: the sampled tokens as drawn, then the new context (mask 0), then the next turn
  assert row.prompt_tokens == prompt
  assert row.completion_ids == sampled + context + turn_2
  assert row.loss_mask == [1] * len(sampled) + [0] * len(context) + [1] * len(turn_2)
  assert row.logprobs == [-0.5] * len(sampled) + [0.0] * len(context) + [-0.5] * len(turn_2)
  # the engine decodes from the session's tokens, which read as the rendered prompt
  assert to_decode == prompt + sampled + context
  assert tokenizer.decode(to_decode) == second_text
  # the records show what answered turn 1, and the episode's text as the agent saw it
  assert row.turns[0]["observation"] == "\nuser\nAgain?\nassistant\n"
  assert "observation" not in row.turns[1]
  assert row.scored_response == "hello world\nuser\nAgain?\nassistant\nHi there"


def test_an_abandoned_turn_takes_its_observation_back(tokenizer):
  session = sessions_lib.Session("s", on_mismatch="refuse", tokenizer=tokenizer)
  prompt, _ = rendered(tokenizer, [USER])
  session.begin_turn(prompt)
  sample(session, ids(tokenizer, "hello"), "hello")
  second, second_text = rendered(tokenizer, [USER, {"role": "assistant", "content": "hello"},
                                             {"role": "user", "content": "Again?"}])
  session.begin_turn(second, text=second_text)
  session.abandon_turn()  # the engine refused it: its context was never read
  [row] = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
  assert "observation" not in row.turns[0]
  assert row.scored_response == "hello" and row.completion_ids == ids(tokenizer, "hello")


def test_without_a_tokenizer_or_text_only_tokens_are_compared(tokenizer):
  prompt, _ = rendered(tokenizer, [USER])
  sampled = non_canonical_hello(tokenizer)
  second, second_text = rendered(tokenizer, [USER, {"role": "assistant", "content": "hello world"},
                                             {"role": "user", "content": "Again?"}])
  for session, text in ((sessions_lib.Session("a", on_mismatch="split"), second_text),
                        (sessions_lib.Session("b", on_mismatch="split", tokenizer=tokenizer), None)):
    session.begin_turn(prompt)
    sample(session, sampled, "hello world")
    assert session.begin_turn(second, text=text) == second
    assert session.splits == 1


@pytest.mark.parametrize("policy", ["split", "refuse"])
def test_a_real_rewrite_still_splits_or_is_refused(tokenizer, policy):
  think = tokenizer.with_chat_template(THINK_DROPPING)
  session = sessions_lib.Session("s", on_mismatch=policy, tokenizer=think)
  prompt, _ = rendered(think, [USER])
  session.begin_turn(prompt)
  reply = "<think>Greet.</think>hello"
  sampled = ids(think, "<think>Greet.</think>hel") + ids(think, "lo") + [think.eos_id]
  sample(session, sampled, reply)
  second, second_text = rendered(think, [USER, {"role": "assistant", "content": reply},
                                         {"role": "user", "content": "Again?"}])
  assert "<think>" not in second_text
  if policy == "refuse":
    with pytest.raises(sessions_lib.HistoryMismatch,
                       match=r"the texts from character \d+ on \(the session's .*<think>"):
      session.begin_turn(second, text=second_text)
    assert len(session.segments) == 1
  else:
    assert session.begin_turn(second, text=second_text) == second
    assert session.splits == 1 and session.segments[-1].prompt_tokens == second


def test_a_history_ending_inside_a_character(tokenizer):
  smile = ids(tokenizer, "é😀")
  assert len(smile) == 4 and tokenizer.decode(smile[:2]) == "é\ufffd"  # the emoji's first byte(s)
  prompt, _ = rendered(tokenizer, [USER])
  cut = smile[:2]

  def second_turn(content, policy="split"):
    session = sessions_lib.Session("s", on_mismatch=policy, tokenizer=tokenizer)
    session.begin_turn(prompt)
    sample(session, cut, "é\ufffd", finish_reason="length")
    second, text = rendered(tokenizer, [USER, {"role": "assistant", "content": content},
                                        {"role": "user", "content": "?"}])
    return session, session.begin_turn(second, text=text), text

  # the client got (and sends back) the replacement character: the text reads the same
  session, to_decode, text = second_turn("é\ufffd")
  assert session.splits == 0 and to_decode[:len(prompt) + 2] == prompt + cut
  assert tokenizer.decode(to_decode) == text
  # a text completing the character does not extend the history's text (its decoding ends in
  # U+FFFD)...
  _, whole = rendered(tokenizer, [USER, {"role": "assistant", "content": "é😀"}])
  assert sessions_lib.text_extension(tokenizer, prompt + cut, whole) is None
  # ...though the ids may (the emoji's tokens start with the drawn ones): then the rest of its
  # bytes are context after what the model drew, as for any token-level extension
  session, to_decode, _ = second_turn("é😀")
  assert session.splits == 0 and to_decode[len(prompt):len(prompt) + 4] == smile
  assert session.segments[0].loss_mask[:4] == [1, 1, 0, 0]


def test_text_extension_checks_the_whole_decodes_to_the_text(tokenizer):
  history = ids(tokenizer, "ab")
  assert sessions_lib.text_extension(tokenizer, history, "abc") == ids(tokenizer, "c")
  assert sessions_lib.text_extension(tokenizer, history, "aXc") is None

  class SpacingDecoder:  # a SentencePiece-like decoder: each piece decoded alone gains a space
    @staticmethod
    def decode(tokens, skip_special_tokens=False):
      return tokenizer.decode(tokens) if len(tokens) <= len(history) else "ab c"

    encode = staticmethod(tokenizer.encode)

  assert sessions_lib.text_extension(SpacingDecoder, history, "abc") is None


class ScriptedDriver:
  """An engine driver that answers each request with the next scripted tokens and records the
  prompt it was asked to decode from."""

  def __init__(self, replies):
    self.replies = list(replies)
    self.prompts = []

  def submit(self, request):
    self.prompts.append(list(request.prompt))
    tokens, finish_reason = self.replies.pop(0)
    future = concurrent.futures.Future()
    future.set_result(DecodeResult(tokens=list(tokens), logprobs=[-0.25] * len(tokens),
                                   sampling_logprobs=[-0.25] * len(tokens),
                                   versions=[0] * len(tokens), finish_reason=finish_reason))
    return future


@pytest.fixture
def scripted_server(tokenizer):
  servers = []

  def start(replies, **kwargs):
    driver = ScriptedDriver(replies)
    server = RolloutServer(driver, tokenizer, history_mismatch="refuse", **kwargs)
    servers.append(server)
    return server, driver

  yield start
  for server in servers:
    server.stop()


def talk(server, session, requests):
  """Sends each request's messages (a function of the replies so far) through the real client."""
  async def run():
    c = openai.AsyncOpenAI(base_url=server.session_url(session), api_key="x", max_retries=0)
    replies = []
    try:
      for request in requests:
        replies.append(await c.chat.completions.create(model="policy", **request(replies)))
    finally:
      await c.close()
    return replies

  return asyncio.run(run())


def test_the_server_decodes_from_the_sampled_tokens_not_a_re_encoding(scripted_server, tokenizer):
  sampled = non_canonical_hello(tokenizer)
  server, driver = scripted_server([(sampled, "stop_id"), (ids(tokenizer, "Hi"), "length")])
  first, _ = talk(server, "hello", [
      lambda _: dict(messages=[USER]),
      lambda replies: dict(messages=[USER, replies[0].choices[0].message.model_dump(
          exclude_none=True), {"role": "user", "content": "Again?"}])])
  assert first.choices[0].message.content == "hello world"
  session = server.pop_session("hello")
  assert session.splits == 0
  context = ids(tokenizer, "\n<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n")
  prompt = ids(tokenizer, chat.render_prompt(tokenizer, [USER]))
  assert driver.prompts[1] == prompt + sampled + context
  [row] = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
  assert row.completion_ids == sampled + context + ids(tokenizer, "Hi")


# Tool calls: the model's Hermes markup parsed into `tool_calls`, sent back with a tool result.

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def drawn_call(tokenizer):
  """The call as a model may draw it: "Paris" as "Par" + "is" (not how the text encodes)."""
  head, tail = CALL_TEXT.split("Paris")
  tokens = (ids(tokenizer, head + "Par") + ids(tokenizer, "is") + ids(tokenizer, tail)
            + [tokenizer.eos_id])
  assert tokenizer.decode(tokens[:-1]) == CALL_TEXT and ids(tokenizer, CALL_TEXT) != tokens[:-1]
  return tokens


def test_a_tool_call_round_trip_extends_the_session(scripted_server, tokenizer):
  call = drawn_call(tokenizer)
  answer = ids(tokenizer, "It is 21 degrees.") + [tokenizer.eos_id]
  server, driver = scripted_server([(call, "stop_id"), (answer, "stop_id")])

  def with_result(replies):
    message = replies[0].choices[0].message
    return dict(tools=TOOLS, messages=[
        USER, message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"celsius": 21}'}])

  first, second = talk(server, "weather", [lambda _: dict(messages=[USER], tools=TOOLS),
                                           with_result])
  choice = first.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content is None
  [tool_call] = choice.message.tool_calls
  assert tool_call.id == tool_calls.tool_call_id("weather", 0, 0)
  assert (tool_call.function.name, tool_call.function.arguments) == ("get_weather",
                                                                      '{"city": "Paris"}')
  assert second.choices[0].finish_reason == "stop"
  assert second.choices[0].message.content == "It is 21 degrees."
  session = server.pop_session("weather")
  assert session.splits == 0 and session.malformed_tool_calls == 0
  [row] = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
  context = ids(tokenizer, "\n<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")
  # the call as drawn (trained), the tool's result as context (not trained), the answer
  assert row.completion_ids == call + context + answer
  assert row.loss_mask == [1] * len(call) + [0] * len(context) + [1] * len(answer)
  assert driver.prompts[1] == row.prompt_tokens + call + context
  # the first prompt described the tools as the template writes them
  assert driver.prompts[0] == ids(tokenizer, tokenizer.apply_chat_template([USER], tools=TOOLS))


def test_a_malformed_call_stays_in_the_content_and_is_counted(scripted_server, tokenizer):
  bad = '<tool_call>\n{"name": "get_time"}\n</tool_call>'
  server, _ = scripted_server([(ids(tokenizer, bad) + [tokenizer.eos_id], "stop_id")] * 2)
  request = lambda _: dict(messages=[USER], tools=TOOLS)
  [reply] = talk(server, "bad", [request])
  assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.tool_calls is None
  assert reply.choices[0].message.content == bad
  assert server.pop_session("bad").malformed_tool_calls == 1


def test_streamed_tool_calls_reach_the_client(scripted_server, tokenizer):
  server, _ = scripted_server([(drawn_call(tokenizer), "stop_id")])

  async def run():
    c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    stream = await c.chat.completions.create(model="policy", messages=[USER], tools=TOOLS,
                                             stream=True)
    chunks = [chunk async for chunk in stream]
    await c.close()
    return chunks

  [chunk] = asyncio.run(run())
  assert chunk.choices[0].finish_reason == "tool_calls"
  [delta_call] = chunk.choices[0].delta.tool_calls
  assert (delta_call.index, delta_call.function.name) == (0, "get_weather")


def test_tools_for_a_template_without_a_tool_syntax(scripted_server, tokenizer):
  chatml = tokenizer.with_chat_template(
      "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
  server, _ = scripted_server([])
  server.tokenizer = chatml
  with pytest.raises(openai.BadRequestError, match=r"config\.agent\.tool_syntax"):
    talk(server, "no-syntax", [lambda _: dict(messages=[USER], tools=TOOLS)])
  # named: the tools are described in the system message and the call parsed in that syntax
  server, driver = scripted_server([(drawn_call(chatml), "stop_id")], tool_syntax="hermes")
  server.tokenizer = chatml
  [reply] = talk(server, "hermes", [lambda _: dict(messages=[USER], tools=TOOLS)])
  assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
  prompt = chatml.decode(driver.prompts[0])
  assert prompt.startswith("<|im_start|>system\n# Tools\n") and json.dumps(TOOLS[0]) in prompt


# Continuing a partial assistant turn (vLLM's continue_final_message), as a calculator agent does.


def test_continue_final_message_cuts_where_transformers_does(tokenizer, smollm2_gguf_path):
  transformers = pytest.importorskip("transformers")
  reference = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent),
                                                         gguf_file=smollm2_gguf_path.name)
  for partial in ("12+3", "The sum is ", "  x\n"):
    messages = [USER, {"role": "assistant", "content": partial}]
    expected = reference.apply_chat_template(messages, chat_template=QWEN_TEMPLATE, tokenize=False,
                                             continue_final_message=True)
    assert chat.render_prompt(tokenizer, messages, add_generation_prompt=False,
                              continue_final_message=True) == expected


def test_a_calculator_agent_continuing_after_a_stop_string_extends(scripted_server, tokenizer):
  drawn = ids(tokenizer, "12+3=")
  rest = ids(tokenizer, " so 15.") + [tokenizer.eos_id]
  server, driver = scripted_server([(drawn, "stop_string"), (rest, "stop_id")])
  keep_open = {"continue_final_message": True, "add_generation_prompt": False}
  first, second = talk(server, "calc", [
      lambda _: dict(messages=[USER, {"role": "assistant", "content": ""}], stop=["="],
                     extra_body=keep_open),
      lambda replies: dict(messages=[USER, {"role": "assistant", "content": (
          replies[0].choices[0].message.content + "=15")}], stop=["="], extra_body=keep_open)])
  # the stop string is not in the text; the agent writes it back with the value
  assert first.choices[0].message.content == "12+3"
  assert second.choices[0].message.content == " so 15."
  session = server.pop_session("calc")
  assert session.splits == 0
  [row] = session.completions(prompt_id=0, sample_index=0, keep_sampling_logprobs=False)
  assert row.prompt_tokens == ids(tokenizer, chat.render_prompt(tokenizer, [USER]))
  written = ids(tokenizer, "15")
  assert row.completion_ids == drawn + written + rest
  assert row.loss_mask == [1] * len(drawn) + [0] * len(written) + [1] * len(rest)
  assert driver.prompts[1] == row.prompt_tokens + drawn + written
