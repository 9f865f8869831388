"""2-digit addition as a verifiers (v1) environment: a taskset of `a + b` questions, an
exact-answer reward (plus a small digits-only shaping reward), and a one-turn chat harness that
runs in-process.

The harness ships with the taskset (verifiers picks a taskset's own exported Harness as the
default for its seat) because the stock chat harnesses launch a uv script that installs its
dependencies from PyPI first; this one needs nothing beyond verifiers and openai, so the tests
stay offline. It still speaks to the model only through the interception endpoint verifiers
hands it, as every harness must.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from openai import AsyncOpenAI

import verifiers.v1 as vf

__all__ = ["AdditionTaskset", "OneTurnChatHarness"]

SYSTEM_PROMPT = "Answer with the number only."


class AdditionData(vf.TaskData):
  a: int
  b: int
  answer: int


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):

  @vf.reward
  async def exact_answer(self, task: AdditionData, trace: vf.Trace) -> float:
    """1 when the model's last reply is exactly the sum, else 0."""
    return float(trace.last_reply.strip() == str(task.answer))

  @vf.reward(weight=0.1)
  async def digit_share(self, trace: vf.Trace) -> float:
    """Shaping (weight 0.1): the share of the last reply's characters that are digits, so that a
    model which cannot add yet still gets rewards that differ."""
    reply = trace.last_reply.strip()
    return sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0

  @vf.metric
  async def replied_number(self, trace: vf.Trace) -> float:
    """1 when the last reply is an integer at all (right or wrong)."""
    return float(trace.last_reply.strip().lstrip("-").isdigit())


class AdditionTasksetConfig(vf.TasksetConfig):
  count: int = 8
  """How many questions."""
  seed: int = 0
  """Draws the operands (10..99)."""


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionTasksetConfig]):

  def load(self) -> Iterator[AdditionTask]:
    draw = random.Random(self.config.seed)
    for _ in range(self.config.count):
      a, b = draw.randint(10, 99), draw.randint(10, 99)
      yield AdditionTask(AdditionData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM_PROMPT,
                                      a=a, b=b, answer=a + b), self.config.task)


class OneTurnChatHarnessConfig(vf.HarnessConfig):
  pass


class OneTurnChatHarness(vf.Harness[OneTurnChatHarnessConfig]):
  """One chat completion through the rollout's interception endpoint, in-process."""

  APPENDS_SYSTEM_PROMPT = True
  EXECUTES_CODE = False
  NEEDS_CONTAINER = False

  async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                   tool_interception_url=None) -> vf.ProgramResult:
    system, prompt = self.resolve_prompt(data)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
      await client.chat.completions.create(model=ctx.model, messages=messages)
    return vf.ProgramResult(exit_code=0, stdout="", stderr="")
