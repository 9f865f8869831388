"""Length shaping rewards, all counted in tokens.

- DAPO soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
  System at Scale", §3.4, Eq. 13).
- Kimi k1.5 length reward (Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement Learning with LLMs",
  §2.3.3 "Length Penalty").
- LCPO target-length rewards (Aggarwal & Welleck 2025, "L1: Controlling How Long A Reasoning Model
  Thinks With Reinforcement Learning", §3, Eqs. 1 and 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from reasoning_rl.errors import ConfigError

LENGTH_VERIFIER_VERSION = "length-1"


def _non_negative_int(field: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ConfigError(f"{field}={value!r} must be a non-negative integer number of tokens")
  return value


def dapo_overlong_penalty(num_tokens: int, *, max_len: int, cache_len: int,
                          truncated: bool = False) -> float:
  """DAPO soft overlong punishment (Yu et al. 2025, Eq. 13).

      R(y) = 0                              if |y| <= L_max - L_cache
           = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
           = -1                             if |y| > L_max

  A truncated response (generation stopped at the limit without finishing) gets the full -1,
  whatever its length.

  Args:
    num_tokens: |y|, the response length in tokens.
    max_len: L_max, the generation limit (usually `max_new_tokens`).
    cache_len: L_cache, the width of the soft-penalty window before the limit (0 < L_cache <= L_max).
    truncated: the response hit the limit without an end-of-sequence token.
  """
  _non_negative_int("length.num_tokens", num_tokens)
  _non_negative_int("length.max_len", max_len)
  _non_negative_int("length.cache_len", cache_len)
  if not 0 < cache_len <= max_len:
    raise ConfigError(
        f"length.cache_len={cache_len} must satisfy 0 < cache_len <= max_len (max_len={max_len})"
    )
  if truncated or num_tokens > max_len:
    return -1.0
  soft_start = max_len - cache_len
  if num_tokens <= soft_start:
    return 0.0
  return (soft_start - num_tokens) / cache_len


def kimi_length_rewards(lengths: Sequence[int], correct: Sequence[bool]) -> list[float]:
  """Kimi k1.5 length reward for one group of responses to the same prompt (Kimi Team 2025).

      λ_i = 0.5 - (len_i - min_len) / (max_len - min_len)
      reward_i = λ_i             if response i is correct
               = min(0, λ_i)     otherwise

  min_len / max_len are taken over the group. When all lengths are equal the ratio is undefined and
  every reward is 0 (no length signal).
  """
  if len(lengths) != len(correct):
    raise ConfigError(
        f"kimi length reward: {len(lengths)} lengths but {len(correct)} correctness flags"
    )
  for n in lengths:
    _non_negative_int("length.num_tokens", n)
  if not lengths:
    return []
  shortest, longest = min(lengths), max(lengths)
  if shortest == longest:
    return [0.0] * len(lengths)
  rewards = []
  for n, ok in zip(lengths, correct):
    lam = 0.5 - (n - shortest) / (longest - shortest)
    rewards.append(lam if ok else min(0.0, lam))
  return rewards


def lcpo_exact_penalty(num_tokens: int, target_tokens: int, *, alpha: float = 3e-4) -> float:
  """The length term of LCPO-Exact (Aggarwal & Welleck 2025, Eq. 1): -α·|n_target - n_used|.

  The paper's full reward is `correct - α·|n_target - n_used|`; with reward parts this is the
  `correct` part (weight 1) plus this `length` part (weight 1). The paper uses α = 0.0003.
  """
  _non_negative_int("length.num_tokens", num_tokens)
  _non_negative_int("length.target_tokens", target_tokens)
  if alpha < 0:
    raise ConfigError(f"length.alpha={alpha} must be >= 0")
  return -alpha * abs(target_tokens - num_tokens)


def lcpo_exact_reward(correct: bool, num_tokens: int, target_tokens: int, *,
                      alpha: float = 3e-4) -> float:
  """LCPO-Exact reward (Aggarwal & Welleck 2025, Eq. 1): 1[correct] - α·|n_target - n_used|."""
  return float(bool(correct)) + lcpo_exact_penalty(num_tokens, target_tokens, alpha=alpha)


def lcpo_max_reward(correct: bool, num_tokens: int, target_tokens: int, *, alpha: float = 3e-4,
                    delta: float = 0.5) -> float:
  """LCPO-Max reward (Aggarwal & Welleck 2025, Eq. 2): 1[correct]·clip(α·(n_target - n_used) + δ,
  0, 1), a soft budget: responses under the target are not penalised beyond the clip."""
  _non_negative_int("length.num_tokens", num_tokens)
  _non_negative_int("length.target_tokens", target_tokens)
  if alpha < 0:
    raise ConfigError(f"length.alpha={alpha} must be >= 0")
  if not correct:
    return 0.0
  return min(1.0, max(0.0, alpha * (target_tokens - num_tokens) + delta))
