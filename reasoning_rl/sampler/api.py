"""The rollout backend's interface: what the loop and the evaluations need from whatever samples.

A backend turns prompts into groups of completions with the log-probs of every token, takes new
weights tagged with a policy version, and stops. The loop (`loop.rollouts.RolloutCollector`, the
weight sync `loop.weight_sync.WeightSync`) and the held-out evaluation
(`evaluation.run_evaluation`) speak only this protocol, so another engine (a vLLM-TPU or
sglang-jax server, say) plugs in by registering a factory under the name `rollout.backend`
selects, with the optional capabilities it has:

    @register_backend("my-engine", summary="…", capabilities=Capabilities(multi_turn=True))
    def _make(spec: BackendSpec) -> RolloutBackend: ...

Built in: `engine` (`engine_backend.EngineBackend`, this package's JetStream-API `Engine`).

This module loads without JAX, flax or numpy (tests/test_sampler_api.py checks it): a backend
living in another process, or a tool that reads rollout files, needs nothing heavier.

The contract a backend keeps (what the loss and the checkpoints rely on):
- `generate` yields `Completion`s as they finish, G per prompt, each with `logprobs` (the model's
  unscaled log-softmax at every generated token) and, when the sampling settings change the
  distribution, `sampling_logprobs` (the distribution it drew from; docs/off_policy.md).
- Completion (prompt_id, sample_index) depends on (seed, prompt_id, sample_index) and the weights
  only, not on the batch it was generated in: a resumed run samples the same completions.
- `update_weights(tree, version=v)` returns once the backend decodes with `tree`; completions
  started afterwards report `policy_version` v.
- `last_usage()` reports what the last call that generated used, once its stream is exhausted
  (the loop logs it as sampler/*).
- The optional methods are those its `Capabilities` declare (`PartialRounds.generate_round`,
  `MultiTurnEpisodes.generate_episodes`); config validation refuses a config that needs one the
  selected backend did not declare, naming the field (`required_capabilities`).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from reasoning_rl import registries

# ---------------------------------------------------------------------------------- records


@dataclasses.dataclass
class Completion:
  """One sampled completion.

  Attributes:
    prompt_id: id of its prompt (its index unless `prompt_ids` were given).
    sample_index: its index within the group of `num_samples` (0..G-1).
    prompt_tokens: the prompt as prefilled (after truncation, if the engine truncates).
    completion_ids: generated token ids (a final stop id included).
    logprobs: log p(token) under the model's unscaled distribution (log_softmax of raw logits).
    sampling_logprobs: log p(token) under the distribution it was drawn from (temperature, top-k,
      top-p applied; 0 for greedy), or None when that distribution is the model's own.
    finish_reason: "stop_id", "stop_string" or "length".
    truncated: True iff finish_reason == "length" (budget or cache exhausted).
    policy_version: the engine's policy version (`loop.state.LoopState.policy_version`) when the
      completion started (if `update_params` runs while it decodes, later tokens come from newer
      weights; this is the oldest version).
    token_versions: a completion continued over rounds (`resume`): the policy version that drew
      each token; None when one version drew them all (`policy_version`).
    loss_mask: multi-turn episodes only (`sampler.multiturn`): 1 for each model token, 0 for each
      environment-observation token of `completion_ids` (whose log-probs are 0); None when every
      token is the model's.
    turns: multi-turn only: per model turn, its text, finish reason, and the environment's
      observation and info.
    reward_parts: multi-turn only: the environment's outcome (e.g. {"correct": 1.0}).
    episode_end: multi-turn only: "done" (the environment ended it), "max_turns", "turn_budget"
      (a model turn used its whole budget) or "token_budget" (the next observation would not fit).
    scored_response: multi-turn only: the text the verifiers read — the final model turn, or the
      whole conversation for an environment whose observations are trusted results
      (`scores_conversation`, e.g. a calculator).
    experts: mixture-of-experts models: [len(prompt_tokens) + len(completion_ids), L_sparse, k]
      (uint8, or uint16 past 256 experts), the experts each sparse layer sent each token to in
      the sampler (`rollout.routing_dtype`); None for a dense model.
  """

  prompt_id: int
  sample_index: int
  prompt_tokens: list[int]
  completion_ids: list[int]
  logprobs: list[float]
  sampling_logprobs: list[float] | None
  finish_reason: str
  truncated: bool
  policy_version: int
  loss_mask: list[int] | None = None
  turns: list[dict] | None = None
  reward_parts: dict[str, float] | None = None
  episode_end: str | None = None
  scored_response: str | None = None
  token_versions: list[int] | None = None
  experts: Any = None  # numpy.ndarray | None

  def to_json(self) -> dict:
    return _fields_as_json(self)

  @classmethod
  def from_json(cls, fields: dict) -> "Completion":
    return _from_json_fields(cls, fields)

  @property
  def num_model_tokens(self) -> int:
    """Tokens the model generated (an episode's observation tokens are not its own)."""
    return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))

  def scored_text(self, tokenizer) -> str:
    """What the verifiers read: the whole completion, or an episode's `scored_response`."""
    if self.scored_response is not None:
      return self.scored_response
    return tokenizer.decode(self.completion_ids, skip_special_tokens=True)


@dataclasses.dataclass
class Unfinished:
  """A sample a round ended before it finished (`rollout.stream_groups(..., round_over=...)`).

  completion_ids, logprobs, sampling_logprobs: what it drew so far (possibly nothing: it never had
    a slot), log-probs as in `Completion` (sampling_logprobs always recorded here).
  token_versions: the policy version that drew each token.
  experts: MoE models: the routing of the tokens drawn so far ([n, L_sparse, k], as
    `Completion.experts` without the prompt).
  """

  prompt_id: int
  sample_index: int
  completion_ids: list[int]
  logprobs: list[float]
  sampling_logprobs: list[float]
  token_versions: list[int]
  experts: Any = None  # numpy.ndarray | None

  def to_json(self) -> dict:
    return _fields_as_json(self)

  @classmethod
  def from_json(cls, fields: dict) -> "Unfinished":
    return _from_json_fields(cls, fields)


def _fields_as_json(item) -> dict:
  """A Completion's or Unfinished's fields as JSON: its routing as `array_to_json` writes it."""
  fields = {field.name: getattr(item, field.name) for field in dataclasses.fields(item)}
  fields["experts"] = array_to_json(item.experts)
  return fields


def _from_json_fields(cls, fields: dict):
  """Inverse of `_fields_as_json` (a record without routing reads as None)."""
  return cls(**dict(fields, experts=array_from_json(fields.get("experts"))))


def array_to_json(array) -> dict | None:
  """A numpy array (a routing record, a rollout column) as JSON: shape, dtype and its bytes in
  base64 (a list of lists of a long completion's routing would be ten times the size, and a
  number list of float32 log-probs would not read back bit for bit everywhere). `tobytes` writes
  C order whatever the array's memory layout."""
  if array is None:
    return None
  return {"shape": list(array.shape), "dtype": array.dtype.name,
          "data": base64.b64encode(array.tobytes()).decode("ascii")}


def array_from_json(item: dict | None):
  """Inverse of `array_to_json`: a numpy array, or None."""
  if item is None:
    return None
  # numpy only for a record that carries routing (a mixture-of-experts run's): this module
  # stays importable without it
  import numpy as np  # pylint: disable=import-outside-toplevel

  data = base64.b64decode(item["data"])
  return np.frombuffer(data, np.dtype(item["dtype"])).reshape(item["shape"]).copy()


# ---------------------------------------------------------------------------------- usage


@dataclasses.dataclass
class DecodeUsage:
  """What a `stream_groups` call's decoding used: `generate` calls, decode steps, and slot-steps
  (slots × steps) of which `live_slot_steps` decoded a sample. 1 − live / slot-steps is the
  share of the decode batch that idled (e.g. waiting for a group's longest completion)."""

  calls: int = 0
  steps: int = 0
  slot_steps: int = 0
  live_slot_steps: int = 0
  preempted: int = 0  # samples a full paged cache sent back to the queue (continued later)

  @property
  def idle_fraction(self) -> float:
    return 1.0 - self.live_slot_steps / self.slot_steps if self.slot_steps else 0.0


@dataclasses.dataclass
class ExactStats:
  """What one `exact.exact_groups` call did (logged as sampler/exact_*).

  draft_mismatch_mean / _max: mean and largest |log-prob the decode path reported − canonical
  log-prob| over the drafts' tokens before any repair (the mismatch the mode removes).
  """

  sequences: int = 0
  tokens: int = 0
  repairs: int = 0
  repaired_sequences: int = 0
  rounds: int = 0
  draft_mismatch_mean: float = 0.0
  draft_mismatch_max: float = 0.0
  score_s: float = 0.0
  repair_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class CallUsage:
  """What a backend's last call that generated used (`RolloutBackend.last_usage`).

  decode: its decode batch's use (None: the backend does not measure it, or the call was exact).
  exact: the work of exact rollouts (`rollout.exact_logprobs`; None for other calls).
  """

  decode: DecodeUsage | None = None
  exact: ExactStats | None = None


# ---------------------------------------------------------------------------------- capabilities


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a backend can do beyond `RolloutBackend`, declared where it registers. Config
  validation refuses a config that needs a capability the selected backend lacks
  (`required_capabilities`), before anything is built."""

  # `generate_round`: continue samples across steps (partial_rollouts.enabled)
  partial_rounds: bool = False
  # verify drafts against the canonical forward (rollout.exact_logprobs)
  exact_logprobs: bool = False
  # `generate_episodes` with an environment (environment.name)
  multi_turn: bool = False
  # a paged KV cache (rollout.kv_page_size, kv_pages, kv_page_kernel)
  paged_kv: bool = False
  # MoE models: each token's experts in `Completion.experts` (algo.routing_replay)
  expert_routing: bool = False
  # `engine`: an `Engine` that the agent rollout server's one thread may drive between calls
  # (agent.entry, reasoning_rl/agents)
  agent_server: bool = False
  # decode the qwix-quantized model it is built with and take quantized weight syncs
  # (rollout.weight_quantization, sampler/quantized.py)
  quantized_weights: bool = False

  def names(self) -> tuple[str, ...]:
    """The capabilities declared, by field name."""
    return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))


# (config field, capability it needs when set, what the field asks of the backend, the value that
# turns it off). The field is "set" when its value is truthy and not 'none'.
CAPABILITY_FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("partial_rollouts.enabled", "partial_rounds", "continues samples across steps", "False"),
    ("environment.name", "multi_turn", "runs multi-turn episodes", "''"),
    ("rollout.exact_logprobs", "exact_logprobs", "verifies drafts against the canonical forward",
     "False"),
    ("rollout.kv_page_size", "paged_kv", "holds a paged KV cache", "0"),
    ("algo.routing_replay", "expert_routing", "records each token's experts", "False"),
    ("agent.entry", "agent_server", "lends its engine to the agent rollout server", "''"),
    ("rollout.weight_quantization", "quantized_weights", "decodes with quantized weights",
     "'none'"),
)


def required_capabilities(value_of: Callable[[str], Any]) -> list[tuple[str, str, str, str]]:
  """The `CAPABILITY_FIELDS` rows whose field is set; `value_of(dotted field) -> value`."""
  return [row for row in CAPABILITY_FIELDS if value_of(row[0]) and value_of(row[0]) != "none"]


# ---------------------------------------------------------------------------------- the protocol


class RolloutBackend(Protocol):
  """Generates groups of completions with log-probs under the weights it was last given."""

  @property
  def policy_version(self) -> int:
    """The version of the weights it decodes with (`loop.state.LoopState.policy_version`)."""

  def generate(self, prompts: Sequence[Sequence[int]], *, prompt_ids: Sequence[int],
               num_samples: int, sampling, max_new_tokens: int, stop_ids: Sequence[int],
               stop_strings: Sequence[str], tokenizer, seed: int,
               should_stop: Callable[[], bool] | None = None,
               for_training: bool = True) -> Iterator[Completion]:
    """Yields the `num_samples` completions of every prompt as they finish (any order).

    `sampling`: a `sampler.sampling.SamplingParams`. `should_stop` is asked between decode
    calls; True raises `errors.PhaseInterrupted`. `for_training=False`: completions nothing
    trains on (held-out evaluation); the backend may skip what only the loss needs (the
    engine's exact verification)."""

  def update_weights(self, weights: Any, *, version: int, adapters_only: bool = False) -> None:
    """Decodes with `weights` from now on, as policy `version`; returns once they are in place.
    `adapters_only`: `weights` are LoRA adapters alone, to join to the base the backend holds."""

  def last_usage(self) -> CallUsage:
    """What the last call that generated (`generate`, `generate_round`, `generate_episodes`)
    used, read once its stream is exhausted (`CallUsage()` when it measured nothing)."""

  def stop(self) -> None:
    """Releases what the backend holds (threads, servers, device buffers); idempotent."""


class PartialRounds(Protocol):
  """`Capabilities.partial_rounds`: one round of partial rollouts (`loop.partial_rollouts`)."""

  def generate_round(self, prompts: Sequence[Sequence[int]], *,
                     samples: Sequence[tuple[int, int]], resume: Sequence[Unfinished],
                     round_over: Callable[[], bool], **common) -> Iterator[Completion | Unfinished]:
    """`generate` for the `samples` (prompt id, sample index) pairs, continuing the `resume`
    ones where they stopped, until `round_over()` says the round is over; the samples not
    finished then come out as `Unfinished`."""


class MultiTurnEpisodes(Protocol):
  """`Capabilities.multi_turn`: episodes with an environment (`sampler.multiturn`)."""

  def generate_episodes(self, prompts: Sequence[Sequence[int]], *, examples, episodes,
                        prompt_ids: Sequence[int], num_samples: int, sampling,
                        max_new_tokens: int, stop_ids: Sequence[int], tokenizer, seed: int,
                        should_stop: Callable[[], bool] | None = None) -> Iterator[Completion]:
    """`episodes` (`multiturn.EpisodeSettings`): `max_new_tokens` bounds a whole completion,
    observations included; `episodes.turn_tokens` one model turn."""


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


# ---------------------------------------------------------------------------------- registration


def register_backend(name: str, *, summary: str, options: tuple[str, ...] = (),
                     capabilities: Capabilities = Capabilities()) -> Callable[[Any], Any]:
  """Decorator: registers a factory `(BackendSpec) -> RolloutBackend` in
  `registries.ROLLOUT_BACKENDS` as `name`, with the capabilities its backends have."""
  return registries.ROLLOUT_BACKENDS.register(name, summary=summary, options=options,
                                              capabilities=capabilities)


def capabilities_of(name: str) -> Capabilities:
  """What the backend registered as `name` declared (ConfigError naming `rollout.backend` for an
  unknown name). A backend registered without a declaration has none."""
  declared = registries.ROLLOUT_BACKENDS.get(name).capabilities
  return declared if declared is not None else Capabilities()


__all__ = ["BackendSpec", "CAPABILITY_FIELDS", "CallUsage", "Capabilities", "Completion",
           "DecodeUsage", "ExactStats", "MultiTurnEpisodes", "PartialRounds", "RolloutBackend",
           "Unfinished", "capabilities_of", "register_backend", "required_capabilities",
           "array_from_json", "array_to_json"]
