"""Agent programs shipped as examples of `config.agent.entry` (docs/agents.md)."""
