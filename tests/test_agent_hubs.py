"""The hub adapters (reasoning_rl/agents/verifiers_hub.py, openenv_hub.py) end to end: a small
environment written against each hub's API (tests/data/hub_envs) played through the real
`openai.AsyncOpenAI` client against a scripted OpenAI-compatible server
(tests/support/fake_openai_server.py). The rewards must be the ones the environment defines for
the scripted answers, and every model call must have reached the scripted server: the count of
its requests is the count of model turns, and any connection to a non-loopback address fails
the test (nothing may phone home).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket

import numpy as np
import openai
import pytest
import verifiers.v1.runtimes.subprocess as subprocess_runtime

from reasoning_rl import config as config_lib
from reasoning_rl import config_schema
from reasoning_rl.agents import entry as entry_lib
from reasoning_rl.agents import hub_support, openenv_hub, verifiers_hub
from reasoning_rl.data import tasks as tasks_lib
from reasoning_rl.errors import ConfigError
from tests.support.fake_openai_server import FakeOpenAIServer

HUB_ENVS = pathlib.Path(__file__).parent / "data" / "hub_envs"
API_KEY = "test-key"
EPISODE_HEADER = "x-episode"
GUESS_ENV = "rrl_openenv_guess:GuessEnvironment"


@pytest.fixture
def offline(monkeypatch):
  """Refuses (and records) every connection and name lookup that is not loopback."""
  attempts = []
  connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

  def loopback_connect(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1",
                                                                                "::1"):
      attempts.append(address)
      raise OSError(f"test_agent_hubs: connection to {address} refused (offline test)")
    return connect(sock, address)

  def loopback_getaddrinfo(host, *args, **kwargs):
    if host not in ("127.0.0.1", "localhost", "::1", None):
      attempts.append(host)
      raise socket.gaierror(f"test_agent_hubs: lookup of {host} refused (offline test)")
    return getaddrinfo(host, *args, **kwargs)

  monkeypatch.setattr(socket.socket, "connect", loopback_connect)
  monkeypatch.setattr(socket, "getaddrinfo", loopback_getaddrinfo)
  yield attempts
  assert attempts == [], f"network calls outside loopback: {attempts}"


@pytest.fixture
def hub_envs(monkeypatch, tmp_path):
  """The two test environments importable and verifiers' per-rollout folders under tmp_path."""
  monkeypatch.syspath_prepend(str(HUB_ENVS / "verifiers_addition"))
  monkeypatch.syspath_prepend(str(HUB_ENVS / "openenv_guess"))
  monkeypatch.setattr(subprocess_runtime, "CACHE_DIR", tmp_path / "verifiers")


def run_episodes(agent, server, examples, clients=None):
  """Every example's episode at once (as the trainer runs a group) through real clients: one
  shared client, or `clients(i)` -> (api_key, default_headers) of episode i's own client."""

  async def play():
    settings = [clients(i) if clients else (API_KEY, None) for i in range(len(examples))]
    made = [openai.AsyncOpenAI(base_url=server.base_url, api_key=key, default_headers=headers,
                               max_retries=0) for key, headers in settings]
    try:
      return await asyncio.gather(*(agent(c, e) for c, e in zip(made, examples)))
    finally:
      for client in made:
        await client.close()

  return asyncio.run(play())


# --- verifiers -----------------------------------------------------------------------------------


def addition_reply(body):
  """The scripted model: right for 10..49 + anything, wrong (off by one) above, no number for
  the prompt 'What is 99 + 99?'."""
  question = body["messages"][-1]["content"]
  a, b = (int(x) for x in question.removeprefix("What is ").removesuffix("?").split(" + "))
  if (a, b) == (99, 99):
    return "I do not know"
  return str(a + b) if a < 50 else str(a + b + 1)


def test_verifiers_hub_rewards_right_and_wrong_answers(offline, hub_envs):
  agent = verifiers_hub.make_agent("rrl_vf_addition", {"taskset": {"count": 6, "seed": 3}})
  examples = agent.examples()
  examples.append({**examples[0], "prompt": "What is 99 + 99?", "a": 99, "b": 99, "answer": 198})
  assert {e["a"] < 50 for e in examples[:-1]} == {True, False}  # both kinds of answer occur
  # Each episode has a client of its own (its own key and header, as a server that keys sessions
  # per episode may hand out), and every call must carry its episode's.
  with FakeOpenAIServer(addition_reply) as server:
    parts = run_episodes(agent, server, examples,
                         clients=lambda i: (f"key-{i}", {"X-Episode": f"episode-{i}"}))
  for example, got in zip(examples, parts):
    right = example["a"] < 50 and example["a"] != 99  # what the script answered, independently
    # each reward's weight x score (exact_answer 1, digit_share 0.1: all digits, or none in
    # "I do not know"); the metric replied_number is not a reward and is not returned
    assert got == {"exact_answer": float(right),
                   "digit_share": 0.1 * float(example["a"] != 99)}, example
  # One model call per episode (the harness's one turn), each to the scripted server; nothing
  # else was requested.
  assert len(server.chat_requests) == len(examples) == len(server.requests)
  episode_of = {e["prompt"]: i for i, e in enumerate(examples)}
  for request in server.chat_requests:
    i = episode_of[request.body["messages"][-1]["content"]]
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer key-{i}"
    assert request.headers[EPISODE_HEADER] == f"episode-{i}"
    assert request.body["model"] == "policy"
    assert request.body["messages"][0] == {"role": "system",
                                           "content": "Answer with the number only."}
  assert sorted(episode_of[r.body["messages"][-1]["content"]] for r in server.chat_requests) == \
      list(range(len(examples)))
  # The keys were in the environment only while their episodes ran.
  assert not [v for v in os.environ if v.startswith(verifiers_hub.API_KEY_PREFIX)]


def test_verifiers_hub_total_is_the_weighted_sum(offline, hub_envs):
  agent = verifiers_hub.make_agent(
      "rrl_vf_addition",
      {"taskset": {"count": 1, "task": {"rewards": {"exact_answer": {"weight": 2.5}}}}})
  (example,) = agent.examples()
  with FakeOpenAIServer([str(example["a"] + example["b"])]) as server:
    (parts,) = run_episodes(agent, server, [example])
  assert parts == {"exact_answer": 2.5, "digit_share": 0.1}  # the total 2.6 is their sum


def test_verifiers_hub_failed_episode_is_an_error(offline, hub_envs):
  agent = verifiers_hub.make_agent("rrl_vf_addition", {"taskset": {"count": 1}})
  with FakeOpenAIServer([]) as server, pytest.raises(hub_support.HubEpisodeError,
                                                     match="failed: .*500"):
    run_episodes(agent, server, agent.examples())
  assert len(server.chat_requests) == 1


@pytest.mark.parametrize("env_id, env_args, field", [
    ("rrl_no_such_env", {}, "config.agent.env_id: verifiers environment 'rrl_no_such_env' is not"),
    ("", {}, "config.agent.env_id: the verifiers environment's id is required"),
    ("json", {}, "config.agent.env_id: 'json' is not a verifiers environment"),
    ("rrl_vf_addition", {"agent": {"harness": {"id": "rrl_no_such_harness"}}},
     "config.agent.env_args: harness 'rrl_no_such_harness' not found"),
    ("rrl_vf_addition", {"taskset": {"count": "many"}}, "config.agent.env_args.taskset.count: "),
    ("rrl_vf_addition", {"taskset": {"id": "other"}}, "config.agent.env_args.taskset.id: "),
    ("rrl_vf_addition", {"agent": {"runtime": {"type": "prime"}}},
     "config.agent.env_args.agent.runtime: 'prime' is remote"),
])
def test_verifiers_hub_bad_settings_name_the_field(hub_envs, env_id, env_args, field):
  with pytest.raises(ConfigError) as error:
    verifiers_hub.agent_from_settings({"env_id": env_id, "env_args": env_args})
  assert str(error.value).startswith(field)
  assert "\n" not in str(error.value)


# --- OpenEnv -------------------------------------------------------------------------------------


def guess_reply(script):
  """The scripted model: the n-th reply of an episode is script[max_guesses][n] (the episodes of
  the test differ in max_guesses, which the environment's first message states)."""

  def reply(body):
    opening = next(m["content"] for m in body["messages"] if m["role"] == "user")
    max_guesses = int(opening.split("You have ")[1].split()[0])
    turn = sum(m["role"] == "assistant" for m in body["messages"])
    return script[max_guesses][turn]

  return reply


@pytest.mark.parametrize("transport", ["in_process", "server"])
def test_openenv_hub_accumulates_step_rewards(offline, hub_envs, transport):
  # The environment gives +1 for the right guess and -0.25 for a wrong one, and ends the episode
  # after max_guesses guesses; "seven" makes no GuessAction, so it costs a turn but no guess.
  # max_guesses -> (target, the model's replies, what the episode must return)
  episodes = {
      2: (7, ["7"], {"reward": 1.0}),
      3: (4, ["5", "seven", "4"], {"reward": 1.0 - 0.25}),
      5: (9, ["1", "2", "3", "4", "5"], {"reward": 5 * -0.25}),
      9: (2, ["8"] * 6, {"reward": 6 * -0.25}),  # max_turns (6) ends it
  }
  agent = openenv_hub.agent_from_settings({
      "environment": GUESS_ENV, "transport": transport, "max_turns": 6,
      "system_prompt": "Play the game.", "entry": "not an adapter setting: ignored"})
  examples = [{"target": target, "max_guesses": n, "question": "not a reset argument"}
              for n, (target, _, _) in episodes.items()]
  try:
    with FakeOpenAIServer(guess_reply({n: e[1] for n, e in episodes.items()})) as server:
      results = run_episodes(agent, server, examples)
  finally:
    agent.close()
  assert results == [expected for _, _, expected in episodes.values()]
  # Every model turn is one request to the scripted server, and nothing else was requested.
  assert len(server.chat_requests) == 1 + 3 + 5 + 6 == len(server.requests)
  longest_of_3 = max((r.body["messages"] for r in server.chat_requests
                      if "You have 3 guesses" in r.body["messages"][1]["content"]), key=len)
  assert [m["role"] for m in longest_of_3] == ["system"] + ["user", "assistant"] * 2 + ["user"]
  assert [m["content"] for m in longest_of_3[:5]] == [
      "Play the game.",
      "I am thinking of a number from 1 to 10. You have 3 guesses. Reply with a number.",
      "5", "Wrong, lower.", "seven"]
  assert longest_of_3[5]["content"].startswith("Invalid action: guess: Input should be a valid "
                                               "integer")


def test_openenv_hub_json_replies_and_own_mappings(offline, hub_envs):
  """A JSON-object reply is the action's fields; `action` / `observation` settings replace the
  default mappings."""
  agent = openenv_hub.make_agent(GUESS_ENV)
  with FakeOpenAIServer(['{"guess": 3}']) as server:
    assert run_episodes(agent, server, [{"target": 3}]) == [{"reward": 1.0}]
  own = openenv_hub.make_agent(GUESS_ENV, action="tests.test_agent_hubs:guess_from_words",
                               observation="tests.test_agent_hubs:shout")
  with FakeOpenAIServer(["my guess is five", "my guess is six"]) as server:
    assert run_episodes(own, server, [{"target": 6}]) == [{"reward": 1.0 - 0.25}]
  assert server.chat_requests[1].body["messages"][-1]["content"] == "WRONG, HIGHER."


def guess_from_words(reply):
  words = {"five": 5, "six": 6}
  return {"guess": words[reply.split()[-1]]}


def shout(fields):
  return fields["feedback"].upper()


@pytest.mark.parametrize("settings, field", [
    ({"environment": "rrl_no_such_module:Env"}, "config.agent.environment: cannot import"),
    ({"environment": "rrl_openenv_guess:NoSuchEnv"}, "config.agent.environment: module"),
    ({"environment": "rrl_openenv_guess:GuessAction"}, "config.agent.environment: "),
    ({}, "config.agent.environment: the OpenEnv Environment to run is required"),
    ({"environment": GUESS_ENV, "transport": "docker"}, "config.agent.transport: 'docker'"),
    ({"environment": GUESS_ENV, "env_args": {"colour": 1}}, "config.agent.env_args: "),
    ({"environment": GUESS_ENV, "max_turns": 0}, "config.agent.max_turns: "),
    ({"environment": GUESS_ENV, "action": "rrl_openenv_guess"}, "config.agent.action: "),
])
def test_openenv_hub_bad_settings_name_the_field(hub_envs, settings, field):
  with pytest.raises(ConfigError) as error:
    openenv_hub.agent_from_settings(settings)
  assert str(error.value).startswith(field)
  assert "\n" not in str(error.value)


def test_agent_factories_are_marked_for_the_loader():
  assert verifiers_hub.agent_from_settings.takes_agent_settings
  assert openenv_hub.agent_from_settings.takes_agent_settings


# --- the trainer's loader, the schema and the data source ----------------------------------------

factory_calls = []


@hub_support.takes_agent_settings
def counting_factory(settings):
  """A hub-style factory: records the settings it is called with, returns an agent."""
  factory_calls.append(dict(settings))

  async def agent(client, example):
    return float(settings["max_turns"])

  return agent


@hub_support.takes_agent_settings
def not_an_agent_factory(settings):
  return "not callable"


async def plain_agent(client, example):
  return 0.0


def agent_config(**agent):
  config = config_schema.base_config()
  config.workdir = "/tmp/unused"
  for name, value in agent.items():
    setattr(config.agent, name, value)
  return config


def test_the_loader_calls_a_settings_factory_once_per_settings():
  factory_calls.clear()
  config = agent_config(entry="tests.test_agent_hubs:counting_factory", max_turns=3)
  first = entry_lib.load_agent(config)
  assert entry_lib.load_agent(config) is first  # the data source and the collector share it
  assert len(factory_calls) == 1
  # the factory gets the whole section as a plain dict: the declared hub settings, defaults filled
  assert factory_calls[0]["max_turns"] == 3 and factory_calls[0]["env_args"] == {}
  assert factory_calls[0]["entry"] == "tests.test_agent_hubs:counting_factory"
  assert asyncio.run(first(None, {})) == 3.0
  config.agent.max_turns = 5  # other settings: another agent
  assert asyncio.run(entry_lib.load_agent(config)(None, {})) == 5.0 and len(factory_calls) == 2
  # a plain agent function is used as it is
  assert entry_lib.load_agent(agent_config(entry="tests.test_agent_hubs:plain_agent")) is (
      plain_agent)


@pytest.mark.parametrize("agent, message", [
    ({"entry": "tests.test_agent_hubs:plain_agent", "env_id": "gsm8k"},
     "config.agent.env_id='gsm8k': only a hub adapter's entry"),
    ({"entry": "tests.test_agent_hubs:plain_agent", "env_args": {"x": 1}},
     "config.agent.env_args="),
    ({"entry": "tests.test_agent_hubs:not_an_agent_factory"},
     "config.agent.entry='tests.test_agent_hubs:not_an_agent_factory': the factory returned str"),
    ({"entry": "tests.test_agent_hubs:guess_from_words"}, "config.agent.entry=.*must be an async"),
])
def test_the_loader_refuses_settings_nothing_reads_and_non_agents(agent, message):
  with pytest.raises(ConfigError, match=message):
    entry_lib.load_agent(agent_config(**agent))


def test_a_plain_agent_takes_the_trainers_own_agent_settings():
  # every agent.* field that is not a hub setting (tool_syntax, history_mismatch, …) is the
  # trainer's, so setting it with a plain agent entry is not mistaken for an unread hub setting
  trainer_fields = [dotted for dotted in config_schema.FIELDS
                    if dotted.startswith("agent.")
                    and dotted.removeprefix("agent.") not in entry_lib.HUB_SETTINGS]
  assert "agent.tool_syntax" in trainer_fields and "agent.history_mismatch" in trainer_fields
  config = agent_config(entry="tests.test_agent_hubs:plain_agent", tool_syntax="hermes",
                        history_mismatch="refuse")
  assert entry_lib.load_agent(config) is plain_agent


@pytest.mark.parametrize("field, value", [
    ("transport", "docker"), ("max_turns", 0), ("turn_tokens", -1), ("model", ""),
    ("environment", "rrl_openenv_guess.GuessEnvironment"), ("action", "no colon"),
    ("observation", "a:b:c"),
])
def test_hub_settings_are_validated_by_the_schema(field, value):
  config = agent_config()
  setattr(config.agent, field, value)
  with pytest.raises(ConfigError, match=rf"^config\.agent\.{field}="):
    config_lib.validate(config)


TASKS = [{"prompt": "What is 1 + 2?", "a": 1, "b": 2, "answer": 3},
         {"prompt": [{"role": "user", "content": "hi"}], "answer": "x"},
         {"question": "no prompt field"}]


def test_the_agent_source_yields_the_agents_tasks():
  source = tasks_lib.build_source(dict(kind="agent"), field="data.train",
                                  provided={"agent_examples": lambda: TASKS})
  examples = [source.example(i) for i in range(6)]
  assert [e.metadata for e in examples] == TASKS * 2  # in order, epoch after epoch
  assert [e.uid for e in examples[:3]] == ["agent/0", "agent/1", "agent/2"]
  assert examples[0].prompt == "What is 1 + 2?" and examples[0].answer == "3"
  assert examples[1].prompt == '[{"content": "hi", "role": "user"}]'
  assert examples[2].prompt == '{"question": "no prompt field"}' and examples[2].answer == ""
  # an adapter is handed the task dict back (the Example's metadata)
  assert hub_support.example_fields(examples[0]) == TASKS[0]
  shuffled = tasks_lib.build_source(dict(kind="agent", shuffle=True, seed=1), field="data.train",
                                    provided={"agent_examples": lambda: TASKS})
  for epoch in range(3):  # every epoch each task once, in the order numpy's permutation gives
    order = np.random.default_rng([1, epoch]).permutation(3)
    assert [shuffled.example(3 * epoch + i).metadata for i in range(3)] == [
        TASKS[j] for j in order]


@pytest.mark.parametrize("field, provided, message", [
    ("data.eval", None, "config.data.eval.kind='agent': only the training data"),
    ("data.train", None, "config.data.train.kind='agent': the tasks come from the agent"),
    ("data.train", {"agent_examples": lambda: []}, "brought no tasks"),
    ("data.train", {"agent_examples": lambda: ["text"]}, "task 0 is a str"),
])
def test_the_agent_source_is_refused_without_an_agents_tasks(field, provided, message):
  with pytest.raises(ConfigError, match=message):
    tasks_lib.build_source(dict(kind="agent"), field=field, provided=provided)


def test_agent_examples_needs_an_agent_with_examples(hub_envs):
  with pytest.raises(ConfigError, match="has no examples"):
    entry_lib.agent_examples(agent_config(entry="tests.test_agent_hubs:plain_agent"))
  config = agent_config(entry="reasoning_rl.agents.verifiers_hub:agent_from_settings",
                        env_id="rrl_vf_addition", env_args={"taskset": {"count": 2}})
  rows = entry_lib.agent_examples(config)
  assert [(r["a"] + r["b"], r["answer"]) for r in rows] == [(r["answer"],) * 2 for r in rows]
  assert len(rows) == 2
