"""reasoning_rl: JAX-native RL from verifiable rewards for reasoning language models."""

from reasoning_rl.cpu_threads import reserve_collective_threads as _reserve_collective_threads

__version__ = "0.1.0"

# Before any entry point creates JAX's CPU client: a simulated multi-device CPU mesh needs more
# threads than XLA gives it for its collectives not to deadlock (reasoning_rl/cpu_threads.py).
_reserve_collective_threads()
