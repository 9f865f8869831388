"""One exception type per layer, so callers can catch what they can handle.

Every message names the file, tensor or field at fault and says what to do about it.
"""


class ReasoningRLError(Exception):
  """Base class of every error this package raises on purpose."""


class ConfigError(ReasoningRLError, ValueError):
  """A configuration field is missing, of the wrong type, or inconsistent with another."""


class CheckpointError(ReasoningRLError):
  """A checkpoint or model file cannot be read, or does not match the model it is loaded into."""


class VerifierError(ReasoningRLError):
  """A verifier is misconfigured or cannot run safely (e.g. no sandbox available)."""


class SamplingError(ReasoningRLError, ValueError):
  """A sampling request is invalid (empty or over-long prompt, bad temperature / top_p …)."""


class PhaseInterrupted(Exception):
  """A stop request (SIGTERM / SIGINT) ended a long phase — sampling a step's rollouts or an
  evaluation — between two decode calls, so the run can checkpoint within seconds instead of at
  the end of the step. Not a ReasoningRLError: nothing is wrong; the loop saves the last
  completed step and exits with 143 / 130."""
