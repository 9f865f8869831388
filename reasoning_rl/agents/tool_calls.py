"""OpenAI function calling <-> a model's native tool-call text (pure Python, no JAX).

An OpenAI chat request may carry `tools`, `tool_choice`, assistant messages with `tool_calls` and
`role: "tool"` results. A model only sees the text its chat template writes, and answers in the
syntax it was trained on. This module translates both ways for the two syntaxes in common use:

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON object on its own lines,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; several calls follow one another;
  results come back as `<tool_response>` blocks in a user turn.
- `llama3` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the reply is one JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several calls are
  separated by `;`; results come back in the `ipython` role.

The syntax is read from the chat template's text (`detect_tool_syntax`). Templates that render
`tools` themselves (most Hugging Face ones) get the request's tools and history in the shape
transformers passes them (arguments as dicts, `messages_for_template`); for a template that does not,
`prepare_chat` writes a system block describing the tools and spells past calls and results out as
plain text in the same syntax. `parse_completion` turns the model's text back into OpenAI
`tool_calls`; a call that cannot be used (bad JSON, no name, a tool not offered, a tool that
`tool_choice` rules out) stays in the text and is counted, never guessed at.

Typical use by a server (the tokenizer is `reasoning_rl.models.tokenizers.Tokenizer`):

    fmt = tool_format(tokenizer.chat_template, source=tokenizer.source)
    messages, template_kwargs = prepare_chat(fmt, request_messages, tools, tool_choice)
    prompt = tokenizer.apply_chat_template(messages, **template_kwargs)
    ...  # sample `text` (decoded with special tokens kept, stop token removed)
    parsed = parse_completion(fmt, text, tools=tools, tool_choice=tool_choice,
                              session_id=session_id, turn=turn)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import hashlib
import json
import re
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta

from reasoning_rl.errors import ReasoningRLError

HERMES = "hermes"
LLAMA3 = "llama3"
TOOL_SYNTAXES = (HERMES, LLAMA3)

_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")
_THINK_END = "</think>"
# A hermes call block; the closing tag may be missing at the very end (the model stopped on it).
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
# Without <|python_tag|>, a llama3 reply is a call attempt only if it opens like one.
_LLAMA_CALL_START = re.compile(r'\{\s*"name"\s*:')
_TOOL_CHOICE_MODES = ("none", "auto", "required")


class ToolCallError(ReasoningRLError, ValueError):
  """A request's tools, tool_choice or tool messages are invalid, or the model cannot take tools."""


@dataclasses.dataclass(frozen=True)
class ToolFormat:
  """How one chat template handles tools.

  Attributes:
    syntax: `hermes`, `llama3`, or None when the template shows no known tool-call syntax.
    native: the template renders `tools`, assistant `tool_calls` and tool messages itself.
    source: what the template came from (a tokenizer's path), named in errors.
  """

  syntax: str | None
  native: bool
  source: str


@dataclasses.dataclass(frozen=True)
class ParsedCompletion:
  """A completion split into OpenAI message fields.

  Attributes:
    content: the text that is not a usable call (malformed calls stay in it verbatim); None when
      the reply is only tool calls, as OpenAI returns it.
    tool_calls: OpenAI tool calls, `{"id", "type": "function", "function": {"name", "arguments"}}`
      with `arguments` a JSON string.
    malformed_tool_calls: calls the model attempted that could not be used, plus one when
      `tool_choice` demanded a call and none was usable (the metric `episode/malformed_tool_calls`).
    finish_reason: "tool_calls" when there are tool calls, else None (keep the sampler's reason).
  """

  content: str | None
  tool_calls: tuple[dict[str, Any], ...]
  malformed_tool_calls: int
  finish_reason: str | None


# Choosing the syntax.


def detect_tool_syntax(chat_template: str | None) -> str | None:
  """The tool-call syntax a chat template uses: `hermes`, `llama3`, or None.

  `<tool_call>` in the text means hermes (checked first: Hermes fine-tunes of Llama keep Llama's
  special tokens). `<|python_tag|>`, or a `"parameters"` key next to Llama 3's header tokens (the
  Llama 3.2 templates have no python tag), means llama3.
  """
  if not chat_template:
    return None
  if "<tool_call>" in chat_template:
    return HERMES
  if _PYTHON_TAG in chat_template:
    return LLAMA3
  if '"parameters"' in chat_template and "<|start_header_id|>" in chat_template:
    return LLAMA3
  return None


def template_renders_tools(chat_template: str | None) -> bool:
  """Whether the template reads the `tools` variable (and so renders tools and tool history)."""
  if not chat_template:
    return False
  environment = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
  try:
    variables = jinja2.meta.find_undeclared_variables(environment.parse(chat_template))
  except jinja2.TemplateSyntaxError:
    # Tags this plain environment does not know (e.g. `{% generation %}`): fall back to the text.
    return re.search(r"\btools\b", chat_template) is not None
  return "tools" in variables


def tool_format(chat_template: str | None, *, source: str,
                syntax_override: str | None = None) -> ToolFormat:
  """The `ToolFormat` of a chat template.

  Args:
    chat_template: the template text (`Tokenizer.chat_template`), or None.
    source: what the template came from, named in errors (`Tokenizer.source`).
    syntax_override: `hermes` or `llama3` for a model trained on that syntax whose template does
      not show it; None to detect it from the template.
  """
  if syntax_override is not None and syntax_override not in TOOL_SYNTAXES:
    raise ToolCallError(
        f"tool-call syntax {syntax_override!r} is unknown; use one of {TOOL_SYNTAXES} or None to"
        " detect it from the chat template")
  syntax = syntax_override or detect_tool_syntax(chat_template)
  return ToolFormat(syntax=syntax, native=template_renders_tools(chat_template), source=source)


# Checking a request.


def _tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
  """The function names of OpenAI `tools`, checking each entry's shape."""
  if tools is None:
    return []
  if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
    raise ToolCallError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got"
                        f" {type(tools).__name__}")
  names = []
  for index, tool in enumerate(tools):
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if (not isinstance(tool, Mapping) or tool.get("type") != "function"
        or not isinstance(function, Mapping)):
      raise ToolCallError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ...,"
                          f" 'parameters': {{...}}}}}}, got {tool!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
      raise ToolCallError(f"tools[{index}].function.name must be a non-empty string, got {name!r}")
    if name in names:
      raise ToolCallError(f"tools[{index}].function.name {name!r} is listed twice; names must be"
                          " unique")
    names.append(name)
  return names


def resolve_tool_choice(tool_choice: str | Mapping[str, Any] | None,
                        tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, str | None]:
  """`(mode, name)` of an OpenAI `tool_choice`: mode is none / auto / required, name is set only
  for a named function (mode "required"). None means "auto" with tools and "none" without."""
  names = _tool_names(tools)
  if tool_choice is None:
    return ("auto" if names else "none"), None
  if isinstance(tool_choice, str):
    if tool_choice not in _TOOL_CHOICE_MODES:
      raise ToolCallError(f"tool_choice {tool_choice!r} is unknown; use one of"
                          f" {_TOOL_CHOICE_MODES} or {{'type': 'function', 'function': {{'name': ...}}}}")
    if tool_choice != "none" and not names:
      raise ToolCallError(f"tool_choice {tool_choice!r} needs `tools`; the request has none")
    return tool_choice, None
  function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
  name = function.get("name") if isinstance(function, Mapping) else None
  if not isinstance(name, str) or tool_choice.get("type") != "function":
    raise ToolCallError(f"tool_choice {tool_choice!r} must be none, auto, required or"
                        " {'type': 'function', 'function': {'name': ...}}")
  if name not in names:
    raise ToolCallError(f"tool_choice names function {name!r}, which is not in tools ({names})")
  return "required", name


def _arguments_object(arguments: Any, where: str) -> dict[str, Any]:
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as error:
      raise ToolCallError(f"{where} is not valid JSON ({error}): {arguments!r}") from error
  if not isinstance(arguments, Mapping):
    raise ToolCallError(f"{where} must be a JSON object, got {arguments!r}")
  return dict(arguments)


def messages_for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """OpenAI request messages in the shape chat templates expect, as transformers passes them:
  every assistant tool call's `function.arguments` (a JSON string in OpenAI's API) becomes a dict,
  since templates write it with `| tojson` (a string would come out quoted twice)."""
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
    raise ToolCallError(f"messages must be a list of dicts, got {type(messages).__name__}")
  prepared = []
  for index, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise ToolCallError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    message = dict(message)
    if message.get("tool_calls"):
      calls = []
      for call_index, call in enumerate(message["tool_calls"]):
        where = f"messages[{index}].tool_calls[{call_index}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
          raise ToolCallError(f"{where} must be {{'id': ..., 'type': 'function', 'function':"
                              f" {{'name': ..., 'arguments': '<JSON>'}}}}, got {call!r}")
        arguments = _arguments_object(function.get("arguments", "{}"), f"{where}.function.arguments")
        calls.append({**call, "type": call.get("type", "function"),
                      "function": {**function, "arguments": arguments}})
      message["tool_calls"] = calls
    prepared.append(message)
  return prepared


# Rendering.


def _hermes_call_text(name: str, arguments: Mapping[str, Any]) -> str:
  payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
  return f"<tool_call>\n{payload}\n</tool_call>"


def _llama_call_text(name: str, arguments: Mapping[str, Any]) -> str:
  return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def _tools_system_block(syntax: str, tools: Sequence[Mapping[str, Any]]) -> str:
  """A system-prompt description of `tools` and of how to call them, in `syntax`."""
  if syntax == HERMES:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou can call the functions below to help answer. Their signatures are"
            f" listed inside <tools></tools> tags:\n<tools>\n{listing}\n</tools>\n\n"
            "To call one, reply with a JSON object holding the function's name and arguments"
            " between <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')
  listing = "\n\n".join(json.dumps(tool, ensure_ascii=False, indent=4) for tool in tools)
  return ("You can call the functions below. To call one, reply with only a JSON object of the"
          ' form {"name": function name, "parameters": object of argument names and values};'
          ' separate several calls with ";". Use literal values, not variables.\n\n'
          f"{listing}")


def _spell_out_tool_messages(syntax: str, messages: list[dict[str, Any]],
                             tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """`messages` for a template that ignores tools: the tools described in the system message,
  past calls written into the assistant's text and results into user (hermes) or ipython (llama3)
  turns, each in the model's syntax."""
  spelled: list[dict[str, Any]] = []
  for message in messages:
    role = message.get("role")
    if message.get("tool_calls"):
      write = _hermes_call_text if syntax == HERMES else _llama_call_text
      calls = [write(call["function"]["name"], call["function"]["arguments"])
               for call in message["tool_calls"]]
      text = ("\n" if syntax == HERMES else "; ").join(calls)
      content = message.get("content") or ""
      spelled.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
    elif role == "tool":
      content = message.get("content")
      if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)
      if syntax == LLAMA3:
        spelled.append({"role": "ipython", "content": content})
        continue
      block = f"<tool_response>\n{content}\n</tool_response>"
      # Consecutive results share one user turn, as Qwen's templates write them.
      previous = spelled[-1] if spelled else None
      if previous is not None and previous.get("_tool_results"):
        previous["content"] += "\n" + block
      else:
        spelled.append({"role": "user", "content": block, "_tool_results": True})
    else:
      spelled.append(message)
  spelled = [{key: value for key, value in message.items() if key != "_tool_results"}
             for message in spelled]
  if tools:
    block = _tools_system_block(syntax, tools)
    if spelled and spelled[0].get("role") == "system":
      spelled[0] = {**spelled[0], "content": f"{spelled[0].get('content') or ''}\n\n{block}".lstrip()}
    else:
      spelled.insert(0, {"role": "system", "content": block})
  return spelled


def prepare_chat(fmt: ToolFormat, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None = None,
                 tool_choice: str | Mapping[str, Any] | None = None,
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """`(messages, template_kwargs)` to pass to `Tokenizer.apply_chat_template(messages,
  **template_kwargs)` for an OpenAI request.

  A template that renders tools gets them as `tools=` and the history with arguments as dicts;
  for one that does not, the tools and the tool history are written as text in the model's syntax.
  Requests without tools or tool history pass through unchanged (only checked).

  Raises:
    ToolCallError: malformed tools / tool_choice / tool calls, or tools for a template with no
      known tool-call syntax.
  """
  names = _tool_names(tools)
  resolve_tool_choice(tool_choice, tools)
  prepared = messages_for_template(messages)
  uses_tools = bool(names) or any(
      message.get("tool_calls") or message.get("role") == "tool" for message in prepared)
  if not uses_tools:
    return prepared, {}
  if fmt.syntax is None:
    raise ToolCallError(
        f"{fmt.source}: its chat template shows no tool-call syntax this server knows (Hermes/Qwen"
        " '<tool_call>' or Llama 3.1/3.2 JSON with '<|python_tag|>' / \"parameters\"), so it cannot"
        " take `tools` or tool messages; send the request without them, serve a model whose"
        " template supports tools, or name the syntax the model was trained on (hermes or llama3)")
  if fmt.native:
    return prepared, ({"tools": [dict(tool) for tool in tools]} if names else {})
  return _spell_out_tool_messages(fmt.syntax, prepared, tools or []), {}


# Parsing.


def tool_call_id(session_id: str, turn: int, index: int) -> str:
  """A tool call's id, the same on every rerun: a hash of (session, turn, index of the call)."""
  digest = hashlib.sha256(f"{session_id}\x1f{turn}\x1f{index}".encode()).hexdigest()
  return f"call_{digest[:24]}"


def _usable_call(payload: Any, allowed: Sequence[str]) -> tuple[str, str] | None:
  """`(name, arguments JSON)` of a decoded call object, or None when it cannot be used."""
  if not isinstance(payload, Mapping):
    return None
  name = payload.get("name")
  if not isinstance(name, str) or name not in allowed:
    return None
  arguments = payload.get("arguments", payload.get("parameters", {}))
  try:
    arguments = _arguments_object(arguments, "arguments")
  except ToolCallError:
    return None
  return name, json.dumps(arguments, ensure_ascii=False)


def _split_hermes(text: str, allowed: Sequence[str]) -> tuple[list[str], list[tuple[str, str]], int]:
  """(text pieces outside usable calls, usable calls, count of unusable call blocks)."""
  pieces, calls, malformed, position = [], [], 0, 0
  for match in _HERMES_BLOCK.finditer(text):
    try:
      call = _usable_call(json.loads(match.group(1)), allowed)
    except json.JSONDecodeError:
      call = None
    if call is None:
      malformed += 1
      continue  # the block stays in the text
    pieces.append(text[position:match.start()])
    calls.append(call)
    position = match.end()
  pieces.append(text[position:])
  return pieces, calls, malformed


def _split_llama(text: str, allowed: Sequence[str]) -> tuple[list[str], list[tuple[str, str]], int]:
  """Like `_split_hermes` for a llama3 reply: calls after `<|python_tag|>`, or a reply that opens
  with a call object; `;`-separated calls; text that is not a call is kept."""
  if _PYTHON_TAG in text:
    prefix, body = text.split(_PYTHON_TAG, 1)
  elif _LLAMA_CALL_START.match(text.lstrip()):
    prefix, body = "", text
  else:
    return [text], [], 0
  for token in _LLAMA_END_TOKENS:
    body = body.removesuffix(token)
  decoder = json.JSONDecoder()
  kept, calls, malformed, position = [prefix], [], 0, 0
  while True:
    while position < len(body) and (body[position].isspace() or body[position] == ";"):
      position += 1
    if position == len(body):
      break
    try:
      payload, end = decoder.raw_decode(body, position)
    except json.JSONDecodeError:
      rest = body[position:]
      malformed += rest.startswith("{")  # a truncated or broken call; other text is just text
      kept.append(rest)
      break
    call = _usable_call(payload, allowed)
    if call is None:
      malformed += 1
      kept.append(body[position:end])
    else:
      calls.append(call)
    position = end
  if not calls:
    return [text], [], malformed
  return kept, calls, malformed


def parse_completion(fmt: ToolFormat | str, text: str, *,
                     tools: Sequence[Mapping[str, Any]] | None,
                     tool_choice: str | Mapping[str, Any] | None, session_id: str,
                     turn: int) -> ParsedCompletion:
  """Splits a completion into content and OpenAI tool calls.

  Args:
    fmt: the template's `ToolFormat` (or a syntax name).
    text: the completion decoded with special tokens kept (llama3's `<|python_tag|>` is one),
      without the stop token. Anything up to a `</think>` is reasoning and never parsed for calls.
    tools: the request's OpenAI tools; only their names are accepted as calls.
    tool_choice: the request's tool_choice. "none": the text is returned as it is; "required" or a
      named function: a reply without a usable (matching) call counts as one malformed call.
    session_id, turn: seed the calls' ids (`tool_call_id`), so reruns give the same ids.
  """
  syntax = fmt.syntax if isinstance(fmt, ToolFormat) else fmt
  mode, only_name = resolve_tool_choice(tool_choice, tools)
  no_calls = ParsedCompletion(content=text, tool_calls=(), malformed_tool_calls=0,
                              finish_reason=None)
  if mode == "none" or syntax is None:
    return no_calls
  if syntax not in TOOL_SYNTAXES:
    raise ToolCallError(f"tool-call syntax {syntax!r} is unknown; use one of {TOOL_SYNTAXES}")
  allowed = [only_name] if only_name else _tool_names(tools)
  reasoning_end = text.rfind(_THINK_END)
  reasoning = text[:reasoning_end + len(_THINK_END)] if reasoning_end >= 0 else ""
  answer = text[len(reasoning):]
  split = _split_hermes if syntax == HERMES else _split_llama
  pieces, calls, malformed = split(answer, allowed)
  if not calls:
    required_missing = mode == "required" and malformed == 0
    return dataclasses.replace(no_calls, malformed_tool_calls=malformed + required_missing)
  content = (reasoning + "".join(pieces)).strip()
  tool_calls = tuple(
      {"id": tool_call_id(session_id, turn, index), "type": "function",
       "function": {"name": name, "arguments": arguments}}
      for index, (name, arguments) in enumerate(calls))
  return ParsedCompletion(content=content or None, tool_calls=tool_calls,
                          malformed_tool_calls=malformed, finish_reason="tool_calls")
