"""Seconds this process has spent compiling JAX programs: the source of `time/compile_s`.

A jitted function compiles once per new input signature: the training step once per run, the
sampler's `generate` once per (attended length, decoded rows) pair the first time a rollout meets
it (`reasoning_rl.sampler.engine`). Those seconds land inside whichever phase met the new
signature, so a step that compiled looks slower than the steady state it is not; the metrics row
says how much of the step was compiling.

jax.monitoring reports every program's lowering to an MLIR module and its XLA compilation as
duration events; a listener, registered once per process the first time `seconds()` is called,
adds them up from every thread. Tracing (Python running the function) is left out: the trace of
a jitted function nested in another reports its own duration inside its caller's, so summing
those events would count time twice.
"""

from __future__ import annotations

import threading

import jax

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")

_lock = threading.Lock()
_seconds = 0.0
_listening = False


def _on_duration(event: str, duration_secs: float, **unused) -> None:
  global _seconds
  if event in COMPILE_EVENTS:
    with _lock:
      _seconds += duration_secs


def seconds() -> float:
  """Seconds spent lowering and compiling JAX programs since the first call (process-wide)."""
  global _listening
  with _lock:
    if not _listening:
      jax.monitoring.register_event_duration_secs_listener(_on_duration)
      _listening = True
    return _seconds
