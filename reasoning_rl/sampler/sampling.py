"""Token sampling as pure JAX functions: greedy, temperature, top-k, nucleus (top-p) and min-p.

Every function works on a batch of rows [B, V] with per-row parameters [B], so one compiled decode
step serves slots that were inserted with different sampling settings.

The order follows transformers' logits warpers: temperature scaling, then top-k, then top-p on the
distribution that top-k left (renormalised).
- Temperature (Ackley, Hinton & Sejnowski 1985; as used for LMs by Holtzman et al. 2020, §3.2):
  p_T(x) ∝ exp(z_x / T); T = 0 means greedy (argmax, the first index among exact ties).
- Top-k (Fan, Lewis & Dauphin 2018, "Hierarchical Neural Story Generation"): keep the k largest
  logits. Tokens tied with the k-th largest are all kept.
- Top-p / nucleus (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", §3.1): keep
  the smallest set of most probable tokens whose probability mass reaches p. With tokens sorted by
  probability, token i is kept iff the mass of the tokens ranked strictly before it is < p (so the
  most probable token is always kept).
- Min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM
  Outputs", arXiv:2407.01082, §3): keep the tokens with p_T(x) ≥ min_p · max_x' p_T(x'), the
  probabilities taken after temperature. Applied last (transformers' order: temperature, top-k,
  top-p, min-p); since top-k / top-p always keep the most probable token and renormalising scales
  every kept probability alike, it is the same as intersecting with {x : z_x/T ≥ max z/T + log
  min_p} — no sort needed. min_p = 0 disables it.

`truncation_threshold` is the one construction of the kept set: the sampler draws from it, and the
trainer (`reasoning_rl.rl.logprobs`, `algo.truncated_ratio`) rebuilds the same truncation on its
own logits from the same per-row settings (docs/off_policy.md).

Two log-probabilities are returned for each sampled token: under the model's unscaled distribution
(log_softmax of the raw logits — what the trainer's forward computes) and under the distribution the
token was actually drawn from (after temperature / top-k / top-p; 0 for greedy).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from reasoning_rl.config_schema import sourced
from reasoning_rl.errors import SamplingError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn: a typed view of `config.rollout`'s sampling fields (same names and
  defaults, reasoning_rl/config_schema.py).

  Attributes:
    temperature: > 0 scales the logits by 1/temperature; 0 is greedy decoding.
    top_p: nucleus mass in (0, 1]; 1 disables the filter.
    top_k: keep only the k most likely tokens; 0 disables the filter.
    min_p: keep only tokens with probability ≥ min_p × the most likely one's (after temperature;
      Nguyen et al. 2024), in [0, 1]; 0 disables the filter.
  """

  temperature: float = sourced("rollout.temperature")
  top_p: float = sourced("rollout.top_p")
  top_k: int = sourced("rollout.top_k")
  min_p: float = sourced("rollout.min_p")

  def __post_init__(self):
    validate_sampling(self.temperature, self.top_p, self.top_k, self.min_p)

  @property
  def is_greedy(self) -> bool:
    return self.temperature == 0

  @property
  def changes_distribution(self) -> bool:
    """True when the sampling distribution differs from the model's unscaled one."""
    return self.temperature != 1.0 or self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0


def validate_sampling(temperature: float, top_p: float, top_k: int, min_p: float = 0.0) -> None:
  """Raises SamplingError naming the bad field (temperature < 0, top_p outside (0, 1], top_k < 0,
  min_p outside [0, 1])."""
  if not isinstance(temperature, (int, float)) or not temperature >= 0:
    raise SamplingError(
        f"temperature={temperature!r}: must be a number >= 0 (0 means greedy decoding)")
  if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
    raise SamplingError(f"top_p={top_p!r}: must be in (0, 1] (1 disables nucleus sampling)")
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
    raise SamplingError(f"top_k={top_k!r}: must be an integer >= 0 (0 disables top-k)")
  if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
    raise SamplingError(f"min_p={min_p!r}: must be in [0, 1] (0 disables min-p sampling)")


def first_argmax(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` (the first index among ties; a row with a NaN gives its first NaN), as
  int32, computed as a max and a min over indices.

  Why not jnp.argmax: XLA:CPU lowers argmax to a reduction over (value, index) pairs that it does not
  vectorize; on a [16, 49152] row block it took 1.8 ms against 0.35 ms for this form, and a sampled
  decode step of SmolLM2 ran three of them.
  """
  largest = jnp.max(x, axis=-1, keepdims=True)  # NaN when the row holds one
  hits = (x == largest) | jnp.isnan(x)
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hits, index, x.shape[-1]), axis=-1)


def gumbel_max(keys: jax.Array, logits: jax.Array) -> jax.Array:
  """One draw per row from softmax(logits) by the Gumbel-max trick (Gumbel 1954; Maddison, Tarlow
  & Minka 2014, "A* Sampling"): argmax(logits + g), g ~ Gumbel(0, 1) from the row's key.

  The same tokens as `jax.vmap(jax.random.categorical)(keys, logits)` (the same noise, added the
  same way), with `first_argmax` instead of jnp.argmax: about 3x faster on a CPU.
  """
  vocab = logits.shape[-1]
  noise = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), logits.dtype))(keys)
  return first_argmax(noise + logits)


def _top_k_top_p_threshold(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """[..., 1] the smallest scaled logit that top-k then top-p keep (the kept tokens form a prefix
  of the sorted row; parameters [...] broadcast against the rows), from a full sort."""
  vocab = scaled.shape[-1]
  descending = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth_value = jnp.take_along_axis(descending, (k - 1)[..., None], axis=-1)
  in_top_k = descending >= kth_value
  sorted_probs = jax.nn.softmax(jnp.where(in_top_k, descending, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  in_nucleus = in_top_k & ((mass_before < top_p[..., None]) | (top_p[..., None] >= 1.0))
  num_kept = jnp.sum(in_nucleus, axis=-1)
  return jnp.take_along_axis(descending, (num_kept - 1)[..., None], axis=-1)


# The largest values `_prefix_threshold` reads (lax.top_k): a full sort of a 49k vocabulary
# costs ~37x a top-256 on a CPU (3.6 s against 0.1 s for 256 rows).
PREFIX = 256


def _prefix_threshold(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array):
  """(threshold [..., 1], resolved [...]): `_top_k_top_p_threshold` from the PREFIX largest
  values alone, and whether that settles the row: the kept set has fewer than PREFIX tokens and
  top-k, if on, is within the prefix. The top-k set's normaliser is a logsumexp over the whole
  row (ties with the k-th value included, as in the sort)."""
  vocab = scaled.shape[-1]
  width = min(PREFIX, vocab)
  descending = jax.lax.top_k(scaled, width)[0]
  k_on = top_k > 0
  k = jnp.minimum(jnp.where(k_on, top_k, vocab), vocab)
  kth_value = jnp.where(
      k_on & (k <= width),
      jnp.take_along_axis(descending, (jnp.minimum(k, width) - 1)[..., None], axis=-1)[..., 0],
      -jnp.inf)[..., None]
  log_norm = jax.nn.logsumexp(jnp.where(scaled >= kth_value, scaled, -jnp.inf), axis=-1,
                              keepdims=True)
  in_top_k = descending >= kth_value
  probs = jnp.where(in_top_k, jnp.exp(descending - log_norm), 0.0)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  no_p = top_p[..., None] >= 1.0
  num_kept = jnp.sum(in_top_k & ((mass_before < top_p[..., None]) | no_p), axis=-1)
  threshold = jnp.where(
      no_p, kth_value,
      jnp.take_along_axis(descending, (jnp.maximum(num_kept, 1) - 1)[..., None], axis=-1))
  k_known = ~k_on | (k <= width)
  resolved = k_known & ((top_p >= 1.0) | (num_kept < width) | (width == vocab))
  return threshold, resolved


def truncation_threshold(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array,
                         min_p: jax.Array) -> jax.Array:
  """[..., 1]: a token is kept iff its temperature-scaled logit is ≥ this threshold (top-k, then
  top-p, then min-p, module docstring). scaled [..., V]; top_p, top_k, min_p [...].

  Top-k / top-p read the PREFIX largest values (lax.top_k) and fall back to a full sort only for
  a row whose kept set does not fit in them; both are skipped (lax.cond) when no row uses either
  filter. Min-p needs only the row maximum. Ties with the threshold are kept, as in the filters
  themselves.

  Each row's threshold comes from its own path: the prefix's when the prefix settles the row,
  the sort's otherwise. The two round differently (a normaliser over the row against a softmax
  of the sorted row), so taking one path for the whole call when any row needed the sort made a
  row's kept set depend on the other rows of its call (a top-p row next to a flat one kept
  another set in about 2 of 10,000 rows), which the truncated ratio's recomputation in another
  batch could not reproduce.
  """
  def top_k_top_p(s, p, k):
    threshold, resolved = _prefix_threshold(s, p, k)
    # the full sort runs only when some row's kept set outgrows the prefix (a flat distribution),
    # and only those rows take its threshold
    return jax.lax.cond(
        jnp.all(resolved), lambda: threshold,
        lambda: jnp.where(resolved[..., None], threshold, _top_k_top_p_threshold(s, p, k)))

  needs_sort = jnp.any((top_p < 1.0) | (top_k > 0))
  threshold = jax.lax.cond(
      needs_sort, top_k_top_p,
      lambda s, p, k: jnp.full(s.shape[:-1] + (1,), -jnp.inf, s.dtype), scaled, top_p, top_k)
  # Min-p: z/T ≥ max z/T + log(min_p); log 0 = -inf keeps every token.
  log_min_p = jnp.where(min_p > 0, jnp.log(jnp.maximum(min_p, 1e-38)), -jnp.inf)
  min_p_threshold = jnp.max(scaled, axis=-1, keepdims=True) + log_min_p[..., None].astype(
      scaled.dtype)
  return jnp.maximum(threshold, min_p_threshold)


def sampling_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array,
                    top_k: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
  """Logits of the distribution tokens are drawn from; excluded tokens are -inf.

  logits [B, V] float32; temperature, top_p, min_p [B] float32; top_k [B] int32 (min_p None = 0).
  Greedy rows (temperature 0) become a point mass on their argmax. The filters are skipped
  (lax.cond) when no row uses any.
  """
  if min_p is None:
    min_p = jnp.zeros_like(top_p)
  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  needs_filter = jnp.any((top_p < 1.0) | (top_k > 0) | (min_p > 0))
  scaled = jax.lax.cond(
      needs_filter,
      lambda s, p, k, m: jnp.where(s >= truncation_threshold(s, p, k, m), s, -jnp.inf),
      lambda s, p, k, m: s, scaled, top_p, top_k, min_p)
  argmax = first_argmax(logits)
  point_mass = jnp.where(jnp.arange(logits.shape[-1])[None, :] == argmax[:, None], 0.0, -jnp.inf)
  return jnp.where(greedy[:, None], point_mass, scaled)


THRESHOLD_NAME = "truncation_threshold"


def truncated_logprobs(logits: jax.Array, targets: jax.Array, temperature: jax.Array,
                       top_p: jax.Array, top_k: jax.Array, min_p: jax.Array, *,
                       with_membership: bool = False):
  """log π^W(target): the log-prob of each target under the distribution the sampler draws from
  with these settings (temperature, then top-k / top-p / min-p, renormalised), rebuilt from
  `logits`. The trainer's side of `algo.truncated_ratio` (docs/off_policy.md).

  logits [..., V]; targets [...] int; temperature, top_p, min_p [...] float, top_k [...] int, one
  value per position (a row's settings repeated along its tokens).

  - The kept set is a function of the logits that is constant almost everywhere, so it carries no
    gradient (stop_gradient); the gradient is that of z_y/T − logsumexp_{x ∈ S}(z_x/T), the
    score function of the truncated, renormalised policy.
  - The target is always kept: it was drawn, so it lies in the sampler's kept set, and a trainer
    whose numerics (another dtype or kernel) rank it just outside would otherwise give log 0.
    With `with_membership` the result is (log-probs, in_set): in_set [...] bool says whether the
    target lies in the kept set these logits give (without that forcing). The trainer uses it to
    tell a token that left the kept set after an update (its ratio is 0) from one the rebuild's
    numerics put outside at the sampler's own weights (docs/off_policy.md).
  - temperature ≤ 0 (a greedy row: a point mass, nothing to differentiate) is read as the
    untruncated model at temperature 1, the same as the full-softmax log-prob.
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0
  temperature = jnp.where(greedy, 1.0, temperature)
  top_p = jnp.where(greedy, 1.0, top_p)
  top_k = jnp.where(greedy, 0, top_k)
  min_p = jnp.where(greedy, 0.0, min_p)
  scaled = logits / temperature[..., None].astype(jnp.float32)
  # Named so that a checkpointed caller can keep it for the backward pass instead of sorting the
  # vocabulary again (`reasoning_rl.rl.logprobs`): it is [..., 1], the sort is [..., V].
  threshold = checkpoint_name(
      truncation_threshold(jax.lax.stop_gradient(scaled), top_p, top_k, min_p),
      THRESHOLD_NAME)
  is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
  keep = jax.lax.stop_gradient((scaled >= threshold) | is_target)
  kept = jnp.where(keep, scaled, -jnp.inf)
  target_logit = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
  logprobs = target_logit - jax.nn.logsumexp(kept, axis=-1)
  if not with_membership:
    return logprobs
  return logprobs, jax.lax.stop_gradient(target_logit >= threshold[..., 0])


def _token_logprobs(x: jax.Array, tokens: jax.Array) -> jax.Array:
  """log_softmax(x) at the tokens [B], without materialising it for all [B, V]."""
  return jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(x, axis=-1)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array, min_p: jax.Array | None = None):
  """Draws one token per row.

  Args:
    logits: [B, V] raw float32 logits.
    keys: [B] typed PRNG keys, one per row (a row's draw depends only on its key and logits).
    temperature, top_p, top_k, min_p: [B] per-row parameters (see `SamplingParams`; min_p None
      = 0 for every row).

  Returns:
    (tokens [B] int32, model_logprobs [B], sampling_logprobs [B]): log p of the token under
    log_softmax(logits) and under the distribution it was drawn from.
  """
  logits = logits.astype(jnp.float32)
  if min_p is None:
    min_p = jnp.zeros_like(top_p)
  greedy = temperature <= 0
  greedy_tokens = first_argmax(logits)
  # At temperature 1 without filters the two distributions are the same one.
  unchanged = jnp.all((temperature == 1.0) & (top_p >= 1.0) & (top_k <= 0) & (min_p <= 0))

  # Each branch returns (tokens, model log-probs, sampling log-probs).
  def all_greedy():
    # A greedy row's distribution is a point mass on its argmax: log-probability 0 (what
    # _token_logprobs of `sampling_logits` gives, exactly). Skips building that [B, V] mass
    # and its logsumexp: 8.7 -> 6.1 ms a call at [64, 49152] on a CPU (benchmarks/RESULTS.md,
    # 2026-12-02).
    return (greedy_tokens, _token_logprobs(logits, greedy_tokens),
            jnp.zeros(logits.shape[:1], jnp.float32))

  def all_plain():  # sampling_logits would divide by 1 and filter nothing: the logits themselves
    tokens = gumbel_max(keys, logits)
    model_logprobs = _token_logprobs(logits, tokens)
    return tokens, model_logprobs, model_logprobs

  def general():
    filtered = sampling_logits(logits, temperature, top_p, top_k, min_p)
    tokens = jnp.where(greedy, greedy_tokens, gumbel_max(keys, filtered))
    return tokens, _token_logprobs(logits, tokens), _token_logprobs(filtered, tokens)

  # Drawing Gumbel noise for [B, V] costs as much as a small model's step on a CPU: a batch of
  # greedy rows draws none.
  branch = jnp.where(jnp.all(greedy), 0, jnp.where(unchanged, 1, 2))
  tokens, model_logprobs, sampling_logprobs = jax.lax.switch(
      branch, (all_greedy, all_plain, general))
  return tokens, model_logprobs, sampling_logprobs


def sample_key(seed: int, prompt_id: int, sample_index: int) -> jax.Array:
  """The PRNG key of one completion: key(seed) folded with its prompt id, then its sample index.

  Token n of the completion is drawn with `fold_in(sample_key, n)`, so a completion depends only on
  (seed, prompt_id, sample_index) and the model — not on which slot or batch it ran in.
  """
  key = jax.random.fold_in(jax.random.key(seed), prompt_id)
  return jax.random.fold_in(key, sample_index)
