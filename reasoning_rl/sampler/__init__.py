"""The sampler: a JetStream-API decode engine and group rollouts on the sampler device slice.

- `api.py` (no JAX): `RolloutBackend`, what the loop and the evaluations need of a sampler
  (`generate` groups with log-probs, `update_weights(tree, version)`, `last_usage`, `stop`), the
  `Completion` / `Unfinished` / usage records it speaks, and the `Capabilities` a backend declares
  where it registers (`register_backend`; config validation checks them).
- `EngineBackend` (engine_backend.py): the built-in backend `engine`, over `Engine`; other
  engines plug in through `registries.ROLLOUT_BACKENDS` (`make_backend`).
- `Engine` (engine.py): prefill / insert / generate with a donated, preallocated KV cache;
  `PagedEngine` (paged.py) with a paged one; `make_engine(model, EngineSpec)` (engine_factory.py)
  builds either, for every caller.
- `stream_groups` / `generate_groups` (rollout.py): G completions per prompt with prefix sharing,
  continuous batching, stop ids / stop strings / budgets, and per-sample deterministic PRNG keys.
- `SamplingParams`, `sample_tokens` (sampling.py): greedy, temperature, top-k and top-p.
- `jetstream_adapter.py`: serves an Engine under JetStream's own orchestrator, when installed.
- `stream_episodes` / `EpisodeSettings` (multiturn.py): multi-turn episodes with an environment:
  observations appended to a live slot's KV cache, environment steps on worker threads.

The names below from JAX modules load with their module on first use, so that importing
`reasoning_rl.sampler.api` (which runs this file first) loads no JAX.
"""

from reasoning_rl.sampler.api import (BackendSpec, Capabilities, Completion, RolloutBackend,
                                      register_backend)

__all__ = ["BackendSpec", "Capabilities", "Completion", "DecodeState", "Engine", "EngineBackend",
           "EngineSpec", "EpisodeSettings", "Prefix", "ResultTokens", "RolloutBackend",
           "SamplingParams", "SlotRequest", "generate_episodes", "generate_groups", "make_backend",
           "make_engine", "register_backend", "sample_key", "sample_tokens", "stream_episodes",
           "stream_groups"]


def __getattr__(name: str):
  """The re-exports of the JAX modules, imported when first asked for (PEP 562)."""
  # pylint: disable=import-outside-toplevel
  # each import below loads JAX: only on first use, so that `sampler.api` stays JAX-free
  if name in ("DecodeState", "Engine", "Prefix", "ResultTokens", "SlotRequest"):
    from reasoning_rl.sampler import engine as module
  elif name in ("EngineBackend", "make_backend"):
    from reasoning_rl.sampler import engine_backend as module
  elif name in ("EngineSpec", "make_engine"):
    from reasoning_rl.sampler import engine_factory as module
  elif name in ("EpisodeSettings", "generate_episodes", "stream_episodes"):
    from reasoning_rl.sampler import multiturn as module
  elif name in ("generate_groups", "stream_groups"):
    from reasoning_rl.sampler import rollout as module
  elif name in ("SamplingParams", "sample_key", "sample_tokens"):
    from reasoning_rl.sampler import sampling as module
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(module, name)
