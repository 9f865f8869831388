"""Serving an `Engine` under JetStream's own orchestrator (`jetstream.core.orchestrator.Driver`).

google-jetstream is optional and never imported at module load: `jetstream_engine(engine,
tokenizer)` imports it and returns an object implementing `jetstream.engine.engine_api.Engine`
(and a `jetstream.engine.tokenizer_api.Tokenizer` through `build_tokenizer`) by delegating to ours.
Written against google-jetstream 0.2.2, the newest release, whose `prefill` returns the prefix
alone.
Its orchestrator still calls `jax.tree_map`, which JAX has removed, when it frees an inserted
prefix; callers running the Driver replace `orchestrator.delete_pytree`
(tests/test_sampler_interop.py shows how).

How the two contracts meet:
- `prefill` returns our `Prefix` (drawn with the engine's default request: its default sampling
  parameters, budget and stop ids, and a fresh key per request); the first token is emitted by the
  slot's first `generate`, as JetStream 0.2.2's Driver expects.
- `generate` packs our tokens [S, N], validity [S, N] and a length column into JetStream's single
  `ResultTokens.data` array (ids and flags as int32). The Driver reads the N tokens of a call as
  consecutive tokens ("speculations") and stops a request at its first invalid or stop token.
- Lengths: the Driver ends a request once the reported length exceeds its `max_tokens`, checked
  before it reads a call's tokens. The reported length is the number of tokens the request had
  before the call plus one (JetStream's value when one token is made per call), so a request gets at
  least `max_tokens` tokens and at most `max_tokens + steps_per_call - 1`; clients trim the excess.
- Stop tokens are our tokenizer's `eos_ids` (JetStream's default would also stop at the pad id).
"""

from __future__ import annotations

import functools

import numpy as np

from reasoning_rl.errors import SamplingError
from reasoning_rl.sampler.engine import Engine


@functools.cache
def _adapter_classes():
  """Builds the adapter classes on first use (imports jetstream)."""
  try:
    # jetstream is optional (its own install): loaded only by the adapter's users
    from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2
  except ImportError as error:
    raise ImportError(
        f"jetstream_engine needs google-jetstream==0.2.2 ({error}); to install it without "
        "TensorFlow, run `python tests/jetstream_side_install.py` and put .jetstream_deps/ on "
        "PYTHONPATH") from error

  class JetStreamTokenizer(tokenizer_api.Tokenizer):
    """Our Tokenizer behind JetStream's tokenizer interface."""

    def __init__(self, tokenizer, engine: Engine, bos_id: int):
      self._tokenizer = tokenizer
      self._engine = engine
      self._bos_id = bos_id

    def encode(self, s: str, **kwargs):
      """(right-padded token ids of `s`, true length); BOS as the tokenizer's source asks."""
      ids = self._tokenizer.encode(s, add_special_tokens=kwargs.get("is_bos", True))
      padded, true_length = self._engine.prepare_prompt(ids)
      return padded, true_length

    def decode(self, token_ids, **kwargs) -> str:
      return self._tokenizer.decode(token_ids)

    @property
    def pad_id(self) -> int:
      pad = self._tokenizer.pad_id
      return 0 if pad is None else pad  # padding sits beyond true_length and is never attended

    @property
    def eos_id(self) -> int:
      return self._tokenizer.eos_id

    @property
    def bos_id(self) -> int:
      return self._bos_id

    @property
    def stop_tokens(self) -> set[int]:
      return set(self._tokenizer.eos_ids)

  class JetStreamEngine(engine_api.Engine):
    """`jetstream.engine.engine_api.Engine` delegating to a reasoning_rl `Engine`."""

    def __init__(self, engine: Engine, tokenizer, bos_id: int):
      self._engine = engine
      self._tokenizer = tokenizer
      self._bos_id = bos_id

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
      prefix, _ = self._engine.prefill(params=params, existing_prefix=existing_prefix,
                                       padded_tokens=np.asarray(padded_tokens),
                                       true_length=int(true_length))
      return prefix

    def insert(self, prefix, decode_state, slot: int):
      return self._engine.insert(prefix, decode_state, slot)

    def generate(self, params, decode_state):
      decode_state, result = self._engine.generate(params, decode_state)
      result = result.to_host()
      steps = result.tokens.shape[1]
      valid = result.valid.astype(np.int32)
      length_before_call = result.lengths - valid.sum(axis=1)
      data = np.concatenate([result.tokens.astype(np.int32), valid,
                             (length_before_call + 1)[:, None].astype(np.int32)], axis=1)
      return decode_state, engine_api.ResultTokens(
          data=data, tokens_idx=(0, steps), valid_idx=(steps, 2 * steps),
          length_idx=(2 * steps, 2 * steps + 1), samples_per_slot=1)

    def load_params(self, *args, **kwargs):
      return self._engine.load_params()

    def get_prefix_destination_sharding(self):
      return self._engine.get_prefix_destination_sharding()

    def get_tokenizer(self):
      return tokenizer_pb2.TokenizerParameters(path=str(self._tokenizer.source))

    def build_tokenizer(self, metadata):
      return JetStreamTokenizer(self._tokenizer, self._engine, self._bos_id)

    def init_decode_state(self, *args, **kwargs):
      return self._engine.init_decode_state()

    def free_resource(self, slot: int):
      return self._engine.free_resource(slot)

    @property
    def max_concurrent_decodes(self) -> int:
      return self._engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
      return self._engine.samples_per_slot

    @property
    def max_prefill_length(self) -> int:
      return self._engine.max_prefill_length

    @property
    def mesh(self):
      return self._engine.mesh

    @property
    def colocated_cpus(self):
      return self._engine.colocated_cpus

  return JetStreamEngine, JetStreamTokenizer


def jetstream_engine(engine: Engine, tokenizer, *, bos_id: int | None = None):
  """A `jetstream.engine.engine_api.Engine` serving `engine` (needs google-jetstream installed).

  Args:
    engine: our engine; its `default_sampling`, `default_max_new_tokens` and `default_stop_ids`
      apply to every Driver request.
    tokenizer: our Tokenizer (text requests, detokenisation, stop ids).
    bos_id: the id JetStream's Driver prepends to token-id requests; defaults to the tokenizer's
      BOS.

  Raises:
    ImportError: google-jetstream is not installed.
    SamplingError: no BOS id is known, or max_prefill_length is not one of JetStream's buckets.
  """
  bos_id = tokenizer.bos_id if bos_id is None else bos_id
  if bos_id is None:
    raise SamplingError(
        f"bos_id: {tokenizer.source} declares no BOS token, but JetStream's Driver prepends one to "
        "every token-id request; pass bos_id=")
  length = engine.max_prefill_length
  if length < 16 or length & (length - 1):
    raise SamplingError(
        f"max_prefill_length={length}: JetStream pads to power-of-two buckets from 16; use one")
  engine_class, _ = _adapter_classes()
  return engine_class(engine, tokenizer, bos_id)


__all__ = ["jetstream_engine"]
