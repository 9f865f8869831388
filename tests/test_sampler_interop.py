"""JetStream interop: real requests through JetStream's own orchestrator (`Driver`) on our engine.

The expected tokens come from transformers, not from our engine: a tiny random Qwen2 checkpoint is
written with `save_pretrained`, served by our Engine under the Driver (through
reasoning_rl/sampler/jetstream_adapter.py), and every request's tokens must be the greedy
continuation `transformers.generate` makes from the same weights. The Driver's own duties are
checked too: every request answered, more requests than decode slots, its length cut and its stop
tokens.

google-jetstream is not a dependency of this project (0.2.2 pulls TensorFlow through seqio).
`.ci/run` installs it without its heavy dependencies into a side directory with
`.venv/bin/python tests/jetstream_side_install.py`; this module imports JetStream from there (or
from the environment, if installed) and is skipped, with that command in the reason, when neither
has it.
"""

import asyncio
import logging
import math
import sys
import threading
import traceback

import jax
import numpy as np
import pytest
import torch
import transformers

from reasoning_rl.models.checkpoints import load_hf_weights
from reasoning_rl.sampler import Engine
from tests.hf_reference import write_tiny_model
from tests.jetstream_side_install import SETUP_COMMAND, STAND_INS, is_installed, side_dir


def _import_orchestrator():
  """`jetstream.core.orchestrator`, imported so that the rest of the session does not see it.

  The side directory is on sys.path only for the import, and its stand-in packages leave
  sys.modules afterwards (transformers probes for tiktoken, for one). Importing the orchestrator
  sets the root logger to DEBUG with a stdout handler; that is undone too.
  """
  directory = side_dir()
  if not is_installed(directory):
    return pytest.importorskip(
        "jetstream.core.orchestrator",
        reason=f"google-jetstream is not installed and {directory} holds no side install; "
        f"`{SETUP_COMMAND}` makes one (what .ci/run does)")
  root_logger = logging.getLogger()
  root_handlers, root_level = list(root_logger.handlers), root_logger.level
  saved_path = list(sys.path)
  sys.path.append(str(directory))
  try:
    from jetstream.core import orchestrator as imported
  finally:
    sys.path[:] = saved_path
    stand_ins = {path.split("/")[0] for path in STAND_INS}
    for name, module in list(sys.modules.items()):
      from_side_dir = str(getattr(module, "__file__", "")).startswith(str(directory))
      if name.split(".")[0] in stand_ins and from_side_dir:
        del sys.modules[name]
    for handler in set(root_logger.handlers) - set(root_handlers):
      root_logger.removeHandler(handler)
    root_logger.setLevel(root_level)
  return imported


orchestrator = _import_orchestrator()
from jetstream.core.utils import async_multifuture  # noqa: E402

from reasoning_rl.sampler.jetstream_adapter import jetstream_engine  # noqa: E402

pytestmark = pytest.mark.interop
BOS = 1
MAX_TOKENS = 6
STEPS_PER_CALL = 4
# The Driver cuts a request once its reported length exceeds max_tokens, checked before it reads a
# call's STEPS_PER_CALL tokens; the adapter reports one more than the tokens made before the call.
TOKENS_AT_LENGTH_CUT = STEPS_PER_CALL * math.ceil(MAX_TOKENS / STEPS_PER_CALL)
TOKEN_REQUESTS = [[3, 14, 15], [35, 89, 2, 7], [10, 11], [60, 61, 62, 63, 64]]
TEXT_REQUEST = "t3 t4 t5"
# What the model sees: the Driver prepends BOS to token requests; the text request goes through
# the tokenizer below, which adds nothing.
PROMPTS = [[BOS] + r for r in TOKEN_REQUESTS] + [[3, 4, 5]]
# Greedy choices closer than this could flip between two float32 implementations.
MIN_LOGIT_MARGIN = 1e-3


class WordTokenizer:
  """Token i is the word "t{i}"; no BOS of its own; `eos_ids` are the Driver's stop tokens."""

  source = "word-tokenizer"
  bos_id = None
  pad_id = 0

  def __init__(self, eos_ids=()):
    self.eos_ids = tuple(eos_ids)
    self.eos_id = self.eos_ids[0] if self.eos_ids else None

  def encode(self, text, add_special_tokens=True):
    return [int(word[1:]) for word in text.split()]

  def decode(self, ids, skip_special_tokens=False):
    return " ".join(f"t{int(i)}" for i in ids)


def _delete_pytree(tree):
  """JetStream 0.2.2's `orchestrator.delete_pytree` with `jax.tree.map` for the removed
  `jax.tree_map`: frees a prefix's device arrays once it is in a decode slot."""
  jax.tree.map(lambda leaf: leaf.delete() if isinstance(leaf, jax.Array) else None, tree)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(our model, transformers model) with the same tiny random Qwen2 weights."""
  directory = tmp_path_factory.mktemp("qwen2")
  torch_model = write_tiny_model("qwen2", directory, seed=2)
  model, _ = load_hf_weights(directory)
  return model, torch_model


def transformers_greedy(torch_model, prompt, stop_id=None):
  """transformers' greedy continuation of `prompt`, cut as the Driver cuts it.

  At most TOKENS_AT_LENGTH_CUT tokens; with `stop_id`, generation ends at it and it is not returned
  (the Driver does not return stop tokens).
  """
  config = transformers.GenerationConfig(
      do_sample=False, max_new_tokens=TOKENS_AT_LENGTH_CUT, eos_token_id=stop_id, pad_token_id=0,
      output_scores=True, return_dict_in_generate=True)
  with torch.no_grad():
    out = torch_model.generate(torch.tensor([prompt]), generation_config=config)
  top_two = torch.stack(out.scores)[:, 0].topk(2).values
  margins = (top_two[:, 0] - top_two[:, 1]).numpy()
  assert margins.min() > MIN_LOGIT_MARGIN, f"near-tie in the reference for {prompt}: {margins}"
  completion = out.sequences[0, len(prompt):].tolist()
  return completion[:-1] if completion[-1:] == [stop_id] else completion


async def _run_requests(driver):
  requests = []
  for content in TOKEN_REQUESTS + [TEXT_REQUEST]:
    request = orchestrator.ActiveRequest(
        max_tokens=MAX_TOKENS, return_channel=async_multifuture.AsyncMultifuture(),
        prefill_content=content)
    driver.place_request_on_prefill_queue(request)
    requests.append(request)
  outputs = []
  for request in requests:
    ids, text = [], []
    async for samples in request.return_channel:
      ids += samples[0].token_ids
      text += samples[0].text
    outputs.append((ids, "".join(text)))
  return outputs


THREAD_ERRORS = []  # tracebacks of Driver threads that raised


def _run_and_record(thread):
  """JetThread.run without its `os.kill(os.getpid(), SIGKILL)` on an error: the error is kept
  and fails the test that started the thread, instead of killing the whole test session."""
  try:
    threading.Thread.run(thread)
  except Exception:  # pylint: disable=broad-exception-caught
    THREAD_ERRORS.append(f"{thread.name}: {traceback.format_exc()}")


def serve_through_driver(model, tokenizer, monkeypatch):
  """Each request's (token ids, text) from JetStream's Driver on our engine; and the engine."""
  monkeypatch.setattr(orchestrator, "delete_pytree", _delete_pytree)
  # Not undone after the test: a Driver thread must never SIGKILL the session, even late.
  orchestrator.JetThread.run = _run_and_record
  THREAD_ERRORS.clear()
  engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=16,
                  steps_per_call=STEPS_PER_CALL)
  adapter = jetstream_engine(engine, tokenizer, bos_id=BOS)
  params = adapter.load_params()
  driver = orchestrator.Driver(prefill_engines=[adapter], generate_engines=[adapter],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)

  async def serve():
    try:
      return await asyncio.wait_for(_run_requests(driver), timeout=300)
    finally:
      # Stopped while the event loop still runs: the detokenize thread may still post to a
      # request's return channel after the last one closed, and a closed loop makes that raise
      # ("Event loop is closed"; seen under load).
      await asyncio.to_thread(driver.stop)

  outputs = asyncio.run(serve())
  assert not THREAD_ERRORS, "a JetStream Driver thread raised:\n" + "\n".join(THREAD_ERRORS)
  return outputs, engine


def test_driver_returns_transformers_greedy_tokens_cut_at_max_tokens(checkpoint, monkeypatch):
  model, torch_model = checkpoint
  outputs, engine = serve_through_driver(model, WordTokenizer(), monkeypatch)
  assert len(outputs) == len(PROMPTS) > engine.max_concurrent_decodes
  assert engine.num_prefills == len(PROMPTS)  # each request prefilled once, slots reused
  for prompt, (ids, text) in zip(PROMPTS, outputs):
    assert ids == transformers_greedy(torch_model, prompt), prompt
    assert len(ids) == TOKENS_AT_LENGTH_CUT
    assert text == "".join(f"t{i}" for i in ids)  # the Driver joins per-token decodes


def test_driver_stops_requests_at_the_tokenizers_stop_token(checkpoint, monkeypatch):
  model, torch_model = checkpoint
  # A token the first prompt's greedy continuation makes third: requests reaching it stop there.
  stop_id = transformers_greedy(torch_model, PROMPTS[0])[2]
  outputs, _ = serve_through_driver(model, WordTokenizer(eos_ids=[stop_id]), monkeypatch)
  expected = [transformers_greedy(torch_model, prompt, stop_id) for prompt in PROMPTS]
  assert [ids for ids, _ in outputs] == expected
  lengths = np.array([len(ids) for ids in expected])
  assert lengths[0] == 2 and (lengths == TOKENS_AT_LENGTH_CUT).any()  # both endings exercised
