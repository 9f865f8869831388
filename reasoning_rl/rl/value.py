"""PPO with a learned value baseline: token rewards, GAE, whitening, clipped value loss.

The classic alternative to group baselines (Ouyang et al. 2022 style RLHF-PPO). An outcome
reward is placed on the last valid token of its completion (:func:`sequence_rewards_to_tokens`);
a value head predicts V(s_t) per token; GAE turns rewards and values into per-token advantages
and return targets (:func:`gae_advantages`); advantages are usually whitened over the batch
(:func:`masked_whiten`) and go to :func:`reasoning_rl.rl.losses.policy_loss` as a ``[B, T]``
array; the value head is trained with :func:`value_loss`.

Masks: nonzero = a token the policy generated. Positions that are masked inside a completion
(e.g. tool output in a multi-turn episode) are skipped: the recursion passes straight through
them to the next valid token. The last valid token is terminal (V after it is 0); truncated
completions are treated as terminal too, since their reward is final.

All functions are pure jax (jittable; float options static or traced alike).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from reasoning_rl.errors import ConfigError
from reasoning_rl.rl import stats as stats_lib
from reasoning_rl.rl.losses import aggregate_loss
from reasoning_rl.rl.stats import float_dtype


def _check_same_shape(**arrays: Any) -> None:
  shapes = {name: tuple(jnp.shape(a)) for name, a in arrays.items()}
  if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
    raise ValueError(f"expected arrays of one [B, T] shape, got shapes {shapes}")


def sequence_rewards_to_tokens(sequence_rewards: Any, mask: Any) -> jax.Array:
  """Places each sequence's scalar reward on its last valid token.

  ``sequence_rewards [B]``, ``mask [B, T]`` → ``[B, T]`` zeros except at the last position with
  ``mask > 0`` in each row; a row without valid tokens stays all zero.
  """
  mask = jnp.asarray(mask) > 0
  sequence_rewards = jnp.asarray(sequence_rewards)
  if sequence_rewards.shape != mask.shape[:1]:
    raise ValueError(
        f"sequence_rewards has shape {sequence_rewards.shape}; expected [B] = {mask.shape[:1]}")
  num_steps = mask.shape[1]
  positions = jnp.arange(num_steps)
  last = jnp.max(jnp.where(mask, positions, -1), axis=1)  # -1: no valid token
  dtype = float_dtype(jnp, sequence_rewards.dtype)
  is_last = positions[None, :] == last[:, None]
  return jnp.where(is_last, sequence_rewards[:, None].astype(dtype), 0).astype(dtype)


def gae_advantages(rewards: Any, values: Any, mask: Any, *, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation over tokens (Schulman et al. 2016, "High-Dimensional
  Continuous Control Using Generalized Advantage Estimation", ICLR, arXiv:1506.02438).

  For valid tokens t, with t' the next valid token after t (none → terminal, V = 0):
  ``δ_t = r_t + γ V_{t'} - V_t``, ``A_t = δ_t + γ λ A_{t'}`` (so ``A_t = Σ_k (γλ)^k δ_{t+k}``
  along the valid tokens), and the value target ``R_t = A_t + V_t`` (the λ-return).
  Masked positions get ``A = R = 0`` and do not break the chain.

  Args:
    rewards: ``[B, T]`` per-token rewards (see :func:`sequence_rewards_to_tokens`).
    values: ``[B, T]`` value predictions of the rollout policy's value head (no gradient).
    mask: ``[B, T]``, nonzero = valid token.
    gamma: discount γ ∈ [0, 1] (1.0 is usual for LLM completions).
    lam: GAE λ ∈ [0, 1] (λ = 1: Monte-Carlo returns minus V; λ = 0: one-step TD).

  Returns:
    ``(advantages, returns)``, both ``[B, T]`` float, gradient-stopped.
  """
  for name, value in (("gamma", gamma), ("lam", lam)):
    if isinstance(value, (int, float)) and not 0 <= value <= 1:
      raise ConfigError(f"{name}={value!r} must be in [0, 1]")
  _check_same_shape(rewards=rewards, values=values, mask=mask)
  valid = jnp.asarray(mask) > 0
  rewards, values = jnp.asarray(rewards), jnp.asarray(values)
  dtype = float_dtype(jnp, rewards.dtype, values.dtype)
  rewards = jnp.where(valid, rewards.astype(dtype), 0)
  values = jnp.where(valid, values.astype(dtype), 0)

  def backward_step(carry, inputs):
    next_value, next_advantage = carry
    reward, value, is_valid = inputs
    delta = reward + gamma * next_value - value
    advantage = delta + gamma * lam * next_advantage
    carry = (jnp.where(is_valid, value, next_value),
             jnp.where(is_valid, advantage, next_advantage))
    return carry, jnp.where(is_valid, advantage, 0)

  zeros = jnp.zeros(rewards.shape[:1], dtype)
  _, advantages = jax.lax.scan(backward_step, (zeros, zeros), (rewards.T, values.T, valid.T),
                               reverse=True)
  advantages = advantages.T
  returns = jnp.where(valid, advantages + values, 0)
  return jax.lax.stop_gradient(advantages), jax.lax.stop_gradient(returns)


def masked_whiten(x: Any, mask: Any, *, eps: float = 1e-8) -> jax.Array:
  """``(x - mean) / sqrt(var + eps)`` with mean and population variance over valid entries.

  The advantage normalisation of PPO implementations (OpenAI baselines ppo2; Ziegler et al.
  2019, "Fine-Tuning Language Models from Human Preferences", for tokens). Uses statistics of
  the whole array: apply it to the full batch before splitting into micro-batches. Masked
  entries are 0 in the output.
  """
  valid = jnp.asarray(mask) > 0
  x = jnp.asarray(x)
  x = jnp.where(valid, x.astype(float_dtype(jnp, x.dtype)), 0)
  count = jnp.maximum(jnp.sum(valid), 1)
  mean = jnp.sum(x) / count
  var = jnp.sum(jnp.where(valid, (x - mean) ** 2, 0)) / count
  return jnp.where(valid, (x - mean) * jax.lax.rsqrt(var + eps), 0)


def value_loss(values: Any, old_values: Any, returns: Any, mask: Any, *,
               clip_epsilon: Optional[float] = 0.2, loss_agg: str = "token-mean",
               num_sequences: Any = None, num_tokens: Any = None,
               max_completion_length: Optional[int] = None) -> tuple[jax.Array, stats_lib.Stats]:
  """Clipped value-function loss of PPO2 (OpenAI baselines, Dhariwal et al. 2017; analysed in
  Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients", arXiv:2005.12729).

  Per valid token: ``V_clip = V_old + clip(V - V_old, -ε_v, ε_v)`` and
  ``ℓ = ½ max((V - R)², (V_clip - R)²)``; with ``clip_epsilon=None``, ``ℓ = ½ (V - R)²``.
  Aggregated like the policy loss (:func:`reasoning_rl.rl.losses.aggregate_loss`, same
  micro-batch normaliser overrides).

  Args:
    values: ``[B, T]`` current value predictions (the differentiable input).
    old_values: ``[B, T]`` predictions at rollout time (the ones GAE used).
    returns: ``[B, T]`` targets from :func:`gae_advantages`.
    mask: ``[B, T]``, nonzero = valid token.
    clip_epsilon: ε_v, or None for an unclipped loss.
    loss_agg, num_sequences, num_tokens, max_completion_length: as in ``aggregate_loss``.

  Returns:
    ``(loss, stats)`` with ``value/loss`` (per-token ℓ), ``value/clip_frac`` (share of tokens
    where the clipped term is the larger), ``value/mean``, ``value/returns_mean``,
    ``value/abs_error`` (|V - R|).
  """
  if clip_epsilon is not None and not clip_epsilon > 0:
    raise ConfigError(f"value clip_epsilon={clip_epsilon!r} must be > 0, or None to disable")
  _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
  valid = jnp.asarray(mask) > 0
  values, old_values, returns = (jnp.asarray(a) for a in (values, old_values, returns))
  dtype = float_dtype(jnp, values.dtype, old_values.dtype, returns.dtype)
  values, old_values, returns = (jnp.where(valid, a.astype(dtype), 0)
                                 for a in (values, old_values, returns))
  error_sq = (values - returns) ** 2
  if clip_epsilon is None:
    per_token = 0.5 * error_sq
    clipped = jnp.zeros_like(valid)
  else:
    values_clipped = old_values + jnp.clip(values - old_values, -clip_epsilon, clip_epsilon)
    clipped_error_sq = (values_clipped - returns) ** 2
    per_token = 0.5 * jnp.maximum(error_sq, clipped_error_sq)
    clipped = clipped_error_sq > error_sq
  loss = aggregate_loss(per_token, valid, loss_agg, num_sequences=num_sequences,
                        num_tokens=num_tokens, max_completion_length=max_completion_length)
  metrics = {
      "value/loss": stats_lib.mean_stat(per_token, valid),
      "value/clip_frac": stats_lib.mean_stat(clipped, valid),
      "value/mean": stats_lib.mean_stat(values, valid),
      "value/returns_mean": stats_lib.mean_stat(returns, valid),
      "value/abs_error": stats_lib.mean_stat(jnp.abs(values - returns), valid),
  }
  return loss, jax.lax.stop_gradient(metrics)
