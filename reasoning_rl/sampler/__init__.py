"""The sampler: a JetStream-API decode engine and group rollouts on the sampler device slice.

- `Engine` (engine.py): prefill / insert / generate with a donated, preallocated KV cache.
- `stream_groups` / `generate_groups` (rollout.py): G completions per prompt with prefix sharing,
  continuous batching, stop ids / stop strings / budgets, and per-sample deterministic PRNG keys.
- `SamplingParams`, `sample_tokens` (sampling.py): greedy, temperature, top-k and top-p.
- `jetstream_adapter.py`: serves an Engine under JetStream's own orchestrator, when installed.
- `stream_episodes` / `EpisodeSettings` (multiturn.py): multi-turn episodes with an environment:
  observations appended to a live slot's KV cache, environment steps on worker threads.
- `RolloutBackend` (backend.py): what the loop needs of a sampler (`generate` groups with
  log-probs, `update_weights(tree, version)`, `stop`); `EngineBackend` implements it over `Engine`,
  and other engines plug in through `registries.ROLLOUT_BACKENDS` (`make_backend`).
"""

from reasoning_rl.sampler.backend import BackendSpec, EngineBackend, RolloutBackend, make_backend
from reasoning_rl.sampler.engine import DecodeState, Engine, Prefix, ResultTokens, SlotRequest
from reasoning_rl.sampler.multiturn import EpisodeSettings, generate_episodes, stream_episodes
from reasoning_rl.sampler.rollout import Completion, generate_groups, stream_groups
from reasoning_rl.sampler.sampling import SamplingParams, sample_key, sample_tokens

__all__ = ["BackendSpec", "Completion", "DecodeState", "Engine", "EngineBackend",
           "EpisodeSettings", "Prefix", "ResultTokens", "RolloutBackend", "SamplingParams",
           "SlotRequest", "generate_episodes", "generate_groups", "make_backend", "sample_key",
           "sample_tokens", "stream_episodes", "stream_groups"]
