"""What a policy-loss type returns (`PolicyTerm`), and the stop-gradient every loss module uses on
numpy and jax arrays alike. Its own module so that the loss types defined outside
`reasoning_rl.rl.losses` (`reasoning_rl.rl.off_policy`'s DPPO) need not import the loss."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def stop_gradient(xp: Any, x: Any) -> Any:
  """`jax.lax.stop_gradient` for jax arrays; numpy arrays carry no gradient."""
  return jax.lax.stop_gradient(x) if xp is jnp else x


@dataclasses.dataclass(frozen=True)
class PolicyTerm:
  """A loss type's per-token policy-gradient term ``pg`` [B, T] and where its bounds bind
  (``flags``: ``clip_frac/low``, ``clip_frac/high``, optionally ``clip_frac/dual``, [B, T]
  booleans). ``per_sequence``: the flags are a sequence's (one ratio per sequence), and clip
  fractions count sequences. ``sequence_ratio``: ``pg`` of every token depends on the ratio of
  the whole sequence (GSPO), so a token whose ratio is 0 zeroes its whole sequence.
  ``metrics``: the type's own stats."""

  pg: Any
  flags: dict
  per_sequence: bool = False
  metrics: dict = dataclasses.field(default_factory=dict)
  sequence_ratio: bool = False
