"""A decode engine with JetStream's Engine API semantics, on its own device mesh.

JetStream (`jetstream/engine/engine_api.py`) splits serving into four calls that an outer loop
interleaves for continuous batching:
- `prefill(params=, padded_tokens=, true_length=)` runs a prompt and returns a `Prefix` (its KV
  cache and next-token logits) plus the first token as `ResultTokens`;
- `insert(prefix, decode_state, slot)` copies a prefix into one of `max_concurrent_decodes` slots of
  the preallocated decode state;
- `generate(params, decode_state)` advances every live slot and returns `ResultTokens` with per-slot
  tokens, validity and lengths;
- `init_decode_state()` / `load_params()` build the state those calls transform.

This engine keeps its own types (no JetStream import; `jetstream_adapter.py` bridges to JetStream's
orchestrator) and adds what RL rollouts need: per-slot sampling parameters and PRNG keys, stop ids,
a `max_new_tokens` budget, both log-probs of every token, and `update_params` for weight sync.
For a mixture-of-experts model it also records, for every token it runs through the model (the
prompt in `prefill`, each drawn token in `generate`), the experts each sparse layer sent it to
(`Prefix.experts`, `ResultTokens.experts`): what routing replay trains with
(`reasoning_rl.models.moe`).

Decode state: one KV cache [slots, kv_heads, cache_length, head_dim] per layer (latent attention:
its latent and shared RoPE key, `ModelConfig.kv_cache_layout`), preallocated on the
sampler mesh and donated to every jitted call, so it is updated in place. Each slot holds the logits
of its next token; a decode step samples from them, feeds the sampled token through the model and
stores the new logits. `generate` runs up to `steps_per_call` such steps inside one jitted
`lax.while_loop`, so the host sees one round trip per (up to) `steps_per_call` tokens.

Throughput (no decode step is spent on an idle slot the host could have refilled):
- Early exit: the loop stops once every slot is done, and with `return_on_finish=True` as soon as
  any slot finishes, so a caller with requests waiting refills the slot at once instead of leaving
  it idle for the rest of the chunk (the cost is one extra host round trip per finish).
- Live-length attention: a call attends over the first L cache slots only, L the smallest power of
  two covering every live slot's position plus `steps_per_call` (capped at cache_length), instead
  of the whole cache. (L covers the whole call: a live slot never gets fewer than
  `steps_per_call` tokens from a call unless it finishes, which JetStream's Driver relies on — it
  reads an invalid token as the end of a request.) On a CPU the call copies those L slots of every
  layer once, decodes over the copy and writes it back, and attends over the whole cache in place
  when L is over half of it: XLA:CPU's attention reductions (YNNPACK fusions) take no sliced
  operand, so slicing each step copied the live part of every layer's cache per step, which cost
  more than it saved (benchmarks/RESULTS.md, 2026-11-29). Elsewhere each step reads the first L
  slots in place (no second copy of the cache in memory).
- Live slots only: when at most half the slots are live (the tail of a rollout, when no request is
  waiting), a call gathers the live slots (rounded up to a power of two with done ones) and the
  first L slots of their cache into a smaller batch, decodes that, and scatters it back, so a step
  costs what its live slots need.
- Batched prefill: `prefill_many` runs several prompts in one call (rows padded to the longest
  prompt's bucket, the row count to a power of two up to `max_prefill_batch`).
- Batched inserts: `insert_many` places several prefixes in their slots in one call per cache
  bucket (rollouts, exact rollouts and the agent driver fill their free slots with it), where
  each `insert` is a program call over the whole decode state. On a CPU a 16-bit cache is written
  by a select over its 16-bit words instead (XLA:CPU computes a bfloat16 dynamic-update-slice
  through float32 copies of the whole buffer), and there one insert at a time is faster.
`generate` compiles once per (L, batch) pair it meets: a handful of variants.

Prompts are right-padded to buckets of two per octave (2^k and 3·2^(k−1), at least
`min_prefill_bucket`, at most `max_prefill_length`), so the prefill compiles once per (bucket, row
count).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from reasoning_rl import lora
from reasoning_rl import sharding as sharding_lib
from reasoning_rl.errors import SamplingError
from reasoning_rl.models.primitives import where_by_words, writes_through_float32
from reasoning_rl.models.transformer import KVCache, Transformer
from reasoning_rl.sampler import sampling as sampling_lib
from reasoning_rl.sampler.sampling import SamplingParams

MAX_STOP_IDS = 8  # stop ids per request held on device (EOS + end-of-turn tokens fit easily)


@flax.struct.dataclass
class SlotRequest:
  """What a slot needs besides its prompt: PRNG key, sampling parameters, budget and stop ids."""

  key: jax.Array  # typed PRNG key (scalar); token n is drawn with fold_in(key, n)
  temperature: jax.Array  # f32 scalar
  top_p: jax.Array  # f32 scalar
  top_k: jax.Array  # i32 scalar
  min_p: jax.Array  # f32 scalar
  max_new_tokens: jax.Array  # i32 scalar
  stop_ids: jax.Array  # i32 [MAX_STOP_IDS], -1 = unused


@flax.struct.dataclass
class Prefix:
  """A prefilled prompt: its KV cache [1, bucket, …], next-token logits [V], length and request."""

  cache: KVCache
  logits: jax.Array
  length: jax.Array
  request: SlotRequest
  # MoE models: [bucket, L_sparse, k] int32, the experts each prompt position was routed to.
  experts: jax.Array | None = None
  # Which prefill produced it, so a paged engine (`sampler.paged`) can share its pages between
  # the slots it is inserted into; -1 until such an engine numbers it. `with_request` keeps it.
  share_id: int = flax.struct.field(pytree_node=False, default=-1)

  def with_request(self, request: SlotRequest) -> "Prefix":
    """The same prefilled prompt for another sample (prefix sharing: no new prefill)."""
    return self.replace(request=request)


@flax.struct.dataclass
class DecodeState:
  """Everything `generate` transforms; every leading dimension is the slot."""

  cache: KVCache
  next_logits: jax.Array  # [S, V] logits of each slot's next token
  position: jax.Array  # [S] position (= cache index) the next token will be written at
  generated: jax.Array  # [S] tokens emitted so far by the slot's request
  done: jax.Array  # [S] bool; empty slots are done
  keys: jax.Array  # [S] typed PRNG keys
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array
  min_p: jax.Array
  max_new_tokens: jax.Array
  stop_ids: jax.Array  # [S, MAX_STOP_IDS]


@dataclasses.dataclass(frozen=True)
class SlotData:
  """One slot's share of a `ResultTokens`: tokens/valid [samples, steps], lengths [samples]."""

  tokens: np.ndarray
  valid: np.ndarray
  lengths: np.ndarray


@flax.struct.dataclass
class ResultTokens:
  """Tokens produced by one `prefill` (1 step) or `generate` (up to `steps_per_call` steps).

  tokens, valid, logprobs, sampling_logprobs: [S, steps]; a token is valid iff its slot was live when
  it was drawn. lengths [S]: tokens emitted so far by each slot's request. done [S]: the slot
  finished (stop id, budget or cache full) during or before this call. num_steps: decode steps the
  call ran (columns past it hold no valid token). experts (MoE models, else None):
  [S, steps, L_sparse, k] int32, the experts each drawn token was routed to when it was fed.
  """

  tokens: jax.Array
  valid: jax.Array
  lengths: jax.Array
  logprobs: jax.Array
  sampling_logprobs: jax.Array
  done: jax.Array
  num_steps: jax.Array
  samples_per_slot: int = flax.struct.field(pytree_node=False, default=1)
  experts: jax.Array | None = None

  def to_host(self) -> "ResultTokens":
    """A copy whose arrays are numpy (one transfer per field)."""
    return jax.tree.map(np.asarray, self)

  def get_result_at_slot(self, slot: int) -> SlotData:
    rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
    return SlotData(tokens=np.asarray(self.tokens[rows]), valid=np.asarray(self.valid[rows]),
                    lengths=np.asarray(self.lengths[rows]))


def next_power_of_two(n: int) -> int:
  """Smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def prefill_bucket(length: int, max_prefill_length: int, min_bucket: int = 16) -> int:
  """Smallest power of two >= length (and >= min_bucket), capped at max_prefill_length."""
  return min(max(min_bucket, next_power_of_two(length)), max_prefill_length)


def prompt_bucket(length: int, max_prefill_length: int, min_bucket: int = 16) -> int:
  """The length a prompt is padded to: the smallest 2^k or 3·2^(k−1) >= length (two buckets per
  octave; at least min_bucket, at most max_prefill_length).

  Padding costs prefill compute in proportion; power-of-two buckets waste up to half of it, these
  up to a third (SmolLM2 chat prompts of 34–44 tokens: 48 instead of 64, a prefill of 8 of them
  229 instead of 335 ms), for at most twice the compiled prefill shapes.
  """
  power = next_power_of_two(length)
  bucket = power * 3 // 4 if power >= 4 and power * 3 // 4 >= length else power
  return min(max(min_bucket, bucket), max_prefill_length)


def start_slot(state: DecodeState, prefix: Prefix, slot) -> DecodeState:
  """`state` with `slot` live on `prefix`'s request: its next-token logits, position, key,
  sampling parameters, budget and stop ids (the cache is the caller's to fill). `slot` may be a
  vector of slots, `prefix`'s fields stacked along a first axis to match."""
  req = prefix.request

  def put(buffer, value):
    return buffer.at[slot].set(value)

  return state.replace(
      next_logits=put(state.next_logits, prefix.logits),
      position=put(state.position, prefix.length),
      generated=put(state.generated, 0), done=put(state.done, False),
      keys=put(state.keys, req.key), temperature=put(state.temperature, req.temperature),
      top_p=put(state.top_p, req.top_p), top_k=put(state.top_k, req.top_k),
      min_p=put(state.min_p, req.min_p), max_new_tokens=put(state.max_new_tokens,
                                                            req.max_new_tokens),
      stop_ids=put(state.stop_ids, req.stop_ids))


def select_row(buffer: jax.Array, row: jax.Array, slot) -> jax.Array:
  """buffer [S, …] (16-bit floats) with row [1, …] written at `slot`, from index 0 of every other
  axis (a prefix's cache is shorter along its length axis): `insert`'s write on a CPU. XLA:CPU
  computes a dynamic-update-slice of bfloat16 through float32 copies of the whole buffer; a
  select over its 16-bit words is 10× faster (an insert into 64 slots of 192 entries, SmolLM2's
  shape: 2.0 against 21 ms; benchmarks/RESULTS.md, 2026-11-30)."""
  def along(axis, values):
    shape = [1] * buffer.ndim
    shape[axis] = -1
    return values.reshape(shape)

  hit = along(0, jnp.arange(buffer.shape[0]) == slot)
  for axis in range(1, buffer.ndim):
    if row.shape[axis] < buffer.shape[axis]:
      hit = hit & along(axis, jnp.arange(buffer.shape[axis]) < row.shape[axis])
  row = jnp.pad(row, [(0, 0)] + [(0, size - used)
                                 for size, used in zip(buffer.shape[1:], row.shape[1:])])
  return where_by_words(hit, row, buffer)


def spread_rows(result: ResultTokens, rows, state: DecodeState) -> ResultTokens:
  """The `ResultTokens` of a call that decoded slots `rows` only, as every slot's (the others'
  tokens invalid), with lengths and done read from `state`, the whole decode state after it."""
  def spread(a):
    return jnp.zeros((state.done.shape[0],) + a.shape[1:], a.dtype).at[rows].set(a)

  return result.replace(
      tokens=spread(result.tokens), valid=spread(result.valid),
      logprobs=spread(result.logprobs), sampling_logprobs=spread(result.sampling_logprobs),
      lengths=state.generated, done=state.done,
      experts=None if result.experts is None else spread(result.experts))


class Engine:
  """Prefill / insert / generate over a fixed set of decode slots on the sampler mesh.

  Args:
    model: the policy; its parameters are copied onto `mesh` (see `update_params`).
    mesh: the sampler slice (axes data, fsdp, tensor); None uses one device.
    max_concurrent_decodes: number of decode slots.
    max_prefill_length: longest prompt accepted.
    max_decode_length: most tokens a request may generate; the cache holds
      max_prefill_length + max_decode_length tokens per slot.
    steps_per_call: decode steps per `generate` call.
    min_prefill_bucket: smallest prefill bucket.
    max_prefill_batch: most prompts one prefill call runs (`prefill_many` splits larger lists).
    live_length_attention: attend over the live part of the cache (see the module docstring);
      False attends over the whole cache (the reference the tests compare against).
    compact_live_slots: when at most half the slots are live, decode only those (see the module
      docstring); False always decodes every slot.
    truncation: what to do with a prompt longer than max_prefill_length: "error" (SamplingError)
      or "left" (keep its last max_prefill_length tokens).
    default_sampling: used by `prefill` calls that carry no request (e.g. from JetStream's Driver).
    default_max_new_tokens: budget of such requests (default max_decode_length).
    default_stop_ids: stop ids of such requests.
  """

  def __init__(self, model: Transformer, *, mesh: Mesh | None = None,
               max_concurrent_decodes: int = 8, max_prefill_length: int = 256,
               max_decode_length: int = 256, steps_per_call: int = 16,
               min_prefill_bucket: int = 16, max_prefill_batch: int = 8,
               live_length_attention: bool = True, compact_live_slots: bool = True,
               truncation: str = "error",
               default_sampling: SamplingParams = SamplingParams(temperature=0.0),
               default_max_new_tokens: int | None = None,
               default_stop_ids: Sequence[int] = (), seed: int = 0):
    for name, value in (("max_concurrent_decodes", max_concurrent_decodes),
                        ("max_prefill_length", max_prefill_length),
                        ("max_decode_length", max_decode_length),
                        ("steps_per_call", steps_per_call),
                        ("min_prefill_bucket", min_prefill_bucket),
                        ("max_prefill_batch", max_prefill_batch)):
      if not isinstance(value, int) or value < 1:
        raise SamplingError(f"{name}={value!r}: must be a positive integer")
    if truncation not in ("error", "left"):
      raise SamplingError(f"truncation={truncation!r}: must be 'error' or 'left'")
    self.config = model.config
    self.dtype = model.dtype
    self._scan_layers = model.scan_layers  # the KV cache is then stacked as the layers are
    self._mesh = mesh if mesh is not None else sharding_lib.make_mesh(
        (1, 1, 1), devices=[jax.devices()[0]])
    self._slots = max_concurrent_decodes
    self._max_prefill_length = max_prefill_length
    self.max_decode_length = max_decode_length
    self.cache_length = max_prefill_length + max_decode_length
    self.steps_per_call = steps_per_call
    self.min_prefill_bucket = min(min_prefill_bucket, max_prefill_length)
    self.max_prefill_batch = max_prefill_batch
    self.live_length_attention = live_length_attention
    # see the module docstring, live-length attention
    self._copies_window = self._mesh.devices.flat[0].platform == "cpu"
    self.compact_live_slots = compact_live_slots
    self.truncation = truncation
    self.default_sampling = default_sampling
    self.default_max_new_tokens = default_max_new_tokens or max_decode_length
    self.default_stop_ids = tuple(default_stop_ids)
    self._default_key = jax.random.key(seed)
    self._default_requests = 0
    self.policy_version = 0
    self.num_prefills = 0  # prompts prefilled (padding rows of a batch not counted)
    self.num_prefill_calls = 0
    self.num_inserts = 0  # prefixes placed in slots
    self.num_insert_calls = 0  # programs run to place them (`insert_many` batches them)
    self.num_generate_calls = 0
    self.num_appends = 0  # append_to_slot calls (multi-turn continuations)

    self._graphdef, state = nnx.split(model)
    self._param_shardings = sharding_lib.param_shardings(state, self._mesh)
    self._params = sharding_lib.reshard(state, self._param_shardings)
    self._replicated = NamedSharding(self._mesh, PartitionSpec())
    self._state_shardings = self._decode_state_shardings()
    self._build_functions()

  # ----------------------------------------------------------------------------- properties

  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def colocated_cpus(self):
    return None

  @property
  def params(self) -> nnx.State:
    """The parameters currently on the sampler mesh."""
    return self._params

  # ----------------------------------------------------------------------------- params

  def load_params(self) -> nnx.State:
    """The engine's parameters (JetStream calls this once and passes them back to every call)."""
    return self._params

  def update_params(self, params, *, version: int | None = None,
                    adapters_only: bool = False) -> nnx.State:
    """Copies new parameters (an nnx.State or a Transformer, on any mesh) onto the sampler mesh.

    The copy is device to device (`jax.device_put` with the sampler's shardings), never through host
    memory. `adapters_only`: `params` are a LoRA model's adapters alone (what the weight sync sends
    with `lora.sampler_weights='adapters'`, `loop.weight_sync`); the base this engine holds is
    kept. `version` is the policy version the caller assigns to these parameters (the loop owns
    the count, `loop.state.LoopState.policy_version`); without it the engine's version goes up by
    one. Returns the new params for callers that hold them.
    """
    if isinstance(params, nnx.Module):
      params = nnx.state(params)
    if adapters_only:
      if not lora.is_adapted(self._params):
        raise SamplingError("update_params(adapters_only=True): this engine's model has no LoRA "
                            "adapters to replace; send the whole model's weights")
      _, base = lora.split_adapters(self._params)
      adapters = sharding_lib.reshard(params, sharding_lib.param_shardings(params, self._mesh))
      self._params = lora.join(adapters, base)
    else:
      self._params = sharding_lib.reshard(params, self._param_shardings)
    self.policy_version = self.policy_version + 1 if version is None else int(version)
    return self._params

  def get_prefix_destination_sharding(self):
    """Prefixes are small (one row) and live replicated on the sampler mesh."""
    return self._replicated

  # ----------------------------------------------------------------------------- requests

  def make_request(self, *, key: jax.Array, sampling: SamplingParams, max_new_tokens: int,
                   stop_ids: Sequence[int] = ()) -> SlotRequest:
    """A SlotRequest, validated (SamplingError on a bad budget or too many stop ids)."""
    if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= self.max_decode_length:
      raise SamplingError(
          f"max_new_tokens={max_new_tokens!r}: must be an integer in [1, max_decode_length="
          f"{self.max_decode_length}]; raise the engine's max_decode_length")
    stop_ids = list(dict.fromkeys(int(i) for i in stop_ids))
    if len(stop_ids) > MAX_STOP_IDS:
      raise SamplingError(f"stop_ids: at most {MAX_STOP_IDS} ids, got {len(stop_ids)}")
    padded = np.full(MAX_STOP_IDS, -1, np.int32)
    padded[:len(stop_ids)] = stop_ids
    return SlotRequest(key=key, temperature=np.float32(sampling.temperature),
                       top_p=np.float32(sampling.top_p), top_k=np.int32(sampling.top_k),
                       min_p=np.float32(sampling.min_p), max_new_tokens=np.int32(max_new_tokens), stop_ids=padded)

  def _default_request(self) -> SlotRequest:
    key = jax.random.fold_in(self._default_key, self._default_requests)
    self._default_requests += 1
    return self.make_request(key=key, sampling=self.default_sampling,
                             max_new_tokens=self.default_max_new_tokens,
                             stop_ids=self.default_stop_ids)

  def prepare_prompt(self, prompt_ids: Sequence[int]) -> tuple[np.ndarray, int]:
    """Right-pads a prompt to its bucket: (padded_tokens [bucket], true_length).

    Raises SamplingError for an empty prompt, or one longer than max_prefill_length when the
    truncation policy is "error" ("left" keeps the last max_prefill_length tokens).
    """
    ids = np.asarray(list(prompt_ids), np.int32)
    if ids.size == 0:
      raise SamplingError("prompt: is empty; a prompt needs at least one token")
    if ids.size > self.max_prefill_length:
      if self.truncation == "error":
        raise SamplingError(
            f"prompt: {ids.size} tokens exceed max_prefill_length={self.max_prefill_length}; "
            "shorten it, raise max_prefill_length, or set truncation='left'")
      ids = ids[-self.max_prefill_length:]
    if ids.min() < 0 or ids.max() >= self.config.vocab_size:
      raise SamplingError(
          f"prompt: token ids must lie in [0, {self.config.vocab_size}), got "
          f"[{ids.min()}, {ids.max()}]")
    bucket = prompt_bucket(ids.size, self.max_prefill_length, self.min_prefill_bucket)
    return np.pad(ids, (0, bucket - ids.size)), int(ids.size)

  # ----------------------------------------------------------------------------- engine API

  def init_decode_state(self) -> DecodeState:
    """An empty decode state (every slot done) on the sampler mesh."""
    return self._init_fn()

  def prefill(self, *, params, existing_prefix: Prefix | None = None, padded_tokens,
              true_length: int, request: SlotRequest | None = None):
    """Runs a right-padded prompt through the model once.

    Returns (Prefix, ResultTokens): the prefix holds the prompt's cache and next-token logits; the
    result holds the first token drawn with the request's key — the same token `generate` emits
    first for a slot this prefix is inserted into with that request.
    """
    if existing_prefix is not None:
      raise NotImplementedError("prefill: continuing an existing prefix is not supported; "
                                "prefill the whole conversation")
    request = self._default_request() if request is None else request
    prefixes, first = self._prefill_rows(params, [padded_tokens], [true_length], [request])
    return prefixes[0], first

  def prefill_many(self, *, params, padded_tokens: Sequence, true_lengths: Sequence[int],
                   requests: Sequence[SlotRequest]) -> list[Prefix]:
    """Prefills several prompts, `max_prefill_batch` per call: one Prefix per prompt, in order.

    Each prefix is what `prefill` returns for that prompt alone (up to float summation order), its
    cache padded to the longest prompt's bucket of its call. The first tokens are not returned: a
    slot's first `generate` step draws the same token.
    """
    if not len(padded_tokens) == len(true_lengths) == len(requests):
      raise SamplingError(
          f"prefill_many: got {len(padded_tokens)} prompts, {len(true_lengths)} true_lengths and "
          f"{len(requests)} requests; pass one of each per prompt")
    padded_tokens, true_lengths, requests = list(padded_tokens), list(true_lengths), list(requests)
    prefixes = []
    for start in range(0, len(padded_tokens), self.max_prefill_batch):
      rows = slice(start, start + self.max_prefill_batch)
      prefixes += self._prefill_rows(params, padded_tokens[rows], true_lengths[rows],
                                     requests[rows])[0]
    return prefixes

  def prefill_rows(self, num_prompts: int) -> int:
    """Rows one prefill call of `num_prompts` prompts computes (a power of two, for few compiles)."""
    return min(next_power_of_two(num_prompts), self.max_prefill_batch)

  def _prefill_rows(self, params, padded_tokens, true_lengths, requests):
    """One prefill call: (prefixes of the real prompts, first tokens [rows, 1])."""
    rows = [np.asarray(tokens, np.int32).reshape(-1) for tokens in padded_tokens]
    for index, (tokens, true_length) in enumerate(zip(rows, true_lengths)):
      if tokens.size > self.max_prefill_length:
        raise SamplingError(f"padded_tokens[{index}]: {tokens.size} > max_prefill_length="
                            f"{self.max_prefill_length}")
      if not 1 <= int(true_length) <= tokens.size:
        raise SamplingError(f"true_lengths[{index}]={true_length}: must be in [1, {tokens.size}]")
    # Padding rows (one token each, the first request) only round the row count up.
    num_rows = self.prefill_rows(len(rows))
    batch = np.zeros((num_rows, max(tokens.size for tokens in rows)), np.int32)
    lengths = np.ones(num_rows, np.int32)
    for index, (tokens, true_length) in enumerate(zip(rows, true_lengths)):
      batch[index, :tokens.size] = tokens
      lengths[index] = true_length
    padded_requests = tuple(requests) + (requests[0],) * (num_rows - len(rows))
    self.num_prefills += len(rows)
    self.num_prefill_calls += 1
    prefixes, first = self._prefill_fn(params, batch, lengths, padded_requests)
    return list(prefixes[:len(rows)]), first

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Copies `prefix` (and its request) into `slot`; the old state is donated."""
    if not 0 <= int(slot) < self._slots:
      raise SamplingError(f"slot={slot}: must be in [0, {self._slots})")
    self.num_inserts += 1
    self.num_insert_calls += 1
    return self._insert_fn(decode_state, prefix, np.int32(slot))

  # Engines whose room for a prefix depends on the inserts before it (a paged cache's pages)
  # say False: `insert_many` then inserts one at a time, in order, and callers that check
  # `has_room_for` insert each before checking the next.
  inserts_many_at_once = True

  def insert_many(self, prefixes: Sequence[Prefix], decode_state: DecodeState,
                  slots: Sequence[int]) -> DecodeState:
    """Copies `prefixes[i]` (and its request) into `slots[i]` for every i: the state `insert`
    one at a time would give, in one call per cache bucket among the prefixes (the rows padded
    to a power of two, for few compiles). A prefix may repeat (the samples of one prompt: its
    `with_request` copies). The old state is donated.

    Each `insert` is a program call over the whole decode state: on a GPU, 256 of them took
    about 3 ms apiece, more than batched prefills of the same prompts (benchmarks/RESULTS.md,
    2026-11-30, "The whole loop on an NVIDIA H200: a first try"). On a CPU, and in an engine
    that says `inserts_many_at_once = False`, the prefixes are inserted one at a time, in order.
    """
    prefixes, slots = list(prefixes), [int(slot) for slot in slots]
    if len(prefixes) != len(slots):
      raise SamplingError(f"insert_many: got {len(prefixes)} prefixes and {len(slots)} slots; "
                          "pass one slot per prefix")
    for slot in slots:
      if not 0 <= slot < self._slots:
        raise SamplingError(f"insert_many: slot={slot}: must be in [0, {self._slots})")
    if len(set(slots)) != len(slots):
      raise SamplingError(f"insert_many: slots {slots} repeat one; give each prefix its own slot")
    # On a CPU `insert` writes its row in place, ~0.75 ms a slot, and one batched program did
    # not beat it enough to pay for itself: a float32 cache's rows written out as one update per
    # row and layer ran 1.0-1.1x faster and took 11-21 s to compile at 32-64 slots (a loop over
    # the rows needs them gathered first, and XLA:CPU's concatenate of the prefixes ran 3-4x
    # slower than the inserts); a 16-bit cache's selects over its words, many in one call or
    # the rows gathered into one select, were slower (benchmarks/RESULTS.md, 2026-11-30 and
    # 2026-12-01).
    if not self.inserts_many_at_once or jax.default_backend() == "cpu":
      for prefix, slot in zip(prefixes, slots):
        decode_state = self.insert(prefix, decode_state, slot)
      return decode_state
    by_bucket: dict[int, list[int]] = {}
    for index, prefix in enumerate(prefixes):
      by_bucket.setdefault(prefix.cache.max_len, []).append(index)
    for members in by_bucket.values():
      if len(members) == 1:  # a single prefix: `insert`'s program
        decode_state = self.insert(prefixes[members[0]], decode_state, slots[members[0]])
        continue
      rows = next_power_of_two(len(members))
      padding = rows - len(members)
      # a padding row repeats the first placement: the same values into the same slot again
      chosen = [prefixes[index] for index in members] + [prefixes[members[0]]] * padding
      targets = np.array([slots[index] for index in members] + [slots[members[0]]] * padding,
                         np.int32)
      self.num_inserts += len(members)
      self.num_insert_calls += 1
      decode_state = self._insert_many_fn(decode_state, tuple(chosen), targets)
    return decode_state

  def append_to_slot(self, params, decode_state: DecodeState, slot: int,
                     tokens: Sequence[int], *, start: int, max_new_tokens: int,
                     draws_kept: int) -> DecodeState:
    """Continues a slot's sequence with `tokens` (e.g. a tool's output) and resumes decoding it.

    The tokens are written into the slot's KV cache at cache indices start, start + 1, … (their
    positions) by one forward over the new tokens only: the conversation before them is never
    prefilled again. Cache entries at or past `start` that the slot decoded earlier (tokens the
    host cut off after a stop string) are dropped first. The slot is then live again, its next
    token drawn from the logits after the last new token, and it may draw `max_new_tokens` more.

    `draws_kept` is how many of the slot's drawn tokens the host kept (the sample's model tokens
    so far): the next token is draw number `draws_kept` of the sample's key stream. Tokens the
    engine drew past a stop string before the host cut them off depend on how decode steps were
    batched (`steps_per_call`, other slots), so they must not shift the stream: with this, a
    sample's tokens depend only on its key and its conversation, and every kept token has its
    own draw number.

    `start` is the length of the conversation the host keeps (prompt + kept tokens): every token
    below it has been through the model already, since a token is fed in the step that draws it.
    Multi-turn rollouts (`sampler.multiturn`) call this after each environment step.
    """
    tokens = np.asarray(list(tokens), np.int32)
    if not 0 <= int(slot) < self._slots:
      raise SamplingError(f"slot={slot}: must be in [0, {self._slots})")
    if tokens.size == 0:
      raise SamplingError("append_to_slot: tokens is empty; append at least one token")
    if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
      raise SamplingError(f"append_to_slot: token ids must lie in [0, {self.config.vocab_size})")
    if not 1 <= int(start) or int(start) + tokens.size >= self.cache_length:
      raise SamplingError(
          f"append_to_slot: start={start} + {tokens.size} tokens leaves no room in a cache of "
          f"{self.cache_length} (the slot needs one free entry to decode); end the episode")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise SamplingError(f"max_new_tokens={max_new_tokens!r}: must be a positive integer")
    if isinstance(draws_kept, bool) or not isinstance(draws_kept, int) or draws_kept < 0:
      raise SamplingError(f"draws_kept={draws_kept!r}: must be an integer >= 0")
    # Buckets as for prompts (two per octave), so the append compiles once per bucket.
    bucket = prompt_bucket(tokens.size, self.cache_length, self.min_prefill_bucket)
    padded = np.zeros(bucket, np.int32)
    padded[:tokens.size] = tokens
    positions = np.full(bucket, -1, np.int32)
    positions[:tokens.size] = np.arange(start, start + tokens.size)
    self.num_appends += 1
    return self._append_fn(params, decode_state, np.int32(slot), padded, positions,
                           np.int32(start), np.int32(tokens.size), np.int32(max_new_tokens),
                           np.int32(draws_kept))

  def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
    """Marks `slot` done (e.g. a stop string was found on the host) so it stops decoding."""
    return self._release_fn(decode_state, np.int32(slot))

  def free_resource(self, slot: int) -> None:
    """Nothing to free: every slot owns a fixed row of the cache."""
    return None

  def has_room_for(self, prefix: Prefix, tokens: int = 0) -> bool:
    """Whether `insert` can place `prefix` (continued by `tokens` appended ones) now: always,
    every slot owns a whole row."""
    return True

  def slots_to_preempt(self, decode_state: DecodeState, newest_first) -> list[int]:
    """Live slots to take off before the next `generate` call for it to fit in the cache: none,
    since every slot owns a row that holds its whole length (a paged engine's may not)."""
    return []

  def generate(self, params, decode_state: DecodeState, *, return_on_finish: bool = False):
    """Up to `steps_per_call` decode steps for every live slot: (decode_state, ResultTokens).

    The call returns early once every slot is done, and with `return_on_finish` also right after
    the step in which any slot finishes (a caller with waiting requests refills it at once).
    """
    self.num_generate_calls += 1
    rows, key_length = self.decode_plan(decode_state)
    if rows is None:
      if self._copies_window and 2 * key_length > self.cache_length:
        key_length = self.cache_length  # the copy in and out would cost more than it saves
      return self._generate_fn(params, decode_state, np.bool_(return_on_finish),
                               key_length=key_length)
    return self._generate_rows_fn(params, decode_state, rows, np.bool_(return_on_finish),
                                  key_length=key_length)

  def decode_plan(self, decode_state: DecodeState) -> tuple[np.ndarray | None, int]:
    """(slots the next `generate` call decodes, or None for all; cache slots it attends over).

    Reads each slot's done flag and position (one small device-to-host copy). Every key a live
    slot can see during the call lies below its position + steps_per_call: the attended length is
    the smallest power of two covering that for every live slot (at least min_prefill_bucket, at
    most cache_length). When at most half the slots are live, the call decodes a power-of-two
    number of slots (the live ones, padded with done ones) instead of all of them.
    """
    return self.plan_for(*jax.device_get((decode_state.done, decode_state.position)))

  def plan_for(self, done: np.ndarray, position: np.ndarray) -> tuple[np.ndarray | None, int]:
    """`decode_plan` from the slots' done flags and positions, already on the host."""
    live = np.flatnonzero(~done)
    key_length = self.cache_length
    if self.live_length_attention and live.size:
      live_end = int(position[live].max()) + self.steps_per_call
      key_length = min(key_length, max(self.min_prefill_bucket, next_power_of_two(live_end)))
    num_rows = next_power_of_two(live.size)
    if not self.compact_live_slots or not live.size or num_rows > self._slots // 2:
      return None, key_length
    padding = np.flatnonzero(done)[:num_rows - live.size]
    return np.concatenate([live, padding]).astype(np.int32), key_length

  # ----------------------------------------------------------------------------- jitted bodies

  def _decode_state_shardings(self) -> DecodeState:
    mesh, slots, cfg = self._mesh, self._slots, self.config
    stacked = self._scan_layers
    k, v = (sharding_lib.sharding_for(axes, (cfg.num_layers,) * stacked + shape, mesh)
            for axes, shape in zip(KVCache.kv_axes(stacked),
                                   KVCache.buffer_shapes(cfg, slots, self.cache_length)))
    if not stacked:
      k, v = (k,) * cfg.num_layers, (v,) * cfg.num_layers
    rows = sharding_lib.sharding_for(("batch", "length"), (slots, self.cache_length), mesh)
    vector = sharding_lib.sharding_for(("batch",), (slots,), mesh)
    return DecodeState(
        cache=KVCache(k=k, v=v, pos=rows),
        next_logits=sharding_lib.sharding_for(("batch", None), (slots, cfg.vocab_size), mesh),
        position=vector, generated=vector, done=vector, keys=vector, temperature=vector,
        top_p=vector, top_k=vector, min_p=vector, max_new_tokens=vector,
        stop_ids=sharding_lib.sharding_for(("batch", None), (slots, MAX_STOP_IDS), mesh))

  def _build_functions(self):
    graphdef, cfg = self._graphdef, self.config
    slots, cache_length, steps = self._slots, self.cache_length, self.steps_per_call
    state_shardings, replicated = self._state_shardings, self._replicated
    stacked = self._scan_layers
    routed = cfg.moe is not None  # record each token's experts (module docstring)

    def token_major(experts):
      """[L_sparse, B, T, k] (how the model stacks them) → [B, T, L_sparse, k]."""
      return jnp.moveaxis(experts, 0, 2)

    def init():
      return DecodeState(
          cache=KVCache.init(cfg, slots, cache_length, self.dtype, stacked=stacked),
          next_logits=jnp.zeros((slots, cfg.vocab_size), jnp.float32),
          position=jnp.zeros(slots, jnp.int32), generated=jnp.zeros(slots, jnp.int32),
          done=jnp.ones(slots, bool), keys=jax.random.split(jax.random.key(0), slots),
          temperature=jnp.zeros(slots, jnp.float32), top_p=jnp.ones(slots, jnp.float32),
          top_k=jnp.zeros(slots, jnp.int32), min_p=jnp.zeros(slots, jnp.float32),
          max_new_tokens=jnp.zeros(slots, jnp.int32),
          stop_ids=jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32))

    def prefill(params, tokens, true_lengths, requests):
      model = nnx.merge(graphdef, params)
      rows, length = tokens.shape
      index = jnp.arange(length)[None, :]
      positions = jnp.where(index < true_lengths[:, None], index, -1)
      cache = KVCache.init(cfg, rows, length, self.dtype, stacked=stacked)
      hidden, cache, *stats = model.decode(tokens, positions, cache, jnp.zeros(rows, jnp.int32),
                                           return_hidden=True, with_router_stats=routed)
      experts = token_major(stats[0].experts) if routed else None
      last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)[:, 0]
      logits = model.logits_from_hidden(last)
      prefixes = tuple(
          Prefix(cache=cache.map_layers(lambda a, r=r: a[r:r + 1]).replace(
                     pos=cache.pos[r:r + 1]), logits=logits[r],
                 length=true_lengths[r], request=requests[r],
                 experts=None if experts is None else experts[r]) for r in range(rows))
      request = jax.tree.map(lambda *fields: jnp.stack(fields), *requests)
      token, logprob, sampling_logprob = sampling_lib.sample_tokens(
          logits, jax.vmap(jax.random.fold_in)(request.key, jnp.zeros(rows, jnp.int32)),
          request.temperature, request.top_p, request.top_k, request.min_p)
      first = ResultTokens(tokens=token[:, None], valid=jnp.ones((rows, 1), bool),
                           lengths=jnp.ones(rows, jnp.int32), logprobs=logprob[:, None],
                           sampling_logprobs=sampling_logprob[:, None],
                           done=jnp.zeros(rows, bool), num_steps=jnp.int32(1))
      return prefixes, first

    def insert(state: DecodeState, prefix: Prefix, slot):
      def put_row(buffer, row):
        if writes_through_float32(buffer.dtype):
          return select_row(buffer, row, slot)
        return jax.lax.dynamic_update_slice(buffer, row, (slot,) + (0,) * (buffer.ndim - 1))

      bucket = prefix.cache.pos.shape[1]
      pos_row = jnp.full((1, cache_length), -1, jnp.int32).at[:, :bucket].set(prefix.cache.pos)
      cache = state.cache.map_layers(lambda a, b: put_row(a, b.astype(a.dtype)),
                                     prefix.cache).replace(pos=put_row(state.cache.pos, pos_row))
      return start_slot(state.replace(cache=cache), prefix, slot)

    def insert_many(state: DecodeState, prefixes: tuple[Prefix, ...], slots):
      """`insert` of each prefix into its slot (prefixes of one bucket; a slot may repeat with
      the same prefix, as padding does)."""
      bucket = prefixes[0].cache.pos.shape[1]

      def put_rows(buffer, *rows, axis):
        """buffer [S, …] with rows[i] [1, …] at slots[i], lengths (`axis`) below bucket: one
        scatter (a CPU inserts one at a time instead, so never runs this)."""
        index = [slots] + [slice(None)] * (buffer.ndim - 1)
        index[axis] = slice(0, bucket)
        return buffer.at[tuple(index)].set(
            jnp.concatenate([row.astype(buffer.dtype) for row in rows], axis=0))

      pos_rows = jnp.concatenate([prefix.cache.pos for prefix in prefixes], axis=0)
      pos_rows = jnp.pad(pos_rows, ((0, 0), (0, cache_length - bucket)), constant_values=-1)
      cache = state.cache.map_length(put_rows, *(prefix.cache for prefix in prefixes)).replace(
          pos=state.cache.pos.at[slots].set(pos_rows))
      stacked = jax.tree.map(lambda *fields: jnp.stack(fields),
                             *(prefix.replace(cache=None, experts=None) for prefix in prefixes))
      return start_slot(state.replace(cache=cache), stacked, slots)

    def release(state: DecodeState, slot):
      return state.replace(done=state.done.at[slot].set(True))

    def append(params, state: DecodeState, slot, tokens, positions, start, count, budget,
               draws_kept):
      def row_of(buffer):
        return jax.lax.dynamic_slice_in_dim(buffer, slot, 1, axis=0)

      def put_row(buffer, row):
        return jax.lax.dynamic_update_slice(buffer, row, (slot,) + (0,) * (buffer.ndim - 1))

      # Entries at or past `start` are tokens the host cut off. Attention would mask them anyway
      # (their positions lie past every query until overwritten); cleared so the cache holds
      # the conversation only.
      kept = jnp.arange(state.cache.max_len)[None, :] < start
      row = state.cache.map_layers(row_of).replace(
          pos=jnp.where(kept, row_of(state.cache.pos), -1))
      model = nnx.merge(graphdef, params)
      hidden, row = model.decode(tokens[None], positions[None], row, start[None],
                                 return_hidden=True)
      last = jax.lax.dynamic_index_in_dim(hidden[0], count - 1, axis=0, keepdims=True)
      logits = model.logits_from_hidden(last)[0]
      cache = state.cache.map_layers(lambda a, b: put_row(a, b.astype(a.dtype)), row).replace(
          pos=put_row(state.cache.pos, row.pos))
      return state.replace(
          cache=cache, next_logits=state.next_logits.at[slot].set(logits),
          position=state.position.at[slot].set(start + count),
          done=state.done.at[slot].set(False), generated=state.generated.at[slot].set(draws_kept),
          max_new_tokens=state.max_new_tokens.at[slot].set(draws_kept + budget))

    def decode_steps(params, state: DecodeState, return_on_finish, key_length: int):
      """Up to `steps` decode steps for the rows of `state` (all slots, or a gathered subset),
      attending over the first key_length cache slots (a slice each step: `windowed` instead
      copies them once per call)."""
      rows = state.done.shape[0]
      done_at_start = state.done
      buffers = dict(tokens=jnp.zeros((rows, steps), jnp.int32),
                     valid=jnp.zeros((rows, steps), bool),
                     logprobs=jnp.zeros((rows, steps), jnp.float32),
                     sampling_logprobs=jnp.zeros((rows, steps), jnp.float32))
      if routed:
        buffers["experts"] = jnp.zeros(
            (rows, steps, cfg.moe.num_sparse_layers, cfg.moe.experts_per_token), jnp.int32)

      def step(carry):
        state, i, buffers = carry
        live = ~state.done
        step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.generated)
        tokens, logprobs, sampling_logprobs = sampling_lib.sample_tokens(
            state.next_logits, step_keys, state.temperature, state.top_p, state.top_k,
            state.min_p)
        generated = state.generated + live.astype(jnp.int32)
        hit_stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
        finished = live & (hit_stop | (generated >= state.max_new_tokens)
                           | (state.position >= cache_length))
        # merged inside the loop body: a LoRA model (qwix) records on its modules while it runs,
        # which a module from outside the loop's trace refuses
        model = nnx.merge(graphdef, params)
        logits, cache, *stats = model.decode(
            tokens[:, None], state.position[:, None], state.cache, state.position,
            key_length=key_length if key_length < state.cache.max_len else None,
            with_router_stats=routed)
        continuing = live & ~finished
        state = state.replace(
            cache=cache, next_logits=logits[:, 0], generated=generated,
            position=state.position + continuing.astype(jnp.int32), done=state.done | finished)
        column = dict(tokens=tokens, valid=live, logprobs=logprobs,
                      sampling_logprobs=sampling_logprobs)
        if routed:
          column["experts"] = token_major(stats[0].experts)[:, 0]
        buffers = {name: buffers[name].at[:, i].set(column[name]) for name in buffers}
        return state, i + 1, buffers

      def keep_going(carry):
        state, i, _ = carry
        finished_here = jnp.any(state.done & ~done_at_start)
        return (i < steps) & ~jnp.all(state.done) & ~(return_on_finish & finished_here)

      state, num_steps, buffers = jax.lax.while_loop(keep_going, step,
                                                     (state, jnp.int32(0), buffers))
      result = ResultTokens(lengths=state.generated, done=state.done, num_steps=num_steps,
                            **buffers)
      return state, result

    def windowed(params, state: DecodeState, return_on_finish, key_length: int):
      """`decode_steps` over a copy of the first key_length cache slots, written back after the
      call (module docstring, live-length attention: what a CPU takes)."""
      cache = state.cache
      window = cache.first_entries(key_length)
      state, result = decode_steps(params, state.replace(cache=window), return_on_finish,
                                   key_length)
      return state.replace(cache=cache.with_first_entries(state.cache)), result

    def generate(params, state: DecodeState, return_on_finish, *, key_length: int):
      if self._copies_window and key_length < state.cache.max_len:
        return windowed(params, state, return_on_finish, key_length)
      return decode_steps(params, state, return_on_finish, key_length)

    def generate_rows(params, state: DecodeState, rows, return_on_finish, *, key_length: int):
      """`generate` for the slots `rows` only: their state and first key_length cache slots are
      gathered into a batch of len(rows), decoded, and scattered back."""
      per_slot = state.replace(cache=None)
      part = jax.tree.map(lambda a: a[rows], per_slot).replace(
          cache=state.cache.first_entries(key_length, rows))
      part, result = decode_steps(params, part, return_on_finish, key_length)
      cache = state.cache.with_first_entries(part.cache, rows)
      state = jax.tree.map(lambda a, b: a.at[rows].set(b), per_slot,
                           part.replace(cache=None)).replace(cache=cache)
      return state, spread_rows(result, rows, state)

    # a paged engine (sampler.paged) runs these bodies on the rows it gathers from its pages
    self._init_body, self._append_body, self._decode_steps = init, append, decode_steps
    self._init_fn = jax.jit(init, out_shardings=state_shardings)
    self._prefill_fn = jax.jit(prefill, out_shardings=replicated)
    self._insert_fn = jax.jit(insert, donate_argnums=0, out_shardings=state_shardings)
    self._insert_many_fn = jax.jit(insert_many, donate_argnums=0, out_shardings=state_shardings)
    self._release_fn = jax.jit(release, donate_argnums=0, out_shardings=state_shardings)
    self._append_fn = jax.jit(append, donate_argnums=1, out_shardings=state_shardings)
    self._generate_fn = jax.jit(generate, donate_argnums=1, static_argnames="key_length",
                                out_shardings=(state_shardings, replicated))
    self._generate_rows_fn = jax.jit(generate_rows, donate_argnums=1,
                                     static_argnames="key_length",
                                     out_shardings=(state_shardings, replicated))
