"""The one place a sampler engine is constructed: `make_engine(model, EngineSpec(...))`.

The rollout backend (`engine_backend`), the builder's engines (`build.build_engine`,
`build.build_sized_engine`, and through them launch/generate.py and the held-out evaluation)
and the judge model (`verifiers.judge.EngineJudge`) each describe the engine they need as an
`EngineSpec`: its sizes and KV cache, nothing else. A paged cache (`kv_page_size` > 0) gives a
`paged.PagedEngine`, else the contiguous `engine.Engine`.
"""

from __future__ import annotations

import dataclasses

from reasoning_rl.sampler.engine import Engine
from reasoning_rl.sampler.paged import PagedEngine


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """The sizes and KV cache of one engine (defaults: `Engine`'s).

  max_concurrent_decodes: decode slots.
  max_prefill_length: the longest prompt (the largest prefill bucket).
  max_decode_length: the longest completion.
  steps_per_call: decode steps per `generate` call.
  seed: the root of the keys of requests that bring none.
  kv_page_size, kv_pages, kv_page_kernel: a paged KV cache with pages of `kv_page_size` entries
    (`kv_pages` of them; 0 = every slot's whole length) read by `kv_page_kernel`; 0 = one
    contiguous row per slot (`rollout.kv_page_size` and the others).
  live_length_attention: attend only over the live part of the cache (a bucket per length).
  truncation: a prompt longer than `max_prefill_length`: "error", or "left" (keep its end).
  """

  max_concurrent_decodes: int
  max_prefill_length: int
  max_decode_length: int
  steps_per_call: int
  seed: int = 0
  kv_page_size: int = 0
  kv_pages: int = 0
  kv_page_kernel: str = "auto"
  live_length_attention: bool = True
  truncation: str = "error"

  @classmethod
  def of_rollouts(cls, rollout, *, max_decode_length: int, seed: int) -> "EngineSpec":
    """The rollout engine's spec from `config.rollout` (`rollout`: its slots, prefill and chunk
    sizes, and its KV cache), decoding up to `max_decode_length` tokens."""
    return cls(max_concurrent_decodes=rollout.max_concurrent_decodes,
               max_prefill_length=rollout.max_prefill_length,
               max_decode_length=max_decode_length, steps_per_call=rollout.steps_per_call,
               seed=seed, kv_page_size=rollout.kv_page_size, kv_pages=rollout.kv_pages,
               kv_page_kernel=rollout.kv_page_kernel)


def make_engine(model, spec: EngineSpec, *, mesh=None) -> Engine:
  """The engine `spec` describes for `model`, placed on `mesh` (None: the default device)."""
  sizes = dict(mesh=mesh, max_concurrent_decodes=spec.max_concurrent_decodes,
               max_prefill_length=spec.max_prefill_length,
               max_decode_length=spec.max_decode_length, steps_per_call=spec.steps_per_call,
               seed=spec.seed, live_length_attention=spec.live_length_attention,
               truncation=spec.truncation)
  if spec.kv_page_size:
    return PagedEngine(model, page_size=spec.kv_page_size, num_pages=spec.kv_pages,
                       kernel=spec.kv_page_kernel, **sizes)
  return Engine(model, **sizes)


__all__ = ["EngineSpec", "make_engine"]
