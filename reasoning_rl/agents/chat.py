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
                  tool_choice: Any = None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
  """The prompt text of a chat request: `messages` through the tokenizer's chat template, with a
  generation prompt unless `add_generation_prompt` is false. `tools` / `tool_choice` reach the
  template as its variables (only when given: a template that tests `tools is defined` sees none
  otherwise).

  `continue_final_message` (vLLM's and transformers' extension): the last message is an assistant
  message the model is to continue, so the text is cut right after that message's content —
  the template's end-of-turn marker and anything after it are left out (`open_final_message`).
  """
  if continue_final_message and add_generation_prompt:
    raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the "
                     "first continues the last assistant message, the second opens a new one; "
                     "send add_generation_prompt=false")
  extra = {}
  if tools:
    extra["tools"] = list(tools)
  if tool_choice is not None:
    extra["tool_choice"] = tool_choice
  text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                       **extra)
  if continue_final_message:
    text = open_final_message(text, messages)
  return text


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
    raise ValueError("continue_final_message: the final assistant message is empty; to start a "
                     "reply send add_generation_prompt=true and no assistant message instead")
  if content.strip() not in rendered:
    raise ValueError("continue_final_message: the chat template does not write the final "
                     "assistant message's content into the prompt, so it cannot be continued")
  at = rendered.rindex(content.strip())
  if rendered[at:at + len(content.lstrip())] == content.lstrip():
    return rendered[:at + len(content.lstrip())]
  return rendered[:at + len(content.strip())]


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


__all__ = ["keeps_history", "open_final_message", "parse_assistant", "render_prompt"]
