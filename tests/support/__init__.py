"""Helpers several test files share, one module per theme; a helper one file uses stays there.

  runs        launch/train.py runs of the debug config: train, read back, interrupt, resume
  configs     the debug config with overrides, demo config files, the planner's tiny model
  steps       the fused train step on a tiny model and its references rolled from public pieces
  packing     a ragged batch for the packed layout
  sampler     a tiny model with logits far from ties, prompts, plain decoding references
  parity      full-forward and prefill + decode logits on a left-padded batch
  generation  launch/generate.py as users run it, word tokenizers, a tiny HF reward model
  cloud       fakes of the cloud tools and the GCS emulator's fixtures
  loop        pieces of the RL loop without a model: batches, scripted stages, written runs
  multihost   several processes on one machine, and the check they train as one

Fixtures live here too (a test file imports the ones it uses; `# noqa: F401` there). Modules a
subprocess or a benchmark imports by path stay beside the tests (tests/multihost_runs.py,
tests/storage_relay.py, tests/kill_point.py, the fakes): they must import without pytest.
"""
