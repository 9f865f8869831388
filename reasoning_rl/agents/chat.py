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


__all__ = ["keeps_history", "parse_assistant", "render_prompt"]
