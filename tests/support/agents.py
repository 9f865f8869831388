"""Tiny agent programs for the agent-rollout tests (`config.agent.entry`), and the chat templates
they talk through (the debug tokenizer's vocabulary: tags and digits)."""

import asyncio

# user turns between <bos> and <eos>; the assistant's after <answer>, ended by <eos>
PLAIN_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<answer>{{ m.content }}"
                  "<eos>{% else %}<bos>{{ m.content }}<eos>{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<answer>{% endif %}")
# Qwen3's habit: the generation prompt opens a <think> block, and earlier assistant turns are
# rendered without it (only what follows </think>), so a second turn never extends the first
THINK_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<answer>"
                  "{{ m.content.split('</think>')[-1] }}<eos>{% else %}<bos>{{ m.content }}<eos>"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}<answer><think>{% endif %}")


async def two_turns(client, example):
  """Asks, answers back, asks again; the reward is the length of the last reply mod 2."""
  messages = [{"role": "user", "content": example["prompt"]}]
  first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
  messages += [{"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "1+1"}]
  second = await client.chat.completions.create(model="policy", messages=messages,
                                                max_tokens=4)
  return {"agent": float(len(second.choices[0].message.content) % 2)}


async def flaky(client, example):
  """Raises on odd data positions' first sample; sleeps past any short deadline on '9'."""
  reply = await client.chat.completions.create(
      model="policy", messages=[{"role": "user", "content": example["prompt"]}], max_tokens=3)
  if "9" in example["prompt"]:
    await asyncio.sleep(60)
  if "7" in example["prompt"]:
    raise RuntimeError("the agent's tool broke")
  return float(len(reply.choices[0].message.content))


def sync_function(client, example):
  """Not async: refused as an entry."""
  return 0.0
