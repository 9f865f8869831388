"""JetStream interop: real requests through JetStream's own orchestrator (`Driver`) on our engine.

Needs google-jetstream (not a dependency of this project: 0.2.2 pulls TensorFlow through seqio).
Skipped with the reason when `jetstream.core.orchestrator` cannot be imported.

Running it without TensorFlow: the orchestrator only imports seqio's and tiktoken's names, so
  pip install --no-deps --target /tmp/jsdeps google-jetstream==0.2.2 grpcio prometheus_client \
      shortuuid
plus two empty stand-in packages in /tmp/jsdeps (seqio/vocabularies.py defining classes
`Vocabulary` and `SentencePieceVocabulary`; tiktoken/load/__init__.py defining
`load_tiktoken_bpe`), then
  PYTHONPATH=/tmp/jsdeps python -m pytest -m interop tests/test_sampler_interop.py
"""

import asyncio
import logging

import jax
import pytest

from reasoning_rl.sampler import Engine, SamplingParams, generate_groups
from tests.test_sampler_engine import tiny_model

_root_logger = logging.getLogger()
_root_handlers, _root_level = list(_root_logger.handlers), _root_logger.level
orchestrator = pytest.importorskip(
    "jetstream.core.orchestrator",
    reason="google-jetstream (and its imports grpc, prometheus_client, shortuuid, seqio) is not "
    "installed; this optional interop test needs it")
from jetstream.core.utils import async_multifuture  # noqa: E402

# Importing the orchestrator sets the root logger to DEBUG with a stdout handler; undo that so the
# rest of the session logs as before.
for _handler in set(_root_logger.handlers) - set(_root_handlers):
  _root_logger.removeHandler(_handler)
_root_logger.setLevel(_root_level)

from reasoning_rl.sampler.jetstream_adapter import jetstream_engine  # noqa: E402

pytestmark = pytest.mark.interop
BOS = 1
MAX_TOKENS = 6
STEPS_PER_CALL = 4


class WordTokenizer:
  """Token i is the word "t{i}"; no BOS/EOS of its own."""

  source = "word-tokenizer"
  bos_id = None
  eos_id = None
  eos_ids = ()
  pad_id = 0

  def encode(self, text, add_special_tokens=True):
    return [int(word[1:]) for word in text.split()]

  def decode(self, ids, skip_special_tokens=False):
    return " ".join(f"t{int(i)}" for i in ids)


async def run_requests(driver, contents):
  requests = []
  for content in contents:
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


def test_driver_serves_requests_through_the_adapter(monkeypatch):
  # JetStream 0.2.2 frees prefixes with jax.tree_map, which JAX has removed; give it the new name.
  monkeypatch.setattr(jax, "tree_map", jax.tree.map, raising=False)
  model = tiny_model(1)
  engine = Engine(model, max_concurrent_decodes=2, max_prefill_length=32, max_decode_length=16,
                  steps_per_call=STEPS_PER_CALL, default_sampling=SamplingParams(temperature=0))
  adapter = jetstream_engine(engine, WordTokenizer(), bos_id=BOS)
  params = adapter.load_params()
  driver = orchestrator.Driver(prefill_engines=[adapter], generate_engines=[adapter],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  token_requests = [[3, 14, 15], [35, 89, 2, 7], [10, 11], [60, 61, 62, 63, 64]]
  try:
    outputs = asyncio.run(asyncio.wait_for(
        run_requests(driver, token_requests + ["t3 t4 t5"]), timeout=300))
  finally:
    driver.stop()
  # The Driver prepends BOS to token requests; the text request is encoded by our tokenizer.
  prompts = [[BOS] + r for r in token_requests] + [[3, 4, 5]]
  reference_engine = Engine(model, max_concurrent_decodes=1, max_prefill_length=32,
                            max_decode_length=16, steps_per_call=STEPS_PER_CALL)
  reference = generate_groups(reference_engine, prompts, sampling=SamplingParams(temperature=0),
                              max_new_tokens=MAX_TOKENS + STEPS_PER_CALL)
  assert len(outputs) == len(prompts) > engine.max_concurrent_decodes
  for (ids, text), expected in zip(outputs, reference):
    assert MAX_TOKENS <= len(ids) <= MAX_TOKENS + STEPS_PER_CALL - 1
    assert ids == expected.completion_ids[:len(ids)]
    assert text == "".join(f"t{i}" for i in ids)  # the Driver joins per-token decodes
  assert engine.num_prefills == len(prompts)
