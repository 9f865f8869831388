"""Task sources, held-out filtering, prompt templates and the built-in debug vocabulary."""

from reasoning_rl.data.debug_vocab import debug_arithmetic_tokenizer, load_named_tokenizer
from reasoning_rl.data.tasks import (Example, JsonlSource, MixtureSource, PromptStream,
                                     ReasoningGymSource, SyntheticArithmeticSource, TaskSource,
                                     build_source, held_out_prompts, normalize_prompt)
from reasoning_rl.data.templates import R1ZERO_TEMPLATE, PromptTemplate

__all__ = [
    "Example", "JsonlSource", "MixtureSource", "PromptStream", "PromptTemplate",
    "R1ZERO_TEMPLATE", "ReasoningGymSource", "SyntheticArithmeticSource", "TaskSource",
    "build_source", "debug_arithmetic_tokenizer", "held_out_prompts", "load_named_tokenizer",
    "normalize_prompt",
]
