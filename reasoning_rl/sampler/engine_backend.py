"""The built-in rollout backend `engine`: `sampler.api.RolloutBackend` over this package's
JetStream-API `Engine`, driven by the continuous-batching scheduler of `rollout.stream_groups`.

It declares every optional capability (`api.Capabilities`): rounds of partial rollouts, exact
log-probs, multi-turn episodes, a paged KV cache, each token's experts, quantized weights (the
engine merges whatever graph and state it is given, qwix's quantized one included) and its
`engine` lent to the agent rollout server (`reasoning_rl.agents`). The same `Engine` is
served under JetStream's own orchestrator by `jetstream_adapter.jetstream_engine`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import jax
from flax import nnx

from reasoning_rl import registries
from reasoning_rl.errors import SamplingError
from reasoning_rl.sampler.api import (BackendSpec, CallUsage, Capabilities, Completion,
                                      DecodeUsage, ExactStats, RolloutBackend, Unfinished,
                                      register_backend)
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.engine_factory import EngineSpec, make_engine
from reasoning_rl.sampler.exact import CanonicalScorer, exact_groups
from reasoning_rl.sampler.multiturn import EpisodeSettings, stream_episodes
from reasoning_rl.sampler.rollout import stream_groups

CAPABILITIES = Capabilities(partial_rounds=True, exact_logprobs=True, multi_turn=True,
                            paged_kv=True, expert_routing=True, agent_server=True,
                            quantized_weights=True)


class EngineBackend:
  """`RolloutBackend` over this package's `Engine`: prefix-shared groups, continuous batching,
  the engine's KV cache in slots (`rollout.stream_groups`), weights copied device to device.

  With a `scorer` (`rollout.exact_logprobs`), `generate` for training is `exact.exact_groups`:
  drafts verified and repaired against the canonical forward, whose log-probs it reports.
  Evaluations (`for_training=False`) decode plainly: held-out answers need no exact log-probs."""

  def __init__(self, engine: Engine, scorer: CanonicalScorer | None = None):
    self.engine = engine
    self.scorer = scorer
    self._usage = CallUsage()
    self._stopped = False

  @property
  def policy_version(self) -> int:
    return self.engine.policy_version

  def last_usage(self) -> CallUsage:
    return self._usage

  def _check_running(self) -> None:
    if self._stopped:
      raise SamplingError("the rollout backend was stopped; build a new one")

  def generate(self, prompts, *, prompt_ids, num_samples, sampling, max_new_tokens, stop_ids,
               stop_strings, tokenizer, seed, should_stop=None,
               for_training: bool = True) -> Iterator[Completion]:
    self._check_running()
    common = dict(num_samples=num_samples, sampling=sampling, max_new_tokens=max_new_tokens,
                  stop_ids=stop_ids, stop_strings=stop_strings, tokenizer=tokenizer, seed=seed,
                  prompt_ids=prompt_ids, should_stop=should_stop)
    if self.scorer is None or not for_training:
      self._usage = CallUsage(decode=DecodeUsage())
      return stream_groups(self.engine, prompts, usage=self._usage.decode, **common)
    self._usage = CallUsage(exact=ExactStats())
    return exact_groups(self.engine, self.scorer, prompts, stats=self._usage.exact, **common)

  def generate_round(self, prompts, *, samples: Sequence[tuple[int, int]],
                     resume: Sequence[Unfinished], round_over: Callable[[], bool],
                     **common) -> Iterator[Completion | Unfinished]:
    """One round of partial rollouts (`api.PartialRounds`, `rollout.stream_groups`)."""
    self._check_running()
    if self.scorer is not None:
      raise SamplingError("partial rollouts continue samples under new weights, which exact "
                          "rollouts (rollout.exact_logprobs) do not verify; turn one of them off")
    self._usage = CallUsage(decode=DecodeUsage())
    return stream_groups(self.engine, prompts, samples=samples, resume=resume,
                         round_over=round_over, usage=self._usage.decode, **common)

  def generate_episodes(self, prompts, *, examples, episodes: EpisodeSettings, prompt_ids,
                        num_samples, sampling, max_new_tokens, stop_ids, tokenizer, seed,
                        should_stop=None) -> Iterator[Completion]:
    """Multi-turn episodes (`api.MultiTurnEpisodes`, `multiturn.stream_episodes`): they measure
    no usage (`last_usage()` is empty after one)."""
    self._check_running()
    self._usage = CallUsage()
    return stream_episodes(
        self.engine, prompts, examples=examples, environment=episodes.environment,
        format_observation=episodes.format_observation, tokenizer=tokenizer,
        num_samples=num_samples, sampling=sampling,
        max_new_tokens=min(episodes.turn_tokens, max_new_tokens), max_turns=episodes.max_turns,
        max_total_tokens=max_new_tokens, stop_ids=stop_ids, seed=seed, prompt_ids=prompt_ids,
        step_workers=episodes.step_workers, should_stop=should_stop)

  def update_weights(self, weights, *, version: int, adapters_only: bool = False) -> None:
    self._check_running()
    jax.block_until_ready(self.engine.update_params(weights, version=version,
                                                    adapters_only=adapters_only))

  def stop(self) -> None:
    """The engine holds device buffers only; they go with it. Later calls are refused."""
    self._stopped = True


@register_backend(
    "engine", summary="this package's JetStream-API engine: prefix-shared groups, continuous "
    "batching, KV cache in slots, device-to-device weight copies",
    options=("rollout.max_concurrent_decodes", "rollout.max_prefill_length",
             "rollout.steps_per_call", "rollout.kv_page_size", "rollout.kv_pages",
             "rollout.kv_page_kernel", "rollout.exact_logprobs"),
    capabilities=CAPABILITIES)
def _engine_backend(spec: BackendSpec) -> EngineBackend:
  rollout = spec.config.rollout if spec.config is not None else None
  # without a config (a caller that sizes the engine itself): EngineSpec's contiguous cache
  kv_cache = {} if rollout is None else dict(kv_page_size=rollout.kv_page_size,
                                             kv_pages=rollout.kv_pages,
                                             kv_page_kernel=rollout.kv_page_kernel)
  engine = make_engine(spec.model, EngineSpec(
      max_concurrent_decodes=spec.max_concurrent_decodes,
      max_prefill_length=spec.max_prefill_length, max_decode_length=spec.max_decode_length,
      steps_per_call=spec.steps_per_call, seed=spec.seed, **kv_cache), mesh=spec.mesh)
  scorer = None
  if rollout is not None and rollout.exact_logprobs:
    scorer = CanonicalScorer(nnx.graphdef(spec.model), max_prompt_length=spec.max_prefill_length,
                             max_completion_length=spec.max_decode_length)
  return EngineBackend(engine, scorer)


def make_backend(name: str, spec: BackendSpec) -> RolloutBackend:
  """The backend registered as `name` (ConfigError naming `rollout.backend` otherwise). Imported
  from here, the built-in `engine` is registered by then."""
  return registries.ROLLOUT_BACKENDS.get(name).impl(spec)


__all__ = ["CAPABILITIES", "EngineBackend", "make_backend"]
