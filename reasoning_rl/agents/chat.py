"""How a chat request becomes prompt text, and a completion's text an assistant message.

The server calls only `render_prompt` and `parse_assistant`, and tool calling plugs in here
(`tool_calls`): the request's messages, `tools` and `tool_choice` go through
`tool_calls.prepare_chat` — a template that renders tools gets them as its `tools` variable and
the tool history in the shape transformers passes it; for one that does not, `agent.tool_syntax`
names the syntax the model was trained on and the tools and history are written as text in it.
`parse_assistant` turns the model's text back into an OpenAI message with `tool_calls`
(`tool_calls.parse_completion`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from reasoning_rl.agents import tool_calls


class ToolsUnsupported(ValueError):
  """A request carries tools (or tool messages) the model's chat template cannot render."""


@functools.lru_cache(maxsize=16)
def tool_format(chat_template: str | None, source: str, tool_syntax: str) -> tool_calls.ToolFormat:
  """The `ToolFormat` of a tokenizer's template (cached: reading it parses the template);
  `tool_syntax` "" detects the syntax from the template text."""
  return tool_calls.tool_format(chat_template, source=source, syntax_override=tool_syntax or None)


def format_of(tokenizer, tool_syntax: str = "") -> tool_calls.ToolFormat:
  return tool_format(tokenizer.chat_template, tokenizer.source, tool_syntax)


def render_prompt(tokenizer, messages: Sequence[Mapping[str, Any]], *,
                  tools: Sequence[Mapping[str, Any]] | None = None,
                  tool_choice: Any = None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, tool_syntax: str = "") -> str:
  """The prompt text of a chat request: `messages` through the tokenizer's chat template, with a
  generation prompt unless `add_generation_prompt` is false. Tools and tool messages go through
  `tool_calls.prepare_chat` (module docstring); `tool_syntax` is `agent.tool_syntax`.

  `continue_final_message` (vLLM's and transformers' extension): the last message is an assistant
  message the model is to continue, so the text is cut right after that message's content —
  the template's end-of-turn marker and anything after it are left out (`open_final_message`).

  Raises:
    ToolsUnsupported: tools or tool messages for a template with no known tool-call syntax and
      no `tool_syntax`.
    tool_calls.ToolCallError: malformed tools, tool_choice or tool calls.
    ValueError: the continue_final_message / add_generation_prompt combination is invalid.
  """
  if continue_final_message and add_generation_prompt:
    raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the "
                     "first continues the last assistant message, the second opens a new one; "
                     "send add_generation_prompt=false")
  fmt = format_of(tokenizer, tool_syntax)
  try:
    prepared, extra = tool_calls.prepare_chat(fmt, messages, tools, tool_choice)
  except tool_calls.ToolCallError as error:
    if fmt.syntax is None:
      raise ToolsUnsupported(
          f"{error}. To serve this model with tools set config.agent.tool_syntax to the syntax "
          "it was trained on (hermes or llama3): the tools are then described in the system "
          "message and the tool history written in that syntax") from error
    raise
  text = tokenizer.apply_chat_template(prepared, add_generation_prompt=add_generation_prompt,
                                       **extra)
  if continue_final_message:
    final = messages[-1] if messages else None
    if isinstance(final, Mapping) and final.get("role") == "assistant" and final.get(
        "content") == "":
      # an empty reply to continue: where the template would write its content (transformers'
      # cut would keep the whole turn, end marker included)
      marked = [*prepared[:-1], {**prepared[-1], "content": _CONTENT_MARK}]
      text = tokenizer.apply_chat_template(marked, add_generation_prompt=False, **extra)
      if _CONTENT_MARK not in text:
        raise ValueError("continue_final_message: the chat template does not write the final "
                         "assistant message's content into the prompt, so it cannot be continued")
      return text[:text.rindex(_CONTENT_MARK)]
    text = open_final_message(text, messages)
  return text


_CONTENT_MARK = "\x00continue-here\x00"


def parse_assistant(tokenizer, text: str, *, tools: Sequence[Mapping[str, Any]] | None = None,
                    tool_choice: Any = None, session_id: str, turn: int, tool_syntax: str = ""
                    ) -> tuple[dict[str, Any], int]:
  """(the assistant message of a completion's `text`, the number of malformed tool calls in it).

  `text` is decoded with special tokens kept and without the stop token. With tools offered, the
  model's tool-call markup becomes OpenAI `tool_calls` whose ids are
  `tool_calls.tool_call_id(session_id, turn, index)`, and the content the text around them (None
  when there is none, as OpenAI sends it); a call that cannot be used stays in the content and
  is counted. Without tools the message's content is the text, unchanged."""
  if not tools:
    return {"role": "assistant", "content": text}, 0
  parsed = tool_calls.parse_completion(format_of(tokenizer, tool_syntax), text, tools=tools,
                                       tool_choice=tool_choice, session_id=session_id, turn=turn)
  message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
  if parsed.tool_calls:
    message["tool_calls"] = [dict(call) for call in parsed.tool_calls]
  return message, parsed.malformed_tool_calls


def open_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
  """`rendered` (the whole conversation, no generation prompt) cut right after the final
  message's content, as transformers' `apply_chat_template(continue_final_message=True)` cuts it:
  at the content's last occurrence; when the template trimmed the content's surrounding
  whitespace, right after the trimmed content."""
  final = messages[-1] if messages else {}
  content = final.get("content") if isinstance(final, Mapping) else None
  if not isinstance(final, Mapping) or final.get("role") != "assistant" or not isinstance(
      content, str):
    raise ValueError("continue_final_message: the last message must be an assistant message "
                     "with string content (the partial reply to continue)")
  if not content.strip():
    raise ValueError("continue_final_message: the final assistant message holds only whitespace, "
                     "which the template may trim; send it empty, or with the text to continue")
  if content.strip() not in rendered:
    raise ValueError("continue_final_message: the chat template does not write the final "
                     "assistant message's content into the prompt, so it cannot be continued")
  at = rendered.rindex(content.strip())
  if rendered[at:at + len(content.lstrip())] == content.lstrip():
    return rendered[:at + len(content.lstrip())]
  return rendered[:at + len(content.strip())]


def keeps_history(tokenizer, reply: str, *, stop_token: str | None = None) -> bool:
  """Whether `tokenizer`'s chat template renders a conversation so that a session extends
  (`sessions`): the prompt of a second turn, after the model answered `reply` (ended by
  `stop_token`, default the tokenizer's EOS), starts with the first prompt's tokens followed by
  the reply's. False for a template that rewrites earlier turns (Qwen3 and DeepSeek-R1 drop an
  earlier answer's <think> block; Llama 3 and Gemma trim its surrounding whitespace) —
  `agent.history_mismatch` then applies to such replies."""
  stop = stop_token if stop_token is not None else tokenizer.decode([tokenizer.eos_id])
  first = [{"role": "user", "content": "1"}]
  prompt = render_prompt(tokenizer, first)
  second = render_prompt(tokenizer, first + [{"role": "assistant", "content": reply},
                                             {"role": "user", "content": "2"}])
  seen = tokenizer.encode(prompt + reply + stop, add_special_tokens=False)
  return tokenizer.encode(second, add_special_tokens=False)[:len(seen)] == seen


__all__ = ["ToolsUnsupported", "format_of", "keeps_history", "open_final_message",
           "parse_assistant", "render_prompt", "tool_format"]
