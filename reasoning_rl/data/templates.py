"""Prompt templates: an `Example` -> the text the policy continues -> token ids.

Kinds (`config.data.template`):
- `plain`: `instruction` with "{prompt}" replaced by the task's question, encoded with the
  tokenizer's own special-token convention (BOS if the model adds one).
- `chat`: the tokenizer's chat template around [system (if given), user: the instruction], with
  the generation prompt, encoded as transformers' `apply_chat_template(tokenize=True)` does: the
  template writes every special token it wants (BOS included), so nothing is added on encoding.
- `r1zero`: the DeepSeek-R1-Zero training template (DeepSeek-AI 2025, "DeepSeek-R1: Incentivizing
  Reasoning Capability in LLMs via Reinforcement Learning", Table 1), with the instruction in its
  prompt slot; encoded like `plain`.

Only the literal "{prompt}" in `instruction` is substituted, so instructions may contain other
braces (JSON examples, LaTeX) unchanged.
"""

from __future__ import annotations

from reasoning_rl.data.tasks import Example
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.tokenizers import Tokenizer

TEMPLATE_KINDS = ("plain", "chat", "r1zero")
PROMPT_SLOT = "{prompt}"

# DeepSeek-AI (2025), Table 1, verbatim; the prompt slot is where the paper writes "prompt".
R1ZERO_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
    "here </think> <answer> answer here </answer>. User: {prompt}. Assistant:")


class PromptTemplate:
  """Renders and encodes examples with one template kind (module docstring).

  Args:
    kind: "plain", "chat" or "r1zero".
    tokenizer: the policy's tokenizer.
    instruction: text containing "{prompt}", where the task's question goes.
    system_prompt: chat only: a system message; "" leaves it out (the chat template may then
      write its own default system message, as SmolLM2's and Qwen2.5's do).
    unknown_tokens: "error" (default) raises when an encoded prompt contains the tokenizer's
      unknown-token id (characters the vocabulary cannot spell, e.g. letters with the
      "debug_arithmetic" vocabulary); "allow" lets them through.

  Raises:
    ConfigError: unknown kind, an instruction without "{prompt}", a system prompt outside chat,
      or chat with a tokenizer that has no chat template.
  """

  def __init__(self, kind: str, tokenizer: Tokenizer, *, instruction: str = PROMPT_SLOT,
               system_prompt: str = "", unknown_tokens: str = "error"):
    if kind not in TEMPLATE_KINDS:
      raise ConfigError(f"config.data.template={kind!r}: must be one of {TEMPLATE_KINDS}")
    if not isinstance(instruction, str) or PROMPT_SLOT not in instruction:
      raise ConfigError(f"config.data.instruction={instruction!r}: must contain {PROMPT_SLOT!r} "
                        "where the task's question goes")
    if system_prompt and kind != "chat":
      raise ConfigError(f"config.data.system_prompt={system_prompt!r}: only the chat template has "
                        "a system message; set config.data.template='chat' or leave it empty")
    if kind == "chat" and tokenizer.chat_template is None:
      raise ConfigError(f"config.data.template='chat': the tokenizer ({tokenizer.source}) has no "
                        "chat template; use 'plain' or 'r1zero'")
    if unknown_tokens not in ("error", "allow"):
      raise ValueError(f"unknown_tokens={unknown_tokens!r}: must be 'error' or 'allow'")
    self.kind, self.tokenizer = kind, tokenizer
    self.instruction, self.system_prompt = instruction, system_prompt
    self.unknown_tokens = unknown_tokens

  def user_text(self, example: Example | str) -> str:
    """The instruction with the question in its "{prompt}" slot."""
    prompt = example if isinstance(example, str) else example.prompt
    return self.instruction.replace(PROMPT_SLOT, prompt)

  def render(self, example: Example | str) -> str:
    """The full prompt text the policy continues (special tokens written as text for chat)."""
    user = self.user_text(example)
    if self.kind == "plain":
      return user
    if self.kind == "r1zero":
      return R1ZERO_TEMPLATE.replace(PROMPT_SLOT, user)
    messages = []
    if self.system_prompt:
      messages.append({"role": "system", "content": self.system_prompt})
    messages.append({"role": "user", "content": user})
    return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

  def encode(self, example: Example | str) -> list[int]:
    """Token ids of `render(example)` (module docstring: which special tokens are added).

    Raises:
      ConfigError: with unknown_tokens="error", the ids contain the unknown-token id.
    """
    text = self.render(example)
    ids = self.tokenizer.encode(text, add_special_tokens=self.kind != "chat")
    unk = self.tokenizer.unk_id
    if self.unknown_tokens == "error" and unk is not None and unk in ids:
      unk_text = self.tokenizer.id_to_token(unk)
      if unk_text is None or unk_text not in text:
        raise ConfigError(
            f"config.data: the prompt {text[:200]!r} has characters the tokenizer "
            f"({self.tokenizer.source}) cannot spell (id {unk} = unknown); choose a task the "
            "vocabulary covers (config.data.train/eval) or a tokenizer that covers the task "
            "(config.model)")
    return ids
