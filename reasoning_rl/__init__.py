"""reasoning_rl: JAX-native RL from verifiable rewards for reasoning language models."""

__version__ = "0.1.0"
