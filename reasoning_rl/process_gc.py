"""Python's garbage collector in a launcher process: rarer collections while it runs, none at exit.

Python's cyclic collector runs a young-generation pass every 700 net allocations and walks every
live object in a full pass once enough young ones survived. Tracing and lowering JAX programs
allocate millions of short-lived objects and keep large caches alive, so a trainer process with
the default thresholds ran ~970 young passes and 7 full ones, 2.2-3.0 s of a debug run, and its
interpreter teardown then walked everything alive once more (1.3-1.8 s) — on an AVX2 AMD
(benchmarks/RESULTS.md, "Start-up and exit of a launcher process"). Paid by every run, and by each
of the training processes the tests start.

- `LAUNCHER_THRESHOLDS` (a young pass every 10,000 allocations, a full one every 100 young passes
  at most) leaves ~60 young passes and no full one in that run: 0.8-1.0 s. Cyclic garbage still
  goes within 10,000 allocations; what reference counting frees (nearly all, device buffers
  included) goes at once, as before.
- At exit, `gc.freeze()` as the last handler moves the surviving objects out of the collector's
  reach. Reference counting still frees what it frees, and Python never promised finalizers for
  objects alive at exit, so the teardown's collection found only memory the OS takes back anyway.
  A run's writes are finished before then: the checkpointer waits for its saves, the metrics and
  rollout files are closed, and `logging` flushes its handlers in its own exit handler.
"""

import atexit
import gc

LAUNCHER_THRESHOLDS = (10_000, 10, 10)


def configure_launcher_gc() -> None:
  """Sets `LAUNCHER_THRESHOLDS` and freezes the objects alive at exit once the other exit handlers
  ran. Call it before importing the libraries: `atexit` runs handlers in reverse order, so this
  one runs after theirs."""
  gc.set_threshold(*LAUNCHER_THRESHOLDS)
  atexit.register(gc.freeze)
