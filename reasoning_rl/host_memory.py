"""Keep freed host memory in the process, so a CPU training step does not page-fault every step.

Why: on the CPU backend a compiled training step allocates gigabytes of temporaries (activations,
their gradients, attention scores) and frees them when it returns. glibc's malloc serves
allocations that large — and every allocation made from XLA's worker threads, whose per-thread
arenas cannot grow past 64 MiB — with a fresh `mmap`, and `munmap`s them on free. The next step
then touches brand-new pages, and the kernel zeroes each one on first touch: measured here
(`perf`), `clear_page_erms` was ~21 % of all CPU time and a SmolLM2-135M GRPO step took 21 s
instead of 14 s (benchmarks/RESULTS.md, 2026-11-23).

`keep_freed_memory()` tells glibc (through `mallopt`, documented in mallopt(3)) to serve every
thread from the main heap (`M_ARENA_MAX` = 1), never to use `mmap` for a large block
(`M_MMAP_MAX` = 0) and never to give the top of the heap back to the OS (`M_TRIM_THRESHOLD` =
SIZE_MAX). Freed blocks are then reused by the next step, already faulted in. The cost: the
process keeps its peak host memory until it exits, which a training job reaches every step anyway.

It must run before JAX starts its backend (before the first array, device query or jit call):
threads that have already picked an arena keep it. `launch/train.py` calls it first thing when
`config.keep_freed_host_memory` is set. Elsewhere than Linux with glibc (macOS, musl) it does
nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's <malloc.h>
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER = -1  # mallopt takes an int; glibc stores it as size_t, so −1 is SIZE_MAX

_applied = False


def runs_on_glibc() -> bool:
  """True on Linux with glibc, the only C library whose `mallopt` this module knows."""
  return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def wanted(config) -> bool:
  """Whether a run keeps freed memory: `config.keep_freed_host_memory`, or where it is None (the
  default) every run but an agent run (`config.agent.entry`). An agent run's sampler meets new
  prompt lengths — whole conversations — for as long as it runs and compiles a prefill program
  for each new (length bucket, row count); every compile leaves long-lived blocks between the
  step's freed temporaries, so a heap that is never trimmed grows with them. Measured on the
  SmolLM2 calculator agent (benchmarks/RESULTS.md, 2026-11-29): kept, 10.0 GB resident at step 8
  and 14.7 GB at step 29 (OOM-killed on a 24 GB machine); not kept, 6.5 GB at step 8 and flat,
  for training steps ~5 % slower."""
  if config.keep_freed_host_memory is not None:
    return bool(config.keep_freed_host_memory)
  return not config.agent.entry


def keep_freed_memory() -> bool:
  """Makes glibc keep and reuse freed memory; True if it now does, False where it cannot."""
  global _applied
  if _applied:
    return True
  if not runs_on_glibc():
    logging.getLogger(__name__).info(
        "keep_freed_memory: not Linux with glibc (%s %s); the allocator is left as it is",
        platform.system(), platform.libc_ver()[0] or "unknown libc")
    return False
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER))
  # mallopt returns 1 on success and 0 for a parameter or value it rejects.
  _applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
  return _applied
