"""One exception type per layer, so callers can catch what they can handle.

Every message names the file, tensor or field at fault and says what to do about it.
The exit codes of the launchers live here too (`ExitCode`): the one list a scheduler, a recipe or
a test reads them from.
"""

import enum
import signal


class ExitCode(enum.IntEnum):
  """How `launch/train.py` (and the other launchers) end. After INTERRUPTED / PREEMPTED a
  checkpoint is complete; a rerun on the workdir resumes. 128 + the signal is what a shell reports
  for a process that signal terminated; schedulers that requeue preempted jobs treat 143 as
  "killed, restart me", unlike 0."""

  DONE = 0  # total_steps reached, or nothing left to do
  BAD_INPUT = 2  # a config field or an input file is wrong: one line names it (ReasoningRLError)
  GUARD = 3  # a guard stopped the run: WORKDIR/STOPPED.md says which and why
  STORAGE = 4  # a checkpoint, metrics or log file could not be read or written
  LOST_PEER = 5  # another process of a multi-process run was lost
  # launch/gcp/supervise.py: the trainer crashed again at the step of its previous crash, so a
  # restart would repeat it; the launchers stop instead of retrying (docs/cloud_tpu.md)
  CRASH_REPEATED = 6
  INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C, after saving a checkpoint
  PREEMPTED = 128 + signal.SIGTERM  # 143: SIGTERM, after saving a checkpoint


class ReasoningRLError(Exception):
  """Base class of every error this package raises on purpose."""


class ConfigError(ReasoningRLError, ValueError):
  """A configuration field is missing, of the wrong type, or inconsistent with another."""


class CheckpointError(ReasoningRLError):
  """A checkpoint or model file cannot be read, or does not match the model it is loaded into."""


class StorageTimeout(CheckpointError):
  """Storage did not answer within its deadline (`storage.timeout_s`, retries included): the
  message names what was waiting, where, and the checkpoint a rerun resumes from (exit 4).
  Not an OSError on purpose: code that treats an OSError as "missing" or "not writable" must
  not mistake a store that stopped answering for either."""


class VerifierError(ReasoningRLError):
  """A verifier is misconfigured or cannot run safely (e.g. no sandbox available)."""


class SamplingError(ReasoningRLError, ValueError):
  """A sampling request is invalid (empty or over-long prompt, bad temperature / top_p …)."""


class PhaseInterrupted(Exception):
  """A stop request (SIGTERM / SIGINT) ended a long phase — sampling a step's rollouts or an
  evaluation — between two decode calls, so the run can checkpoint within seconds instead of at
  the end of the step. Not a ReasoningRLError: nothing is wrong; the loop saves the last
  completed step and exits with 143 / 130."""
