"""Chat templates rendered with jinja2 the way Hugging Face transformers renders them.

The environment mirrors transformers' (checked against transformers 5.23, `utils/chat_template_utils.py`):
a sandboxed, immutable jinja2 environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `tojson` filter that keeps non-ASCII text and does not HTML-escape, and the globals
`raise_exception(message)` and `strftime_now(format)`. The template sees `messages`, `tools`, `documents`,
`add_generation_prompt`, the named special tokens (`bos_token`, `eos_token`, …) and any extra keyword
arguments, which override the special tokens of the same name. Like transformers, keys whose value is
None are dropped from messages, and a message's reasoning given as `thinking` or `reasoning` is also
exposed as `reasoning_content` (and vice versa), since templates read different names for it.
"""

from collections.abc import Mapping, Sequence
import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

# The names a message's reasoning text travels under; templates read the first, gpt-oss reads `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
  # jinja2's own `tojson` escapes <, >, & and ' for HTML, which would change the prompt text.
  return json.dumps(
      value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _strftime_now(format_string: str) -> str:
  return datetime.datetime.now().strftime(format_string)


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
  """Compiles `template` once; later calls with the same text reuse the compiled template."""
  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  environment.filters["tojson"] = _tojson
  environment.globals["raise_exception"] = _raise_exception
  environment.globals["strftime_now"] = _strftime_now
  return environment.from_string(template)


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
    raise TypeError(
        f"messages must be a list of dicts like {{'role': 'user', 'content': '...'}}, got {type(messages)}"
    )
  prepared = []
  for index, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise TypeError(
          f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}"
      )
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    prepared.append(message)
  return prepared


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    **extra: Any,
) -> str:
  """Renders `messages` with `template`.

  Args:
    template: the jinja2 chat template text.
    messages: the conversation, dicts with at least `role` and `content`.
    add_generation_prompt: whether to end with the header that opens the assistant's turn.
    special_tokens: named special token texts (`bos_token`, `eos_token`, …) the template may use.
    **extra: further template variables (`tools`, `documents`, `enable_thinking`, …).

  Returns:
    The rendered prompt text.
  """
  variables: dict[str, Any] = {"tools": None, "documents": None}
  variables.update(special_tokens)
  variables.update(extra)
  variables["messages"] = _prepare_messages(messages)
  variables["add_generation_prompt"] = add_generation_prompt
  return compile_chat_template(template).render(**variables)
