"""The sampler: a JetStream-API decode engine and group rollouts on the sampler device slice.

- `Engine` (engine.py): prefill / insert / generate with a donated, preallocated KV cache.
- `stream_groups` / `generate_groups` (rollout.py): G completions per prompt with prefix sharing,
  continuous batching, stop ids / stop strings / budgets, and per-sample deterministic PRNG keys.
- `SamplingParams`, `sample_tokens` (sampling.py): greedy, temperature, top-k and top-p.
- `jetstream_adapter.py`: serves an Engine under JetStream's own orchestrator, when installed.
"""

from reasoning_rl.sampler.engine import DecodeState, Engine, Prefix, ResultTokens, SlotRequest
from reasoning_rl.sampler.rollout import Completion, generate_groups, stream_groups
from reasoning_rl.sampler.sampling import SamplingParams, sample_key, sample_tokens

__all__ = ["Completion", "DecodeState", "Engine", "Prefix", "ResultTokens", "SamplingParams",
           "SlotRequest", "generate_groups", "sample_key", "sample_tokens", "stream_groups"]
