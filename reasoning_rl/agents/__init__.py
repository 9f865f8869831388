"""Train any agent program: an OpenAI-compatible rollout server over the sampler's engine
(`server`), sessions that record each episode's exact tokens (`sessions`), and the collector that
runs a user's `async def run(client, example)` as the rollouts of a training step (`collector`).
docs/agents.md describes them."""
