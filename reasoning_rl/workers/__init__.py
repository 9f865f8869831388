"""Process machinery: the Scorer interface over inline scoring or a verifier pool.

It builds on `reasoning_rl.verifiers` (what is scored, and the request loop and deadline helpers
of a verifier process), which imports nothing of this package.
"""
