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
