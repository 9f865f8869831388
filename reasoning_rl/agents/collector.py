"""User agents as rollouts: G episodes of `agent.entry` per prompt, trained on their exact tokens.

`config.agent.entry = "module:function"` names `async def run(client, example) -> float | dict`:
an agent program given an `openai.AsyncOpenAI` client whose base URL is its own session on the
rollout server (`server.RolloutServer`, `/sessions/<id>/v1`) and one task example. The
`AgentCollector` replaces the loop's `RolloutCollector`: for each prompt of a step it runs G
episodes concurrently (every episode of the step at once, so their requests share the engine's
decode slots), then turns each session's recorded tokens into `Completion`s (`sessions`) and the
agent's return value into the reward: a number is the reward, a dict {part: value} is summed
into it, each part logged as reward/<part>. Advantages and the update are the loop's own.

Failures (docs/agents.md): an episode that raises, or runs past `agent.episode_timeout_s`, is
dropped and counted (`episode/failed_frac`); a group with fewer than
`agent.min_episodes_per_group` episodes is skipped; a kept group short of G episodes is filled
with rows that train nothing (loss mask 0 everywhere) whose reward is the mean of the group's
episodes, so the group's mean and each episode's reward minus it are what the episodes alone
give. The guard `agent.max_failed_frac` stops a run whose steps drop more (`guards.py`).

Episode g of data position p is seeded as the in-process episode g of that prompt
(`driver.EngineDriver.own_episode`), so an agent that plays an environment's episode draws its
tokens. A row ends at its last model token: context a refused request sent (a tool's result past
the episode's token budget) was never decoded from, and the session takes it back
(`sessions.Session.abandon_turn`), so it is not trained.

Sessions split by `agent.history_mismatch = split` give several segments per episode, each a
sequence with its own prompt. A group's rows share one prompt (`RolloutColumns`): the first
request's, which every segment-1 of the group starts from. An episode's group row is therefore its
first segment, carrying the episode's reward and outcome (all its turns, how its last segment
ended), so the group's rewards and advantages are the G episodes'. Its other segments go into the
step's `agent.segment_rows` extra rows (`rl.segment_rows`): each takes its episode's advantage
once the loop computed it and trains as a sequence of its own. (An episode whose first prompt
differs from its group's — an agent that varies it — gets a row that trains nothing but carries
its reward, and all its segments go to the extra rows.) Segments fill the rows in the order of the
step's groups, episodes and segments; those past the rows are counted
(`episode/split_segments_dropped`), never silently lost, the others in
`episode/split_segments_trained`. A skipped group's episodes train nothing, their segments
included (counted with the group, `episode/groups_skipped`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from reasoning_rl.agents import chat
from reasoning_rl.agents.driver import EngineDriver
from reasoning_rl.agents.exact_turns import ExactTurns
from reasoning_rl.agents.entry import load_entry  # the entry loader (a hub factory or the agent)
from reasoning_rl.agents.server import RolloutServer
from reasoning_rl.errors import ConfigError, PhaseInterrupted
from reasoning_rl.loop.state import SampledBatch
from reasoning_rl.rl.rollout_columns import RolloutColumns
from reasoning_rl.rl.segment_rows import SegmentRows
from reasoning_rl.sampler.api import Completion
from reasoning_rl.verifiers.rewards import Reward

AGENT_VERSION = "agent-1"

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentSettings:
  """`config.agent` (docs/config.md)."""

  entry: str
  history_mismatch: str = "split"
  tool_syntax: str = ""
  episode_timeout_s: float = 300.0
  min_episodes_per_group: int = 2
  max_failed_frac: float = 0.5
  segment_rows: int = 0

  @classmethod
  def from_config(cls, config) -> "AgentSettings | None":
    a = config.agent
    if not a.entry:
      return None
    return cls(entry=a.entry, history_mismatch=a.history_mismatch, tool_syntax=a.tool_syntax,
               episode_timeout_s=a.episode_timeout_s,
               min_episodes_per_group=a.min_episodes_per_group,
               max_failed_frac=a.max_failed_frac, segment_rows=a.segment_rows)


def reward_of(value: Any) -> Reward:
  """An agent's return value as a `Reward`: a number is the total (part `agent`), a dict of
  numbers its parts, summed."""
  if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
    raise TypeError(f"the agent returned {value!r}; return a float or a dict of floats")
  parts = {"agent": float(value)} if not isinstance(value, dict) else {
      str(k): float(v) for k, v in value.items()}
  return Reward(total=float(sum(parts.values())), parts=parts, verifier_version=AGENT_VERSION)


@dataclasses.dataclass
class Episode:
  """One agent episode's outcome: its rows (one per segment) and reward, or why it failed."""

  completions: list[Completion]
  reward: Reward | None = None
  error: str | None = None
  # tool calls the model botched (kept as text by the server, `tool_calls.parse_completion`)
  malformed_tool_calls: int = 0


class AgentCollector:
  """The loop's collector for agent runs (module docstring); `max_prompt_tokens` and
  `max_new_tokens` bound each trained row's prompt and completion. `backend` declared the
  `agent_server` capability (`sampler.api.Capabilities`: it lends its `engine`); the collector
  serves that engine while it samples."""

  def __init__(self, backend, tokenizer, settings: AgentSettings, *, num_samples: int,
               max_new_tokens: int, sampling, seed: int, max_prompt_tokens: int = 0,
               agent: Callable | None = None):
    engine = getattr(backend, "engine", None)
    if engine is None:
      raise ConfigError("config.agent.entry: agent rollouts decode on a backend that lends its "
                        "engine (capability agent_server); set rollout.backend='engine'")
    self.backend = backend
    self.tokenizer = tokenizer
    self.settings = settings
    self.num_samples = num_samples
    self.sampling = sampling
    self.seed = seed
    self.agent = agent or load_entry(settings.entry)
    self.driver = EngineDriver(engine, tokenizer=tokenizer)
    # rollout.exact_logprobs: each served turn verified and repaired (agents/exact_turns.py)
    self.exact = ExactTurns.for_backend(backend, self.driver, tokenizer)
    self.server = RolloutServer(self.driver, tokenizer, sampling=sampling,
                                max_tokens=max_new_tokens, max_session_tokens=max_new_tokens,
                                max_segment_prompt=max_prompt_tokens,
                                history_mismatch=settings.history_mismatch,
                                tool_syntax=settings.tool_syntax, seed=seed, exact=self.exact)
    self._warned_dropped = False
    if settings.history_mismatch == "split" and not settings.segment_rows:
      warning = history_rewrite_warning(tokenizer)
      if warning:
        log.warning(warning)

  def close(self) -> None:
    self.server.stop()
    self.driver.stop()
    if self.exact is not None:
      self.exact.close()

  # ------------------------------------------------------------------------------ episodes

  def session_id(self, position: int, g: int) -> str:
    """Episode g of data position `position`: its session (and so its sampling seeds)."""
    return f"s{self.seed}-p{position}-g{g}"

  def run_episodes(self, examples: Sequence[tuple[int, Any]], *, should_stop=None
                   ) -> dict[int, list[Episode]]:
    """G episodes per (data position, example), all at once: {data position: episodes}.
    `should_stop` is asked twice a second; True cancels the episodes and raises
    `errors.PhaseInterrupted`. The episodes run on an event loop of their own thread, so a
    caller inside a running loop (a notebook) can call this too."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agent-episodes") as pool:
      return pool.submit(asyncio.run, self._all(examples, should_stop)).result()

  async def _all(self, examples, should_stop):
    jobs = [(position, g, example) for position, example in examples
            for g in range(self.num_samples)]
    everything = asyncio.gather(*(self._episode(p, g, e) for p, g, e in jobs))
    while not everything.done():
      await asyncio.wait({everything}, timeout=0.5)
      if should_stop is not None and not everything.done() and should_stop():
        everything.cancel()
        try:  # the episodes close their clients as they are cancelled
          await everything
        except asyncio.CancelledError:
          pass
        for position, g, _ in jobs:
          self.server.pop_session(self.session_id(position, g))
        raise PhaseInterrupted(f"agent episodes stopped on request ({len(jobs)} running)")
    done = everything.result()
    out: dict[int, list[Episode]] = {position: [] for position, _ in examples}
    for (position, _, _), episode in zip(jobs, done):
      out[position].append(episode)
    return out

  async def _episode(self, position: int, g: int, example) -> Episode:
    # the client is created here so that the `openai` package loads only for agent runs
    import openai  # pylint: disable=import-outside-toplevel

    session_id = self.session_id(position, g)
    # seeded as the in-process episode g of this data position is (driver.py)
    self.driver.own_episode(session_id, seed=self.seed, prompt_id=position, sample_index=g)
    client = openai.AsyncOpenAI(base_url=self.server.session_url(session_id), api_key="local",
                                max_retries=0, timeout=self.settings.episode_timeout_s)
    error = None
    try:
      value = await asyncio.wait_for(self.agent(client, example),
                                     timeout=self.settings.episode_timeout_s)
      reward = reward_of(value)
    except asyncio.TimeoutError:
      error = f"timed out after agent.episode_timeout_s={self.settings.episode_timeout_s}"
    except Exception as raised:  # pylint: disable=broad-except
      error = f"{type(raised).__name__}: {raised}"
    finally:
      await client.close()
      self.driver.release_episode(session_id)
    session = self.server.pop_session(session_id)
    completions = [] if session is None else session.completions(
        prompt_id=position, sample_index=g,
        keep_sampling_logprobs=self.sampling.changes_distribution)
    malformed = 0 if session is None else session.malformed_tool_calls
    # (a turn the server refused took its context back: each segment ends at a model token)
    if error is None and not completions:
      error = "the agent made no request of its session"
    if error is not None:
      return Episode(completions=[], error=error, malformed_tool_calls=malformed)
    return Episode(completions=completions, reward=reward, malformed_tool_calls=malformed)

  # ------------------------------------------------------------------------------ the loop

  def sample_batch(self, take_examples: Callable[[int], list], *, num_prompts: int,
                   dynamic_sampling: bool, max_rounds: int, policy_version: int,
                   should_stop=None) -> SampledBatch:
    """One step's groups from agent episodes (the loop's collector interface; dynamic sampling
    is refused at validation for agent runs)."""
    del dynamic_sampling, max_rounds
    start = time.perf_counter()
    examples = take_examples(num_prompts)
    episodes = self.run_episodes(examples, should_stop=should_stop)
    sample_s = time.perf_counter() - start
    groups, segments, stats = groups_of(
        episodes, [p for p, _ in examples], group_size=self.num_samples,
        min_episodes=self.settings.min_episodes_per_group, tokenizer=self.tokenizer,
        sampling=self.sampling, segment_rows=self.settings.segment_rows)
    if stats["split_segments_dropped"] and not self._warned_dropped:
      self._warned_dropped = True
      log.warning("%d segments of split episodes found no row (config.agent.segment_rows"
                  "=%d) and are not trained (episode/split_segments_dropped); raise "
                  "agent.segment_rows to train them", stats["split_segments_dropped"],
                  self.settings.segment_rows)
    rollouts = (RolloutColumns.concat(groups, group_size=self.num_samples) if groups
                else RolloutColumns.empty(self.num_samples))
    return SampledBatch(
        rollouts=rollouts, outcome=rollouts.outcome_fractions() if groups else {},
        groups_sampled=len(examples), scoring={"ok": len(groups), "timeout": 0, "error": 0},
        sample_s=sample_s, verify_s=0.0, policy_version=policy_version, agent=stats,
        exact=self.exact.take_stats() if self.exact is not None else None,
        segments=segments if self.settings.segment_rows else None)


def history_rewrite_warning(tokenizer) -> str | None:
  """What to tell, at start-up, a run whose chat template rewrites an earlier reasoning turn
  (`chat.keeps_history` on a reply with a <think> block: Qwen3, DeepSeek-R1) while
  `agent.segment_rows` is 0, so every episode of two turns or more would split and train only its
  first segment; None when the template keeps history (or there is none: such a run serves
  /v1/completions only)."""
  if getattr(tokenizer, "chat_template", None) is None:
    return None
  if chat.keeps_history(tokenizer, "<think>1</think>2"):
    return None
  return ("config.agent.segment_rows: this chat template rewrites an earlier reply in the next "
          "prompt (e.g. drops its <think> block), so every episode with a second turn splits "
          "and, with segment_rows=0, trains only its first segment (the rest are counted in "
          "episode/split_segments_dropped). Set agent.segment_rows (e.g. num_prompts x "
          "num_samples for one split per episode) to train them, or "
          "agent.history_mismatch='refuse'")


def groups_of(episodes: dict[int, list[Episode]], positions: Sequence[int], *, group_size: int,
              min_episodes: int, tokenizer, sampling, segment_rows: int = 0
              ) -> tuple[list[RolloutColumns], SegmentRows, dict]:
  """The kept groups of a step's episodes, the other segments of their split episodes that fit
  `segment_rows` rows (`agent.segment_rows`), and the step's `episode/*` counts (module
  docstring). Every row carries every reward part any episode of the step returned (0 where it
  did not); a segment carries its episode's reward."""
  names = list(dict.fromkeys(name for position in positions for e in episodes[position]
                             if e.error is None for name in e.reward.parts))
  groups, failed, skipped, dropped_segments, filled = [], 0, 0, 0, 0
  segment_groups, episode_sample = [], []
  for position in positions:
    ok = [e for e in episodes[position] if e.error is None]
    failed += len(episodes[position]) - len(ok)
    if len(ok) < min_episodes:
      skipped += 1
      continue
    rows, rewards = [], []
    # the group's rows share one prompt: its first episode's first
    opening = ok[0].completions[0]
    for index, episode in enumerate(ok):
      rewards.append(Reward(episode.reward.total,
                            {n: episode.reward.parts.get(n, 0.0) for n in names},
                            episode.reward.verifier_version))
      in_row = episode.completions[0].prompt_tokens == opening.prompt_tokens
      rows.append(_episode_row(episode, tokenizer) if in_row else dataclasses.replace(
          _placeholder(opening, index), **_episode_outcome(episode, tokenizer)))
      for segment in episode.completions[1 if in_row else 0:]:
        if len(segment_groups) == segment_rows:
          dropped_segments += 1
          continue
        segment_groups.append(RolloutColumns.of_group(
            position, [segment], [segment.scored_text(tokenizer)], status="ok",
            rewards=[rewards[-1]], sampling=sampling))
        episode_sample.append(len(groups) * group_size + index)
    mean = Reward(total=float(np.mean([r.total for r in rewards])),
                  parts={n: float(np.mean([r.parts[n] for r in rewards])) for n in names},
                  verifier_version=AGENT_VERSION)
    while len(rows) < group_size:  # failed episodes: rows that train nothing
      filled += 1
      rows.append(_placeholder(opening, len(rows)))
      rewards.append(mean)
    for index, row in enumerate(rows):
      row.sample_index = index
    texts = [r.scored_text(tokenizer) for r in rows]
    groups.append(RolloutColumns.of_group(position, rows, texts, status="ok", rewards=rewards,
                                          sampling=sampling))
  total = max(sum(len(episodes[p]) for p in positions), 1)
  malformed = sum(e.malformed_tool_calls for p in positions for e in episodes[p])
  segments = (SegmentRows(RolloutColumns.concat(segment_groups, group_size=1),
                          np.array(episode_sample, np.int64))
              if segment_groups else SegmentRows.empty())
  return groups, segments, {
      "failed_frac": failed / total, "failed": failed, "groups_skipped": skipped,
      "placeholder_rows": filled, "split_segments_trained": len(segment_groups),
      "split_segments_dropped": dropped_segments, "malformed_tool_calls": malformed}


def _episode_outcome(episode: Episode, tokenizer) -> dict:
  """The episode-wide fields of its group row: every segment's turns, and how its last segment
  ended (its finish, truncation and the text of its answer)."""
  last = episode.completions[-1]
  return {"turns": [turn for segment in episode.completions for turn in segment.turns],
          "finish_reason": last.finish_reason, "truncated": last.truncated,
          "episode_end": last.episode_end, "scored_response": last.scored_text(tokenizer)}


def _episode_row(episode: Episode, tokenizer) -> Completion:
  """An episode's group row: its first segment's tokens (the group's prompt), the episode's
  outcome (`_episode_outcome`); an episode that did not split, as it is."""
  first = episode.completions[0]
  if len(episode.completions) == 1:
    return first
  return dataclasses.replace(first, **_episode_outcome(episode, tokenizer))


def _placeholder(like: Completion, index: int) -> Completion:
  """A row that trains nothing: `like`'s prompt, one masked token (a failed episode's; an
  episode whose first prompt is not its group's has its outcome on it, `groups_of`)."""
  return Completion(prompt_id=like.prompt_id, sample_index=index,
                    prompt_tokens=list(like.prompt_tokens), completion_ids=[like.prompt_tokens[-1]],
                    logprobs=[0.0], sampling_logprobs=None if like.sampling_logprobs is None
                    else [0.0], finish_reason="length", truncated=False,
                    policy_version=like.policy_version, loss_mask=[0],
                    turns=[{"model_text": "", "num_tokens": 0, "finish_reason": "failed"}],
                    episode_end="failed", scored_response="")


__all__ = ["AgentCollector", "AgentSettings", "Episode", "groups_of", "load_entry", "reward_of"]
