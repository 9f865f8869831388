"""A launcher's exit without the interpreter's last garbage collection.

When a launcher returns, Python runs the `atexit` handlers, then tears the interpreter down: it
clears every module and runs a full cyclic garbage collection over all that is still alive — in a
trainer process, JAX's tracing and lowering caches, MLIR contexts, the model's Python objects. That
collection took 1.3-1.8 s of a 21 s debug run on an AVX2 AMD (benchmarks/RESULTS.md, "Start-up
and exit of a launcher process"), paid by every run and by every training process the tests start.

`gc.freeze()` as the last handler moves the surviving objects out of the collector's reach.
Reference counting still frees what it frees, and Python never promised finalizers for objects
alive at exit, so the collection found only memory the OS takes back anyway. A run's writes are
finished before then: the checkpointer waits for its saves, the metrics and rollout files are
closed, and `logging` flushes its handlers in its own exit handler.
"""

import atexit
import gc


def skip_final_collection() -> None:
  """Freezes the objects alive at exit once the other exit handlers ran. Call it before importing
  the libraries: `atexit` runs handlers in reverse order, so this one runs after theirs."""
  atexit.register(gc.freeze)
