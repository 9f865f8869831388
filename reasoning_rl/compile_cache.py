"""JAX's persistent compilation cache for the launchers, one directory per machine.

A launcher process compiles its programs (the training step, the engine's prefill / insert /
generate variants) from scratch every time it starts: seconds each on a CPU (SmolLM2's decode
step ~4 s, `launch/generate.py` 18 s in all), minutes for a large model on a TPU host, paid again
on every resume after a preemption. JAX can keep compiled executables on disk and load them in
the next process instead (`jax_compilation_cache_dir`). The launchers turn that on by default:

- Where: `$REASONING_RL_COMPILATION_CACHE` if it names a local directory, else
  `$XDG_CACHE_HOME/reasoning_rl/jax` (`~/.cache/...`); `off` (or `0`, `false`) turns it off, and a
  `JAX_COMPILATION_CACHE_DIR` the user set is left to JAX as it is.
- One subdirectory per machine kind (`machine_key`): an entry is native code, and XLA:CPU loads an
  entry built for another CPU's instruction set after only logging a warning, so a home directory
  shared by different machines (a cluster, a laptop and a workstation) must not share entries.
- Every program is written, not only those that took a second to compile (JAX's default
  threshold): a run also compiles dozens of small programs (one per parameter shape when the
  model is initialised, the optimizer's helpers, evaluation's), each ~0.1 s on a CPU and a
  fraction of that to load. configs/debug_cpu.py's 2-step run takes 11.6 s with JAX's threshold
  and 8.5 s with every program cached (33 of its 37 programs are the small ones; 61 entries,
  1.1 MB; AVX-512 AMD EPYC, 2026-11-28). `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` overrides.

The cache is trusted code: JAX loads what it finds there. Point it only at directories that no
one else can write to.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings

ENV_VAR = "REASONING_RL_COMPILATION_CACHE"
_OFF = ("off", "0", "false", "no", "disabled")


def machine_key() -> str:
  """`<arch>-<12 hex>`: the architecture and a hash of what decides which native code runs here
  (the CPU model and feature flags on Linux, the processor string elsewhere)."""
  identity = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
      lines = cpuinfo.read().splitlines()
    wanted = ("model name", "flags", "Features", "CPU part", "CPU implementer")
    fields = {}
    for line in lines:
      name, _, value = line.partition(":")
      if name.strip() in wanted:
        fields.setdefault(name.strip(), value.strip())
    if fields:
      identity = repr(sorted(fields.items()))
  except OSError:
    pass
  digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
  return f"{platform.machine() or 'unknown'}-{digest}"


def cache_dir(environ=None) -> str | None:
  """The directory the launchers' cache lives in (module docstring), or None when it is off or
  the user configured JAX's own variable."""
  environ = os.environ if environ is None else environ
  setting = environ.get(ENV_VAR, "").strip()
  if setting.lower() in _OFF or environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None
  if not setting:
    home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    setting = os.path.join(home, "reasoning_rl", "jax")
  return os.path.join(setting, machine_key())


def enable(environ=None) -> str | None:
  """Points JAX's persistent compilation cache at `cache_dir()`; call before the first compile.
  Returns the directory, or None when the cache stays off."""
  environ = os.environ if environ is None else environ
  path = cache_dir(environ)
  if path is None:
    return None
  import jax  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # A cache entry that cannot be read or written (a full disk, a file-size limit) costs one
  # compile and nothing else; JAX warns on stderr, which would join the launcher's one-line error
  # of the failure that matters (the checkpoint's, say, on that same full disk).
  warnings.filterwarnings("ignore", message=r"Error (reading|writing) persistent compilation "
                          r"cache", category=UserWarning)
  return path


__all__ = ["ENV_VAR", "cache_dir", "enable", "machine_key"]
