"""reasoning_rl/agents/tool_calls.py: OpenAI tools rendered in a model's syntax and parsed back.

Completions are hand-written for each syntax; the round trips render a conversation with the
project's tokenizer (SmolLM2's vocabulary with a Qwen2.5-style or Llama-3.1-style template from
tests/data/chat_templates) and parse the assistant turn the template wrote back into the calls
that went in. transformers renders the same templates as the independent reference.
"""

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from reasoning_rl.agents import tool_calls
from reasoning_rl.agents.tool_calls import (HERMES, LLAMA3, ToolCallError, detect_tool_syntax,
                                            messages_for_template, parse_completion, prepare_chat,
                                            template_renders_tools, tool_call_id, tool_format)
from reasoning_rl.models.tokenizers import Tokenizer

TEMPLATES = pathlib.Path(__file__).parent / "data" / "chat_templates"
QWEN_TEMPLATE = (TEMPLATES / "qwen25_style.jinja").read_text()
LLAMA_TEMPLATE = (TEMPLATES / "llama31_style.jinja").read_text()
# Llama 3.2's template has no <|python_tag|>: only the "parameters" key tells its syntax.
LLAMA32_LIKE = ('{{ "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}'
                '{{ \'{"name": "\' + name + \'", "parameters": \' + args | tojson + "}" }}')
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
          "{% endfor %}")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Sum of two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}}}}},
]


def expected_id(session, turn, index):
  return "call_" + hashlib.sha256(f"{session}\x1f{turn}\x1f{index}".encode()).hexdigest()[:24]


def call(name, arguments, index, session="s", turn=0):
  return {"id": expected_id(session, turn, index), "type": "function",
          "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse(syntax, text, tool_choice="auto", tools=TOOLS):
  return parse_completion(syntax, text, tools=tools, tool_choice=tool_choice, session_id="s", turn=0)


# Choosing the syntax.


def test_syntax_is_detected_from_the_template_text():
  assert detect_tool_syntax(QWEN_TEMPLATE) == HERMES
  assert detect_tool_syntax(LLAMA_TEMPLATE) == LLAMA3
  assert detect_tool_syntax(LLAMA32_LIKE) == LLAMA3
  assert detect_tool_syntax(CHATML) is None
  assert detect_tool_syntax(None) is None
  # Hermes fine-tunes of Llama keep Llama's tokens but call tools with <tool_call>.
  assert detect_tool_syntax(LLAMA_TEMPLATE + "<tool_call>") == HERMES


def test_template_renders_tools_reads_the_tools_variable():
  assert template_renders_tools(QWEN_TEMPLATE)
  assert template_renders_tools(LLAMA_TEMPLATE)  # reads `tools` before its own `set`
  assert not template_renders_tools(CHATML)
  assert not template_renders_tools("{# tools are not supported #}{{ messages[0].content }}")
  # Tags a plain jinja environment cannot parse: the text decides.
  assert template_renders_tools("{% generation %}{{ tools }}{% endgeneration %}")


# Parsing hermes.


def test_hermes_single_call():
  parsed = parse(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                         "</tool_call>")
  assert parsed.tool_calls == (call("get_weather", {"city": "Paris"}, 0),)
  assert parsed.content is None
  assert parsed.finish_reason == "tool_calls"
  assert parsed.malformed_tool_calls == 0


def test_hermes_several_calls_after_text():
  text = ('Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
  parsed = parse(HERMES, text)
  assert parsed.tool_calls == (call("get_weather", {"city": "Oslo"}, 0), call("add", {"a": 2, "b": 3}, 1))
  assert parsed.content == "Let me look both up."
  assert parsed.finish_reason == "tool_calls"


def test_hermes_arguments_given_as_a_json_string_or_parameters_or_missing():
  text = ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
          '<tool_call>{"name": "get_weather", "parameters": {"city": "Rome"}}</tool_call>'
          '<tool_call>{"name": "add"}</tool_call>')
  assert parse(HERMES, text).tool_calls == (
      call("add", {"a": 1, "b": 2}, 0), call("get_weather", {"city": "Rome"}, 1), call("add", {}, 2))


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # unknown name
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
])
def test_hermes_malformed_call_stays_text_and_is_counted(block):
  text = "Checking.\n" + block
  parsed = parse(HERMES, text)
  assert parsed.content == text
  assert parsed.tool_calls == ()
  assert parsed.malformed_tool_calls == 1
  assert parsed.finish_reason is None


def test_hermes_malformed_call_next_to_a_good_one():
  bad = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
  good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>'
  parsed = parse(HERMES, f"{bad}\n{good}")
  assert parsed.tool_calls == (call("add", {"a": 1, "b": 1}, 0),)
  assert parsed.content == bad
  assert parsed.malformed_tool_calls == 1
  assert parsed.finish_reason == "tool_calls"


def test_hermes_closing_tag_may_be_missing_at_the_end():
  parsed = parse(HERMES, 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n')
  assert parsed.tool_calls == (call("add", {"a": 4, "b": 5}, 0),)
  assert parsed.content == "Sure."


def test_hermes_calls_inside_reasoning_are_not_parsed():
  thought = '<think>I could write <tool_call>{"name": "add", "arguments": {}}</tool_call>.</think>'
  text = thought + '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
  parsed = parse(HERMES, text)
  assert parsed.tool_calls == (call("get_weather", {"city": "Lima"}, 0),)
  assert parsed.content == thought


# tool_choice.

GOOD_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_choice_none_never_parses():
  parsed = parse(HERMES, GOOD_WEATHER, tool_choice="none")
  assert (parsed.content, parsed.tool_calls, parsed.malformed_tool_calls, parsed.finish_reason) == (
      GOOD_WEATHER, (), 0, None)


def test_tool_choice_required_counts_a_reply_without_a_call():
  assert parse(HERMES, "It is sunny.", tool_choice="auto").malformed_tool_calls == 0
  parsed = parse(HERMES, "It is sunny.", tool_choice="required")
  assert (parsed.content, parsed.tool_calls, parsed.malformed_tool_calls) == ("It is sunny.", (), 1)
  assert parse(HERMES, GOOD_WEATHER, tool_choice="required").tool_calls == (
      call("get_weather", {"city": "Paris"}, 0),)


def test_named_tool_choice_accepts_only_that_function():
  named = {"type": "function", "function": {"name": "add"}}
  parsed = parse(HERMES, GOOD_WEATHER, tool_choice=named)
  assert (parsed.content, parsed.tool_calls, parsed.malformed_tool_calls) == (GOOD_WEATHER, (), 1)
  add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
  assert parse(HERMES, add, tool_choice=named).tool_calls == (call("add", {"a": 1, "b": 2}, 0),)


@pytest.mark.parametrize("tool_choice, tools, message", [
    ("sometimes", TOOLS, "tool_choice 'sometimes' is unknown"),
    ("required", None, "needs `tools`"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "'nope', which is not in tools"),
    ({"function": {"name": "add"}}, TOOLS, "must be none, auto, required"),
    ("auto", [{"type": "function", "function": {}}], r"tools\[0\].function.name"),
    ("auto", [{"name": "add"}], r"tools\[0\] must be"),
    ("auto", TOOLS + TOOLS[:1], "listed twice"),
])
def test_bad_tool_choice_or_tools_are_refused(tool_choice, tools, message):
  with pytest.raises(ToolCallError, match=message):
    parse(HERMES, "x", tool_choice=tool_choice, tools=tools)


def test_ids_are_reproducible_and_distinct():
  assert tool_call_id("s", 0, 0) == expected_id("s", 0, 0) == tool_call_id("s", 0, 0)
  ids = {tool_call_id(session, turn, index)
         for session in ("a", "b") for turn in (0, 1) for index in (0, 1)}
  assert len(ids) == 8
  first = parse_completion(HERMES, GOOD_WEATHER, tools=TOOLS, tool_choice="auto", session_id="x",
                           turn=3)
  assert first.tool_calls[0]["id"] == expected_id("x", 3, 0)


# Parsing llama3.


def test_llama_call_after_python_tag_and_without():
  body = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
  for text in (f"<|python_tag|>{body}", body, f"  {body}<|eom_id|>", f"<|python_tag|>{body}<|eom_id|>"):
    parsed = parse(LLAMA3, text)
    assert parsed.tool_calls == (call("get_weather", {"city": "Paris"}, 0),), text
    assert parsed.content is None
    assert parsed.finish_reason == "tool_calls"


def test_llama_text_before_the_tag_and_several_calls():
  text = ('Looking it up.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
          '{"name": "add", "arguments": {"a": 1, "b": 2}}')
  parsed = parse(LLAMA3, text)
  assert parsed.tool_calls == (call("get_weather", {"city": "Oslo"}, 0), call("add", {"a": 1, "b": 2}, 1))
  assert parsed.content == "Looking it up."


def test_llama_text_after_the_calls_is_content_not_a_malformed_call():
  text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}} then I will sum them'
  parsed = parse(LLAMA3, text)
  assert parsed.tool_calls == (call("add", {"a": 1, "b": 2}, 0),)
  assert (parsed.content, parsed.malformed_tool_calls) == ("then I will sum them", 0)
  cut = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "para'
  parsed = parse(LLAMA3, cut)
  assert parsed.tool_calls == (call("add", {"a": 1, "b": 2}, 0),)
  assert (parsed.content, parsed.malformed_tool_calls) == ('{"name": "add", "para', 1)


@pytest.mark.parametrize("text, malformed", [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": ', 1),  # bad JSON
    ('{"name": "get_weather", "parameters": {"city": "Paris"}', 1),  # bad JSON, no tag
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', 1),  # unknown name
    ('<|python_tag|>{"parameters": {"city": "Paris"}}', 1),  # no name
    ('{"city": "Paris", "temperature": 21}', 0),  # a JSON answer, not a call
    ("The weather in Paris is mild.", 0),
])
def test_llama_text_that_is_not_a_usable_call(text, malformed):
  parsed = parse(LLAMA3, text)
  assert (parsed.content, parsed.tool_calls, parsed.malformed_tool_calls, parsed.finish_reason) == (
      text, (), malformed, None)


def test_llama_named_tool_choice():
  text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
  parsed = parse(LLAMA3, text, tool_choice={"type": "function", "function": {"name": "add"}})
  assert (parsed.content, parsed.tool_calls, parsed.malformed_tool_calls) == (text, (), 1)


# Rendering.

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
]


def test_messages_for_template_turns_argument_strings_into_dicts():
  prepared = messages_for_template(HISTORY)
  assert [c["function"]["arguments"] for c in prepared[2]["tool_calls"]] == [{"city": "Paris"},
                                                                             {"a": 2, "b": 3}]
  assert prepared[2]["tool_calls"][0]["id"] == "call_1"
  assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not mutated
  broken = [HISTORY[1], {**HISTORY[2], "tool_calls": [
      {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{'a': 1}"}}]}]
  with pytest.raises(ToolCallError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not"
                                          " valid JSON"):
    messages_for_template(broken)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_path):
  return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_gguf_path):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent),
                                                    gguf_file=smollm2_gguf_path.name)


def render(tokenizer, template, messages, tools, tool_choice="auto", add_generation_prompt=True,
           syntax_override=None):
  tokenizer = tokenizer.with_chat_template(template)
  fmt = tool_format(tokenizer.chat_template, source=tokenizer.source, syntax_override=syntax_override)
  prepared, kwargs = prepare_chat(fmt, messages, tools, tool_choice)
  return fmt, tokenizer.apply_chat_template(prepared, add_generation_prompt=add_generation_prompt,
                                            **kwargs)


def test_qwen_style_template_renders_tools_as_transformers_does(smollm2_tokenizer,
                                                                reference_tokenizer):
  fmt, prompt = render(smollm2_tokenizer, QWEN_TEMPLATE, HISTORY, TOOLS)
  assert fmt == tool_calls.ToolFormat(syntax=HERMES, native=True, source=smollm2_tokenizer.source)
  expected = reference_tokenizer.apply_chat_template(
      messages_for_template(HISTORY), tools=TOOLS, chat_template=QWEN_TEMPLATE, tokenize=False,
      add_generation_prompt=True)
  assert prompt == expected
  assert "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in prompt
  assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
          "<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response>\n"
          "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt


def assistant_turn(prompt, opener, closer):
  start = prompt.index(opener) + len(opener)
  return prompt[start:prompt.index(closer, start)]


def expected_calls(message):
  return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def got_calls(parsed):
  return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_qwen_style_round_trip(smollm2_tokenizer):
  fmt, prompt = render(smollm2_tokenizer, QWEN_TEMPLATE, HISTORY[:3], TOOLS, add_generation_prompt=False)
  text = assistant_turn(prompt, "<|im_start|>assistant", "<|im_end|>")
  parsed = parse_completion(fmt, text, tools=TOOLS, tool_choice="auto", session_id="s", turn=0)
  assert got_calls(parsed) == expected_calls(HISTORY[2])
  assert parsed.content is None and parsed.malformed_tool_calls == 0


def test_llama_style_template_round_trip(smollm2_tokenizer, reference_tokenizer):
  history = [HISTORY[0], HISTORY[1], {**HISTORY[2], "tool_calls": HISTORY[2]["tool_calls"][1:]},
             {"role": "tool", "tool_call_id": "call_2", "content": "5"}]
  fmt, prompt = render(smollm2_tokenizer, LLAMA_TEMPLATE, history, TOOLS, add_generation_prompt=False)
  assert (fmt.syntax, fmt.native) == (LLAMA3, True)
  expected = reference_tokenizer.apply_chat_template(
      messages_for_template(history), tools=TOOLS, chat_template=LLAMA_TEMPLATE, tokenize=False,
      add_generation_prompt=False)
  assert prompt == expected
  assert json.dumps(TOOLS[0], indent=4) in prompt
  opener = "<|start_header_id|>assistant<|end_header_id|>\n\n"
  text = assistant_turn(prompt, opener, "<|eot_id|>")
  assert text == '{"name": "add", "parameters": {"a": 2, "b": 3}}'
  assert "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>" in prompt
  parsed = parse_completion(fmt, text, tools=TOOLS, tool_choice="required", session_id="s", turn=0)
  assert got_calls(parsed) == expected_calls(history[2])


@pytest.mark.parametrize("syntax, opener, closer", [
    (HERMES, "<|im_start|>assistant\n", "<|im_end|>"),
    (LLAMA3, "<|im_start|>assistant\n", "<|im_end|>"),
])
def test_template_without_tools_gets_a_system_block_in_the_named_syntax(smollm2_tokenizer, syntax,
                                                                        opener, closer):
  history = HISTORY if syntax == HERMES else HISTORY[:3]
  fmt, prompt = render(smollm2_tokenizer, smollm2_tokenizer.chat_template, history, TOOLS,
                       add_generation_prompt=False, syntax_override=syntax)
  assert (fmt.syntax, fmt.native) == (syntax, False)
  system = assistant_turn(prompt, "<|im_start|>system\n", "<|im_end|>")
  assert system.startswith("You are terse.\n\n")
  if syntax == HERMES:
    assert "<tools>\n" + "\n".join(json.dumps(tool) for tool in TOOLS) + "\n</tools>" in system
    assert ("<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response>\n"
            "<tool_response>\n5\n</tool_response><|im_end|>") in prompt
  else:
    assert '"parameters": object of argument names and values' in system
    assert json.dumps(TOOLS[0], indent=4) in system
  text = assistant_turn(prompt, opener, closer)
  parsed = parse_completion(fmt, text, tools=TOOLS, tool_choice="auto", session_id="s", turn=0)
  assert got_calls(parsed) == expected_calls(HISTORY[2])
  assert parsed.content is None


def test_tools_are_refused_for_a_template_without_a_known_syntax(smollm2_tokenizer):
  with pytest.raises(ToolCallError, match=f"{smollm2_tokenizer.source}: its chat template shows no"
                                          " tool-call syntax"):
    render(smollm2_tokenizer, smollm2_tokenizer.chat_template, HISTORY[:2], TOOLS)
  with pytest.raises(ToolCallError, match="shows no tool-call syntax"):  # tool history, no tools
    render(smollm2_tokenizer, CHATML, HISTORY, None, tool_choice=None)
  # Without tools the request passes through untouched.
  fmt, prompt = render(smollm2_tokenizer, CHATML, HISTORY[:2], None, tool_choice=None)
  assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nWeather in Paris, and 2 + 3?<|im_end|>\n")
  with pytest.raises(ToolCallError, match="tool-call syntax 'xml' is unknown"):
    tool_format(CHATML, source="x", syntax_override="xml")


def test_module_loads_without_jax():
  code = "import sys, reasoning_rl.agents.tool_calls; print('jax' in sys.modules)"
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=pathlib.Path(__file__).parent.parent)
  assert result.stdout.strip() == "False"
