"""An observation as the exact text appended after the model's turn
(`environment.observation_format`).

Modes:
- "inline": the observation stays inside the assistant's message, as ToRL (Li et al. 2025, "ToRL:
  Scaling Tool-Integrated RL") and ReTool (Feng et al. 2025, "ReTool: Reinforcement Learning for
  Strategic Tool Use in LLMs") insert the interpreter's output after the code block:
  "\\n<output>\\n{observation}\\n</output>\\n". Needs no chat template: works with any model.
- "chat": the assistant's turn is closed, the observation becomes a tool-response turn and a new
  assistant turn is opened, all written by the tokenizer's own chat template. The text is what the
  template renders after the assistant's message in [user, assistant, tool response] with the
  generation prompt, so it is exactly what `apply_chat_template` would have written for that
  conversation. The tool-response turn follows Qwen2.5's convention: a template that handles a
  "tool" role (Qwen2.5, Qwen3, Llama 3.1) gets {"role": "tool"}; one that does not (SmolLM2's
  ChatML, Gemma) gets what Qwen2.5 renders for it, a user turn of
  "<tool_response>\\n{observation}\\n</tool_response>". For SmolLM2:
  "<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{observation}\\n</tool_response><|im_end|>\\n"
  "<|im_start|>assistant\\n".
- "raw": the observation as it is, right after the model's text: a tool whose answer continues
  the sentence, as GSM8K's calculator writes the value after "=" (Cobbe et al. 2021).

Special-token text inside an observation ("<|im_end|>" printed by a program) would be encoded as
the control token itself, since the sampler encodes the whole appended text with the tokenizer's
special-token parsing (which the chat wrapper needs): a program could then close the turn or open
a fake one in the model's context. With a tokenizer given, every special token's text in the
observation is broken by a zero-width space after its first character ("<\u200b|im_end|>"), so it
is tokenized as the ordinary text it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from reasoning_rl.errors import ConfigError

OBSERVATION_FORMATS = ("inline", "chat", "raw")
INLINE_TEMPLATE = "\n<output>\n{observation}\n</output>\n"
TOOL_RESPONSE_TEMPLATE = "<tool_response>\n{observation}\n</tool_response>"
# Stand-ins for the conversation around the observation; the rendered text is cut after the
# assistant's, which comes before the observation, so an observation holding it changes nothing.
_USER_STAND_IN = "\x00user-turn-of-the-episode\x00"
_ASSISTANT_STAND_IN = "\x00assistant-turn-of-the-episode\x00"
ZERO_WIDTH_SPACE = "\u200b"


def defuse_special_tokens(text: str, tokenizer) -> str:
  """`text` with each special token's text (module docstring) broken by a zero-width space."""
  if tokenizer is None:
    return text
  names = (tokenizer.id_to_token(i) for i in tokenizer.special_ids)
  for name in sorted({n for n in names if n and len(n) > 1}, key=len, reverse=True):
    if name in text:
      text = text.replace(name, name[0] + ZERO_WIDTH_SPACE + name[1:])
  return text


def template_has_tool_role(chat_template: str) -> bool:
  """Whether the template renders a "tool" role itself (Qwen2.5's and Llama 3.1's do)."""
  return "'tool'" in chat_template or '"tool"' in chat_template


def _tool_message(chat_template: str, observation: str) -> dict[str, str]:
  if template_has_tool_role(chat_template):
    return {"role": "tool", "content": observation}
  return {"role": "user", "content": TOOL_RESPONSE_TEMPLATE.format(observation=observation)}


def format_observation(observation: str, *, mode: str, tokenizer=None,
                       field: str = "environment.observation_format") -> str:
  """The exact text appended after the model's turn for `observation` (module docstring).

  Args:
    observation: the environment's message (`Turn.observation`).
    mode: "inline" or "chat".
    tokenizer: the policy's `models.tokenizers.Tokenizer`: its special tokens are defused in the
      observation; chat also needs its chat template. None: inline, the text as it is.
    field: the config field named in errors.

  Raises:
    ConfigError: an unknown mode, or chat with a tokenizer that has no chat template.
  """
  observation = defuse_special_tokens(observation, tokenizer)
  if mode == "inline":
    return INLINE_TEMPLATE.format(observation=observation)
  if mode == "raw":
    return observation
  if mode != "chat":
    raise ConfigError(f"config.{field}={mode!r}: must be one of {list(OBSERVATION_FORMATS)}")
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    source = getattr(tokenizer, "source", tokenizer)
    raise ConfigError(f"config.{field}='chat': the tokenizer ({source}) has no chat template; "
                      "use 'inline' (the observation inside the assistant's message)")
  messages = [{"role": "user", "content": _USER_STAND_IN},
              {"role": "assistant", "content": _ASSISTANT_STAND_IN},
              _tool_message(template, observation)]
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  at = text.find(_ASSISTANT_STAND_IN)
  if at < 0:  # a template that drops or rewrites the assistant's text: the cut has no anchor
    raise ConfigError(f"config.{field}='chat': the chat template of {tokenizer.source} does not "
                      "write the assistant's message verbatim, so the text after it cannot be "
                      "found; use 'inline'")
  return text[at + len(_ASSISTANT_STAND_IN):]


def observation_formatter(mode: str, tokenizer=None, *,
                          field: str = "environment.observation_format") -> Callable[[str], str]:
  """`format_observation` with `mode` and `tokenizer` fixed (what `sampler.multiturn` takes),
  checked once now so a bad mode or a missing chat template fails before the run starts."""
  format_observation("", mode=mode, tokenizer=tokenizer, field=field)
  return functools.partial(format_observation, mode=mode, tokenizer=tokenizer, field=field)


__all__ = ["INLINE_TEMPLATE", "OBSERVATION_FORMATS", "TOOL_RESPONSE_TEMPLATE", "ZERO_WIDTH_SPACE",
           "defuse_special_tokens", "format_observation", "observation_formatter",
           "template_has_tool_role"]
