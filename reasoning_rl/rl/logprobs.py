"""Per-token log-probabilities of completions without materialising [batch, time, vocab] logits.

A row of a training batch is `prompt (left-padded to P) + completion (right-padded to T)`. The
log-prob of completion token t comes from the hidden state at position P + t − 1. Projecting every
hidden state to a 49k-entry vocabulary at once would hold B·T·V float32 values (3.2 GB for
32 × 512 × 49k) and as much again for the backward pass; instead the time axis is cut into chunks,
and each chunk's logits are computed, reduced to (log-prob, entropy) and dropped. `jax.checkpoint`
makes the backward pass recompute a chunk's logits instead of storing them, so peak memory is
O(B · chunk · V); the first chunk, projected last, is the exception: its backward pass comes
first, so its logits are kept instead (no more memory, one projection fewer).

Packed rows (padding-free training, `reasoning_rl.rl.packing`): several sequences share a row,
kept apart by segment ids, and the head runs only where a completion token is predicted.

Truncated log-probs (`algo.truncated_ratio`, docs/off_policy.md): given each row's sampling
settings (`TRUNCATION_FIELDS`), `completion_logprobs` returns log π^W — the log-prob of the token
under the distribution the sampler draws from (temperature, top-k, top-p, min-p, renormalised),
rebuilt on the trainer's own logits by `reasoning_rl.sampler.sampling.truncated_logprobs` — and,
alongside, the full-softmax log-prob (for the mismatch metrics). The entropy stays the full
softmax's. Packed rows carry the settings per head position (`packing.HEAD_TRUNCATION_FIELDS`,
each its sequence's): one packed row may hold sequences sampled under different settings.

Mixture-of-experts models (`routing`, a `RoutingInputs`): the forward may be given the experts
the sampler chose for every token of the rows (laid out like `tokens`), replay them (routing
replay, `reasoning_rl.models.moe`) and hand back its `RouterStats` as the last output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import dataclasses

from reasoning_rl.models.transformer import Transformer
from reasoning_rl.rl.batching import TRUNCATION_FIELDS  # noqa: F401 (where the step reads it)
from reasoning_rl.sampler.sampling import THRESHOLD_NAME, truncated_logprobs


@dataclasses.dataclass(frozen=True)
class RoutingInputs:
  """What a MoE forward of these functions takes besides the tokens.

  recorded: [rows, width, L_sparse, k] integers laid out like the rows' tokens (padded or packed),
    the sampler's experts for each token; None when the batch carries none.
  replay: route by `recorded` (R3) instead of the router's own top-k.
  with_stats: append the forward's `RouterStats` to the outputs.
  """

  recorded: jax.Array | None = None
  replay: bool = False
  with_stats: bool = False

  def forward_kwargs(self) -> dict:
    return dict(recorded_experts=self.recorded, replay_experts=self.replay,
                with_router_stats=self.with_stats)


def _hidden(model, tokens, routing: RoutingInputs | None, **kwargs):
  """(hidden states, RouterStats or None) of a full forward."""
  if routing is None:
    return model.hidden_states(tokens, **kwargs), None
  out = model.hidden_states(tokens, **kwargs, **routing.forward_kwargs())
  return out if routing.with_stats else (out, None)


def _chunk_logprobs(model: Transformer, hidden: jax.Array, targets: jax.Array,
                    truncation=None):
  """hidden [B, c, D], targets [B, c] -> (log p(target) [B, c], entropy [B, c]), float32.
  With `truncation` (the four settings, each [B, c]): (log π^W(target), entropy, full log p,
  in_set: 1.0 where the target lies in the kept set of these logits, else 0.0)."""
  shape = targets.shape
  # One axis of B·c positions: XLA:CPU splits a reduction over the vocabulary by its leading
  # axis, and packed rows come as B = 1 (one group of rows per device), which left one of two
  # cores idle: 565 against 283 ms for [1, 1024, 49152] vs [1024, 49152] (benchmarks/RESULTS.md).
  hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
  logits = model.logits_from_hidden(hidden)
  log_norm = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  probs = jnp.exp(logits - log_norm[..., None])
  entropy = log_norm - jnp.sum(probs * logits, axis=-1)
  if truncation is None:
    return (target_logits - log_norm).reshape(shape), entropy.reshape(shape)
  truncated, in_set = truncated_logprobs(logits, targets, *(x.reshape(-1) for x in truncation),
                                         with_membership=True)
  return tuple(x.reshape(shape) for x in (truncated, entropy, target_logits - log_norm,
                                          in_set.astype(jnp.float32)))


def completion_logprobs(model: Transformer, tokens: jax.Array, attention_mask: jax.Array,
                        completion_length: int, *, chunk_size: int = 128,
                        return_hidden: bool = False, remat: bool = False, truncation=None,
                        routing: RoutingInputs | None = None):
  """Log-probs and entropies of the last `completion_length` tokens of each row.

  Args:
    model: the policy (or reference) transformer.
    tokens, attention_mask: [B, P + T]; the prompt part may be left-padded, the completion part
      right-padded (mask 0 after the end).
    completion_length: T.
    chunk_size: time steps projected to the vocabulary at once.
    return_hidden: also return the hidden states feeding the completion tokens [B, T, D] (a value
      head reads them).
    remat: rematerialise each transformer block in the backward pass (see
      `Transformer.hidden_states`).
    truncation: None, or each row's sampling settings (temperature, top_p, top_k, min_p), [B]
      each (`TRUNCATION_FIELDS`): then the log-probs are the truncated ones, log π^W (module
      docstring).
    routing: MoE models: `RoutingInputs` (module docstring).

  Returns:
    (logprobs [B, T], entropy [B, T]) in float32 (+ with `truncation` the full-softmax log-probs
    [B, T] and whether each target lies in its kept set [B, T], 1.0 / 0.0: `truncated_logprobs`
    keeps a target outside it, and the loss needs to know which did) (+ hidden when asked) (+ the RouterStats with `routing.with_stats`). Values at
    padding positions are finite but meaningless; mask them.
  """
  prompt_length = tokens.shape[1] - completion_length
  if prompt_length < 1:
    raise ValueError(f"rows of length {tokens.shape[1]} leave no prompt before "
                     f"{completion_length} completion tokens")
  hidden, router_stats = _hidden(model, tokens, routing, attention_mask=attention_mask,
                                 remat=remat)
  hidden = hidden[:, prompt_length - 1: prompt_length - 1 + completion_length]
  if truncation is not None:  # one row's settings at each of its positions
    truncation = tuple(jnp.broadcast_to(x[:, None], (x.shape[0], completion_length))
                       for x in truncation)
  out = head_logprobs(model, hidden, tokens[:, prompt_length:], chunk_size,
                      truncation=truncation)
  if return_hidden:
    out = (*out, hidden)
  return (*out, router_stats) if routing is not None and routing.with_stats else out


def head_logprobs(model: Transformer, hidden: jax.Array, targets: jax.Array, chunk_size: int,
                  *, skip_empty: bool = False, truncation=None):
  """(log p(target), entropy) [B, L] float32 of hidden states [B, L, D], the vocabulary
  projection made `chunk_size` positions at a time (module docstring). With `truncation` (four
  [B, L] settings per position): (log π^W(target), entropy, full log p(target), target in the kept
  set 1.0 / 0.0).

  With `skip_empty`, targets < 0 mark positions without a target, and a chunk with none for any
  row is not projected at all (`lax.cond`): its outputs are 0.
  """
  batch, length, width = hidden.shape
  chunk = min(chunk_size, length)
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length
  padded_hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  padded_targets = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=-1 if skip_empty else 0)
  # [num_chunks, B, chunk, ...] so lax.map walks the chunks one after another.
  hidden_chunks = padded_hidden.reshape(batch, num_chunks, chunk, width).swapaxes(0, 1)
  target_chunks = padded_targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)
  inputs = (hidden_chunks, target_chunks)
  if truncation is not None:
    inputs += (tuple(
        jnp.pad(x, ((0, 0), (0, pad)), constant_values=1).reshape(batch, num_chunks, chunk)
        .swapaxes(0, 1) for x in truncation),)
  # The backward pass recomputes a chunk's logits; with truncation it keeps the chunk's kept-set
  # thresholds ([B, c, 1]) from the forward pass, so the vocabulary is sorted once, not twice.
  policy = (None if truncation is None
            else jax.checkpoint_policies.save_only_these_names(THRESHOLD_NAME))
  project = lambda args: _chunk_logprobs(model, *args)
  recomputed = jax.checkpoint(project, policy=policy)

  def each_chunk(project):
    if not skip_empty:
      return project
    outputs = 2 if truncation is None else 4

    def one_chunk(args):
      empty = (jnp.zeros(args[1].shape, jnp.float32),) * outputs
      return jax.lax.cond(jnp.any(args[1] >= 0), project, lambda _: empty,
                          (args[0], jnp.maximum(args[1], 0), *args[2:]))
    return one_chunk

  # Chunk 0 is projected last and kept, not recomputed: its backward pass runs first, right after
  # the loss, so its logits cost no more peak memory than a recomputation would, and a projection
  # is saved. Packed rows hold their head positions from chunk 0 on (the others are mostly empty
  # and skipped), so there this is most of the head's recomputing (benchmarks/RESULTS.md,
  # "The vocabulary head's recomputation"). The barrier keeps chunk 0 after the others.
  first = jax.tree.map(lambda x: x[0], inputs)
  if num_chunks > 1:
    rest = jax.lax.map(each_chunk(recomputed), jax.tree.map(lambda x: x[1:], inputs))
    rest, first = jax.lax.optimization_barrier((rest, first))
  first = each_chunk(project)(first)
  outputs = tuple(x[None] for x in first)
  if num_chunks > 1:
    outputs = tuple(jnp.concatenate([x, y]) for x, y in zip(outputs, rest))
  return tuple(x.swapaxes(0, 1).reshape(batch, -1)[:, :length] for x in outputs)


def packed_completion_logprobs(model: Transformer, packed, *, return_hidden: bool = False,
                               remat: bool = False, truncation=None,
                               routing: RoutingInputs | None = None):
  """`completion_logprobs` of one packed micro-batch (`reasoning_rl.rl.packing`).

  The transformer runs on the packed rows [R, W] (segment ids keep sequences apart). The
  vocabulary head runs only at the positions that predict a completion token: `head_index`
  [G, chunks, chunk] lists them per group of rows (one group per data device, so the gather stays
  on the device) and sets the chunk size; chunks without any are skipped. The results are then laid out per sequence, [N, T]
  (`token_index`), where the losses read them.

  `truncation`: None, or the four sampling settings per head position, each shaped like
  `head_targets` (`packing.HEAD_TRUNCATION_FIELDS`); then the log-probs are log π^W, and the
  full-softmax ones follow the entropy, as in `completion_logprobs`.

  Returns (logprobs [N, T], entropy [N, T]) float32 (+ with `truncation` the full-softmax
  log-probs and the kept-set membership [N, T], as `completion_logprobs`) (+ the hidden states at those positions, [N, T, D], when asked) (+ the
  RouterStats with `routing.with_stats`; `routing.recorded` laid out like the packed tokens);
  padding positions hold 0.
  """
  hidden, router_stats = _hidden(model, packed["tokens"], routing,
                                 positions=packed["positions"],
                                 segment_ids=packed["segment_ids"], remat=remat)
  rows, width, dim = hidden.shape
  groups, _, chunk = packed["head_index"].shape
  hidden = hidden.reshape(groups, rows // groups * width, dim)
  head_index = packed["head_index"].reshape(groups, -1)
  hidden = jnp.take_along_axis(hidden, head_index[..., None], axis=1)  # [G, H, D]
  if truncation is not None:
    truncation = tuple(x.reshape(groups, -1) for x in truncation)
  out = head_logprobs(model, hidden, packed["head_targets"].reshape(groups, -1), chunk,
                      skip_empty=True, truncation=truncation)
  per_sequence = lambda x: unpack_tokens(x, packed["token_index"])
  out = tuple(per_sequence(x) for x in out)
  if return_hidden:
    out = (*out, per_sequence(hidden))
  return (*out, router_stats) if routing is not None and routing.with_stats else out


def unpack_tokens(values: jax.Array, token_index: jax.Array) -> jax.Array:
  """[G, H, ...] values at packed head positions → [N, T, ...] per sequence; `token_index` [N, T]
  holds flat indices into G·H, and G·H (one past the end) at padding, which reads 0."""
  flat = values.reshape(-1, *values.shape[2:])
  flat = jnp.concatenate([flat, jnp.zeros((1, *flat.shape[1:]), flat.dtype)])
  return flat[token_index]
