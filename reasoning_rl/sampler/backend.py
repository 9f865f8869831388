"""The rollout backend: what the training loop needs from whatever generates its completions.

A backend turns prompts into groups of completions with the log-probs of every token, takes new
weights tagged with a policy version, and stops. The loop (`loop.rollouts.RolloutCollector`, the
weight sync `loop.weight_sync.WeightSync`) speaks only this protocol, so another engine (a paged
or a vLLM-TPU / sglang-jax server) plugs in by registering a factory in
`registries.ROLLOUT_BACKENDS` under the name `rollout.backend` selects:

    @registries.ROLLOUT_BACKENDS.register("my-engine", summary="…")
    def _make(spec: BackendSpec) -> RolloutBackend: ...

Built in: `engine` (`EngineBackend`: this package's JetStream-API `Engine`, driven by the
continuous-batching scheduler of `rollout.stream_groups`). The same `Engine` is served under
JetStream's own orchestrator by `jetstream_adapter.jetstream_engine`.

The contract a backend keeps (what the loss and the checkpoints rely on):
- `generate` yields `rollout.Completion`s as they finish, G per prompt, each with `logprobs` (the
  model's unscaled log-softmax at every generated token) and, when the sampling settings change
  the distribution, `sampling_logprobs` (the distribution it drew from; docs/off_policy.md).
- Completion (prompt_id, sample_index) depends on (seed, prompt_id, sample_index) and the weights
  only, not on the batch it was generated in: a resumed run samples the same completions.
- `update_weights(tree, version=v)` returns once the backend decodes with `tree`; completions
  started afterwards report `policy_version` v.
- Optional: `generate_episodes` (multi-turn episodes with an environment, `sampler.multiturn`);
  a run with `environment.name` set needs a backend that has it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx

from reasoning_rl import registries
from reasoning_rl.errors import SamplingError
from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.paged import make_engine
from reasoning_rl.sampler.exact import CanonicalScorer, ExactStats, exact_groups
from reasoning_rl.sampler.multiturn import EpisodeSettings, stream_episodes
from reasoning_rl.sampler.rollout import Completion, DecodeUsage, Unfinished, stream_groups
from reasoning_rl.sampler.sampling import SamplingParams


@runtime_checkable
class RolloutBackend(Protocol):
  """Generates groups of completions with log-probs under the weights it was last given."""

  @property
  def policy_version(self) -> int:
    """The version of the weights it decodes with (`loop.state.LoopState.policy_version`)."""

  def generate(self, prompts: Sequence[Sequence[int]], *, prompt_ids: Sequence[int],
               num_samples: int, sampling: SamplingParams, max_new_tokens: int,
               stop_ids: Sequence[int], stop_strings: Sequence[str], tokenizer, seed: int,
               should_stop: Callable[[], bool] | None = None) -> Iterator[Completion]:
    """Yields the `num_samples` completions of every prompt as they finish (any order).

    `should_stop` is asked between decode calls; True raises `errors.PhaseInterrupted`."""

  def update_weights(self, weights: Any, *, version: int, adapters_only: bool = False) -> None:
    """Decodes with `weights` from now on, as policy `version`; returns once they are in place.
    `adapters_only`: `weights` are LoRA adapters alone, to join to the base the backend holds."""

  def stop(self) -> None:
    """Releases what the backend holds (threads, servers, device buffers); idempotent."""


@dataclasses.dataclass(frozen=True)
class BackendSpec:
  """What a backend factory gets: the policy and the rollout's sizes.

  model: the sampler's model (an NNX module in the compute dtype; with LoRA 'merged', merged).
  mesh: this process's sampler mesh (None: one device).
  max_concurrent_decodes, max_prefill_length, steps_per_call: `rollout.*`.
  max_decode_length: the longest completion any caller asks for (rollouts and evaluations).
  seed: `config.seed` (requests without a key of their own derive theirs from it).
  config: the whole run config, for backends with settings of their own.
  """

  model: Any
  mesh: Any
  max_concurrent_decodes: int
  max_prefill_length: int
  max_decode_length: int
  steps_per_call: int
  seed: int
  config: Any = None


class EngineBackend:
  """`RolloutBackend` over this package's `Engine`: prefix-shared groups, continuous batching,
  the engine's KV cache in slots (`rollout.stream_groups`), weights copied device to device.

  With a `scorer` (`rollout.exact_logprobs`), `generate` is `exact.exact_groups`: drafts verified
  and repaired against the canonical forward, whose log-probs it reports; `exact_stats` then holds
  the last call's `exact.ExactStats`."""

  def __init__(self, engine: Engine, scorer: CanonicalScorer | None = None):
    self.engine = engine
    self.scorer = scorer
    self.exact_stats: ExactStats | None = None
    self.decode_usage: DecodeUsage | None = None  # the last call's (not for exact rollouts)
    self._stopped = False

  @property
  def policy_version(self) -> int:
    return self.engine.policy_version

  def _check_running(self) -> None:
    if self._stopped:
      raise SamplingError("the rollout backend was stopped; build a new one")

  def generate(self, prompts, *, prompt_ids, num_samples, sampling, max_new_tokens, stop_ids,
               stop_strings, tokenizer, seed, should_stop=None) -> Iterator[Completion]:
    self._check_running()
    common = dict(num_samples=num_samples, sampling=sampling, max_new_tokens=max_new_tokens,
                  stop_ids=stop_ids, stop_strings=stop_strings, tokenizer=tokenizer, seed=seed,
                  prompt_ids=prompt_ids, should_stop=should_stop)
    if self.scorer is None:
      self.decode_usage = DecodeUsage()
      return stream_groups(self.engine, prompts, usage=self.decode_usage, **common)
    self.decode_usage = None
    self.exact_stats = ExactStats()
    return exact_groups(self.engine, self.scorer, prompts, stats=self.exact_stats, **common)

  def generate_round(self, prompts, *, samples: Sequence[tuple[int, int]],
                     resume: Sequence[Unfinished], round_over: Callable[[], bool],
                     **common) -> Iterator[Completion | Unfinished]:
    """One round of partial rollouts (`loop.partial_rollouts`): `generate` for the `samples`
    (prompt id, sample index) pairs, continuing the `resume` ones where they stopped, until
    `round_over()` says the round is over; the samples not finished then come out as
    `Unfinished` (`rollout.stream_groups`)."""
    self._check_running()
    if self.scorer is not None:
      raise SamplingError("partial rollouts continue samples under new weights, which exact "
                          "rollouts (rollout.exact_logprobs) do not verify; turn one of them off")
    self.decode_usage = DecodeUsage()
    return stream_groups(self.engine, prompts, samples=samples, resume=resume,
                         round_over=round_over, usage=self.decode_usage, **common)

  def generate_episodes(self, prompts, *, examples, episodes: EpisodeSettings, prompt_ids,
                        num_samples, sampling, max_new_tokens, stop_ids, tokenizer, seed,
                        should_stop=None) -> Iterator[Completion]:
    """Multi-turn episodes (`multiturn.stream_episodes`): `max_new_tokens` bounds a whole
    completion, observations included; `episodes.turn_tokens` one model turn."""
    self._check_running()
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


@registries.ROLLOUT_BACKENDS.register(
    "engine", summary="this package's JetStream-API engine: prefix-shared groups, continuous "
    "batching, KV cache in slots, device-to-device weight copies",
    options=("rollout.max_concurrent_decodes", "rollout.max_prefill_length",
             "rollout.steps_per_call", "rollout.kv_page_size", "rollout.kv_pages",
             "rollout.kv_page_kernel",
             "rollout.exact_logprobs"))
def _engine_backend(spec: BackendSpec) -> EngineBackend:
  rollout = spec.config.rollout if spec.config is not None else {}
  engine = make_engine(
      spec.model, kv_page_size=rollout.get("kv_page_size", 0),
      kv_pages=rollout.get("kv_pages", 0), kv_page_kernel=rollout.get("kv_page_kernel", "auto"),
      mesh=spec.mesh,
      max_concurrent_decodes=spec.max_concurrent_decodes,
      max_prefill_length=spec.max_prefill_length, max_decode_length=spec.max_decode_length,
      steps_per_call=spec.steps_per_call, seed=spec.seed)
  scorer = None
  if spec.config is not None and spec.config.rollout.get("exact_logprobs", False):
    scorer = CanonicalScorer(nnx.graphdef(spec.model), max_prompt_length=spec.max_prefill_length,
                             max_completion_length=spec.max_decode_length)
  return EngineBackend(engine, scorer)


def as_backend(sampler: RolloutBackend | Engine) -> RolloutBackend:
  """`sampler` itself, or a bare `Engine` (what `build_evaluation` and the launchers hold) as an
  `EngineBackend`."""
  return EngineBackend(sampler) if isinstance(sampler, Engine) else sampler


def make_backend(name: str, spec: BackendSpec) -> RolloutBackend:
  """The backend registered as `name` (ConfigError naming `rollout.backend` otherwise)."""
  return registries.ROLLOUT_BACKENDS.get(name).impl(spec)


__all__ = ["BackendSpec", "EngineBackend", "RolloutBackend", "as_backend", "make_backend"]
