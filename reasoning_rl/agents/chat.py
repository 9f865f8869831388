"""How a chat request becomes prompt text, and a completion's text an assistant message.

The server calls only these two functions, so tool calling plugs in here: `render_prompt` hands
the request's `tools` and `tool_choice` to the chat template (as transformers' templates expect
them), and `parse_assistant` turns the model's text into the message the client gets back. Tool
call parsing (the model's tool-call markup into OpenAI `tool_calls`) lives in its own module and
replaces `parse_assistant`'s plain-text answer when it is merged; until then the model's text is
returned as the message's content, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_prompt(tokenizer, messages: Sequence[Mapping[str, Any]], *,
                  tools: Sequence[Mapping[str, Any]] | None = None,
                  tool_choice: Any = None) -> str:
  """The prompt text of a chat request: `messages` through the tokenizer's chat template with a
  generation prompt. `tools` / `tool_choice` reach the template as its variables (only when
  given: a template that tests `tools is defined` sees none otherwise)."""
  extra = {}
  if tools:
    extra["tools"] = list(tools)
  if tool_choice is not None:
    extra["tool_choice"] = tool_choice
  return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **extra)


def parse_assistant(text: str) -> dict[str, Any]:
  """The assistant message of a completion's text: {"role": "assistant", "content": text}."""
  return {"role": "assistant", "content": text}


__all__ = ["parse_assistant", "render_prompt"]
