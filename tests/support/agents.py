"""Tiny agent programs for the agent-rollout tests (`config.agent.entry`), and the chat templates
they talk through (the debug tokenizer's vocabulary: tags and digits)."""

import asyncio
import dataclasses

from reasoning_rl.agents.examples import calculator_agent

# user turns between <bos> and <eos>; the assistant's after <answer>, ended by <eos>
PLAIN_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<answer>{{ m.content }}"
                  "<eos>{% else %}<bos>{{ m.content }}<eos>{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<answer>{% endif %}")
# Qwen3's habit: the generation prompt opens a <think> block, and earlier assistant turns are
# rendered without it (only what follows </think>), so a second turn never extends the first
THINK_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<answer>"
                  "{{ m.content.split('</think>')[-1] }}<eos>{% else %}<bos>{{ m.content }}<eos>"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}<answer><think>{% endif %}")
# the debug vocabulary's own tool rendering: tool names listed in a think block, an assistant's
# calls as <think>name=a</think> (its `arguments` reach the template as a dict), results as "=r"
DIGIT_TOOLS_TEMPLATE = (
    "{% if tools %}<think>{% for t in tools %}{{ t.function.name }} {% endfor %}</think>{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<answer>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<think>{{ c.function.name }}={{ c.function.arguments.a }}"
    "</think>{% endfor %}<eos>{% elif m.role == 'tool' %}<bos>={{ m.content }}<eos>"
    "{% else %}<bos>{{ m.content }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<answer>{% endif %}")


def _prompt(example):
  return example["prompt"] if isinstance(example, dict) else example.prompt


async def completion_agent(client, example):
  """Two turns through /v1/completions on the debug vocabulary (no chat template): the task,
  the model's reply, then "5"; the reward is 1 when the answer appears in the replies."""
  prompt = f"<bos>{_prompt(example)}<eos><answer>"
  first = await client.completions.create(model="policy", prompt=prompt, max_tokens=3)
  prompt += first.choices[0].text + "<eos>5<answer>"
  second = await client.completions.create(model="policy", prompt=prompt, max_tokens=3)
  replies = first.choices[0].text + second.choices[0].text
  return {"correct": float(example.answer in replies), "length": len(replies) / 10}


async def splitting_agent(client, example):
  """Two turns through /v1/completions whose second prompt leaves out the first reply (as
  Qwen3's template leaves out earlier reasoning), so every episode splits: the first turn is a
  segment of its own. The reward is 1 when the answer appears in the replies."""
  opening = f"<bos>{_prompt(example)}<eos>"
  first = await client.completions.create(model="policy", prompt=opening + "<answer>",
                                          max_tokens=3)
  second = await client.completions.create(model="policy", prompt=opening + "5<answer>",
                                           max_tokens=3)
  replies = first.choices[0].text + second.choices[0].text
  return {"correct": float(example.answer in replies), "length": len(replies) / 10}


async def two_turns(client, example):
  """Asks, answers back, asks again; the reward is the length of the last reply mod 2."""
  messages = [{"role": "user", "content": _prompt(example)}]
  first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
  messages += [{"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "1+1"}]
  second = await client.chat.completions.create(model="policy", messages=messages,
                                                max_tokens=4)
  return {"agent": float(len(second.choices[0].message.content) % 2)}


async def flaky(client, example):
  """Sleeps past any short deadline when the prompt holds a 9; raises when it holds a 7."""
  reply = await client.chat.completions.create(
      model="policy", messages=[{"role": "user", "content": _prompt(example)}], max_tokens=3)
  if "9" in _prompt(example):
    await asyncio.sleep(60)
  if "7" in _prompt(example):
    raise RuntimeError("the agent's tool broke")
  return float(len(reply.choices[0].message.content))


def sync_function(client, example):
  """Not async: refused as an entry."""
  return 0.0


# The debug calculator agent under a tighter episode budget (tests/test_calculator_agent.py):
# rollout.max_new_tokens = TIGHT_BUDGET, which several of its episodes reach
TIGHT_BUDGET = 14
_TIGHT = dataclasses.replace(calculator_agent.DEBUG, max_new_tokens=TIGHT_BUDGET)


async def tight_calculator(client, example):
  return await _TIGHT.play(client, example)
