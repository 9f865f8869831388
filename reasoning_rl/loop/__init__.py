"""The training loop in pieces, each with one owner (the cadence itself is `reasoning_rl.trainer`).

- `state`: the bookkeeping carried between steps and saved in checkpoints (`LoopState`).
- `rollouts`: sampling + scoring → scored groups (`RolloutCollector`).
- `telemetry`: a step's metrics row and rollout records, as pure functions.
- `rl_stage`, `sft_stage`: what one step does in the RL and SFT stages (strategies).
"""
