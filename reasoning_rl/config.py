"""Every training-config field, its default and its meaning, plus validation.

Config files in configs/ start from `base_config()` and override what differs; `launch/train.py`
applies `--config.a.b=value` overrides and then `validate(config)` raises one `ConfigError` naming
the first bad field before anything is loaded or compiled.
"""

from __future__ import annotations

import math

import ml_collections

from reasoning_rl.errors import ConfigError

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
GROUP_ESTIMATORS = ESTIMATORS  # all of them compare samples within a group


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = ""  # where metrics.jsonl, tensorboard/, checkpoints/, rollouts/ and model/ go
  c.seed = 0  # root of every random stream (sampling, init, data order)
  c.total_steps = 10  # RL steps (one rollout batch + its updates each)
  # rl | sft (cold-start SFT on `sft.data_path`) | rejection_sft (sample from the model, keep
  # verified-correct traces, fine-tune on them). Checkpoints of every stage load as models, so a
  # stage starts from the previous one with --config.model.path=PREVIOUS_WORKDIR.
  c.stage = "rl"
  c.dry_run = False  # print the memory / throughput plan of the target slice and exit
  # Linux/glibc: keep freed host memory for reuse instead of returning it to the OS, so a CPU
  # step's multi-GB temporaries are not page-faulted (and zeroed) afresh every step; the process
  # then holds its peak host memory until it exits. See reasoning_rl/host_memory.py.
  c.keep_freed_host_memory = True

  # The policy. `path`: an HF directory or .gguf file; empty = a random model built from
  # `random` with the tokenizer named by `tokenizer` ("debug_arithmetic" is a built-in
  # character-level vocabulary for the synthetic debug task).
  c.model = ml_collections.ConfigDict()
  c.model.path = ""
  c.model.tokenizer = ""
  c.model.dtype = "float32"  # parameters and compute: float32 | bfloat16
  c.model.random = ml_collections.ConfigDict(dict(
      model_type="qwen2", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=16, tie_word_embeddings=True, attention_bias=True))

  # Prompts. Each source: kind = synthetic_arithmetic | reasoning_gym | jsonl (+ its settings).
  c.data = ml_collections.ConfigDict()
  c.data.train = ml_collections.ConfigDict(dict(kind="synthetic_arithmetic", seed=0))
  c.data.eval = ml_collections.ConfigDict(dict(kind="synthetic_arithmetic", seed=10_000))
  # template: plain ("{prompt}"), chat (the tokenizer's chat template around `instruction`), or
  # r1zero (DeepSeek-R1-Zero's "A conversation between User and Assistant…" text prompt).
  c.data.template = "plain"
  c.data.instruction = "{prompt}"  # for chat: the user message; {prompt} is the task's question
  c.data.system_prompt = ""

  # Sampling on the sampler slice.
  c.rollout = ml_collections.ConfigDict()
  c.rollout.num_prompts = 4  # P prompts per step
  c.rollout.num_samples = 4  # G completions per prompt (group size)
  c.rollout.max_new_tokens = 12
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.stop_strings = ("</answer>",)
  c.rollout.max_prefill_length = 32
  c.rollout.max_concurrent_decodes = 16  # decode slots
  c.rollout.steps_per_call = 16  # decode steps per host round trip

  # Rewards: a weighted sum of named parts (reasoning_rl.verifiers.rewards).
  c.rewards = ml_collections.ConfigDict({
      "correct": {"weight": 1.0, "verifier": "math", "extract": "answer"},
  })
  c.verifier = ml_collections.ConfigDict()
  c.verifier.num_workers = 2  # verifier worker processes (0 = score in this process)
  c.verifier.item_timeout_s = 10.0
  c.verifier.redteam = True  # probe the rewards with known exploits before training
  c.verifier.allow_exploits = False  # explicit, logged override of a failed red team

  # Advantages and loss (reasoning_rl.rl.*).
  c.algo = ml_collections.ConfigDict()
  c.algo.name = "grpo"  # grpo (any group estimator) | ppo (value head + GAE)
  c.algo.estimator = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp
  c.algo.kl_estimator = "k3"
  c.algo.epsilon_low = 0.2
  c.algo.epsilon_high = 0.2  # > epsilon_low is DAPO's clip-higher
  c.algo.dual_clip = None
  c.algo.loss_agg = "seq-mean-token-mean"
  c.algo.entropy_coef = 0.0
  # μ (GRPO's notation, Shao et al. 2024): passes over each rollout batch against a fixed π_old.
  # With μ·M > 1 the ratio moves off 1 after the first update, so clipping can fire.
  c.algo.num_iterations = 1
  # M: optimizer updates per pass, each on a disjoint 1/M of the batch's rows (PPO mini-batches).
  # The learning-rate schedule advances per optimizer update; warmup_steps / total_steps stay
  # in RL steps (they are scaled by μ·M).
  c.algo.num_mini_batches = 1
  c.algo.num_micro_batches = 1  # gradient accumulation inside each update (memory, not maths)
  c.algo.logprob_chunk = 128
  c.algo.remat = False  # recompute block activations in the backward pass (long sequences)
  # ppo: PPO's clipped token ratio (Schulman et al. 2017) | gspo / gspo-token: GSPO's
  # length-normalised sequence ratio (Zheng et al. 2025, arXiv:2507.18071) | cispo: clipped,
  # stop-gradient IS weight on a REINFORCE term (MiniMax-M1, arXiv:2506.13585). See rl/losses.py.
  c.algo.loss_type = "ppo"
  # Correction for the sampler's log-probs differing from the trainer's recomputation (kernels,
  # precision, staleness): none | token-truncate | token-mask | sequence-truncate | sequence-mask
  # with threshold C = is_threshold (Yao et al. 2025, TIS; IMPALA's truncation, Espeholt et al.
  # 2018). Asynchronous rollouts always correct: "none" then means token-truncate.
  c.algo.is_correction = "none"
  c.algo.is_threshold = 2.0
  # algo.name = ppo only (Schulman et al. 2017; GAE, Schulman et al. 2016): value-loss weight,
  # value clip ε_v, discount γ and GAE λ.
  c.algo.vf_coef = 0.5
  c.algo.value_clip = 0.2
  c.algo.gamma = 1.0
  c.algo.gae_lambda = 0.95
  c.beta = 0.0  # KL weight; 0 never loads the reference model

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 0
  c.optim.final_lr_fraction = 0.1
  c.optim.weight_decay = 0.0
  c.optim.max_grad_norm = 1.0
  # AdamW moments (Loshchilov & Hutter 2019; Kingma & Ba 2015's defaults).
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8

  # DAPO dynamic sampling: sample extra prompts, drop groups whose rewards are all equal, refill.
  c.dynamic_sampling = ml_collections.ConfigDict()
  c.dynamic_sampling.enabled = False
  c.dynamic_sampling.max_rounds = 3  # sampling rounds per step before training on what is there

  # SFT stages (DeepSeek-AI 2025, §2.3): loss on completion tokens only.
  c.sft = ml_collections.ConfigDict()
  c.sft.data_path = ""  # JSONL rows {"prompt"|"question": …, "completion"|"response": …}
  c.sft.batch_size = 16  # rows per step; the data is walked in a seeded order, epoch by epoch
  c.rejection = ml_collections.ConfigDict()
  c.rejection.num_prompts = 64  # training prompts sampled from (data.train)
  c.rejection.num_samples = 8
  c.rejection.temperature = 1.0
  c.rejection.keep = "shortest"  # shortest correct trace per prompt | all (distinct) correct ones

  # Asynchronous rollouts: batch s is sampled with policy version s - max_staleness.
  c.async_rollouts = ml_collections.ConfigDict()
  c.async_rollouts.enabled = False
  c.async_rollouts.max_staleness = 1

  # Devices: one list split into trainer and sampler slices, each its own (data, fsdp, tensor) mesh.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.num_trainer_devices = 0  # 0 = all devices shared by both roles (single-device demos)
  c.mesh.trainer = (1, -1, 1)
  c.mesh.sampler = (1, 1, -1)

  # The slice the dry run plans for: tpu = v4 | v5e | v5p | v6e | cpu; 0 devices = this machine's.
  c.target = ml_collections.ConfigDict(dict(tpu="cpu", num_devices=0))

  # A rerun on a workdir resumes it; fields that differ from the run's first start
  # (WORKDIR/run_config.json) are refused unless named here, e.g. ("total_steps",) — the
  # learning-rate schedule then stretches to the new total from the resumed step on — or
  # ("eval.*",). Display and storage fields (logging.*, checkpoint cadence, verifier.num_workers)
  # may always change.
  c.resume = ml_collections.ConfigDict()
  c.resume.allow_changes = ()

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 5
  c.checkpoint.keep = 2
  c.checkpoint.async_save = True

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 0  # 0 = only before and after training
  c.eval.num_examples = 16
  c.eval.max_new_tokens = 0  # 0 = rollout.max_new_tokens
  c.eval.num_samples = 1  # > 1 adds pass@k and maj@k (Chen et al. 2021)
  c.eval.temperature = 0.0  # 0 = greedy pass@1
  c.eval.canaries = ()  # prompts whose completions are logged verbatim at every evaluation
  # Rewordings of `data.instruction` (each with "{prompt}"): the held-out set is evaluated once
  # more under each, so a gain that holds only for the training phrasing shows. Results go under
  # "variants" in eval/step_*.json; guards and the progress line read the main accuracy.
  c.eval.instruction_variants = ()

  c.logging = ml_collections.ConfigDict()
  c.logging.rollouts_every_steps = 1
  c.logging.tensorboard = True
  c.logging.progress_bar = True
  # Peak FLOP/s of one device, the denominator of throughput/rl_mfu (this CPU: ~4e11 f32).
  c.logging.peak_flops_per_device = 4e11

  c.guards = ml_collections.ConfigDict()
  c.guards.max_kl = math.inf  # stop when the mean KL to the reference exceeds this
  c.guards.min_entropy = 0.0  # stop when the mean token entropy falls below this
  # Shares of a step's groups the scorer could not score (zero rewards): stop a run training on
  # fake zeros. Errors are verifier bugs (low bar); timeouts may be a slow machine. 1.0 = off.
  c.guards.max_verifier_timeout_rate = 0.5
  c.guards.max_verifier_error_rate = 0.1
  c.guards.max_skipped_updates = 10  # consecutive non-finite updates before stopping
  # Held-out accuracy fell at each of the last K evaluations while train reward rose (0 = off).
  c.guards.heldout_drop_evals = 0
  # Mean held-out length grew (relatively) this much more than accuracy over the last
  # `length_growth_evals` evaluations (inf = off). See reasoning_rl/guards.py.
  c.guards.max_length_growth = math.inf
  c.guards.length_growth_evals = 2
  return c


def _field(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> None:
  """Raises ConfigError naming the first inconsistent field."""

  def require(condition: bool, field: str, message: str):
    if not condition:
      raise ConfigError(f"config.{field}={_field(config, field)!r}: {message}")

  require(bool(config.workdir), "workdir", "set --config.workdir=DIR (metrics, checkpoints, "
          "rollouts go there)")
  require(isinstance(config.seed, int), "seed", "must be an integer")
  require(isinstance(config.keep_freed_host_memory, bool), "keep_freed_host_memory",
          "must be True or False")
  require(isinstance(config.total_steps, int) and config.total_steps >= 1, "total_steps",
          "must be an integer >= 1")
  require(config.stage in ("rl", "sft", "rejection_sft"), "stage",
          "must be rl, sft or rejection_sft")
  if config.stage == "sft":
    require(bool(config.sft.data_path), "sft.data_path", "the sft stage needs a JSONL file of "
            "{prompt, completion} rows")
  if config.stage != "rl":
    require(config.sft.batch_size % config.algo.num_micro_batches == 0, "sft.batch_size",
            "must be divisible by algo.num_micro_batches")
  if config.stage != "rl":
    require(config.beta == 0, "beta", "SFT stages have no KL term; set beta=0")
  if config.stage == "rejection_sft":
    require(config.rejection.keep in ("shortest", "all"), "rejection.keep",
            "must be shortest or all")
    require("correct" in config.rewards, "rewards", "rejection sampling keeps verified-correct "
            "traces: configure a 'correct' reward part")
  require(bool(config.model.path) or bool(config.model.tokenizer), "model.path",
          "give a model path (HF dir or .gguf) or model.tokenizer for a random model")
  require(config.model.dtype in ("float32", "bfloat16"), "model.dtype",
          "must be float32 or bfloat16")
  require(config.data.template in ("plain", "chat", "r1zero"), "data.template",
          "must be plain, chat or r1zero")
  r = config.rollout
  for name in ("num_prompts", "num_samples", "max_new_tokens", "max_prefill_length",
               "max_concurrent_decodes", "steps_per_call"):
    require(isinstance(r[name], int) and r[name] >= 1, f"rollout.{name}", "must be an integer >= 1")
  require(config.algo.name in ("grpo", "ppo"), "algo.name", "must be grpo or ppo")
  require(config.algo.estimator in ESTIMATORS, "algo.estimator", f"must be one of {ESTIMATORS}")
  from reasoning_rl.rl.losses import (  # pylint: disable=import-outside-toplevel
      IS_CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS, LOSS_TYPES)

  require(config.algo.loss_type in LOSS_TYPES, "algo.loss_type", f"must be one of {LOSS_TYPES}")
  require(config.algo.loss_agg in LOSS_AGGREGATIONS, "algo.loss_agg",
          f"must be one of {LOSS_AGGREGATIONS}")
  require(config.algo.kl_estimator in KL_ESTIMATORS, "algo.kl_estimator",
          f"must be one of {KL_ESTIMATORS}")
  require(config.algo.is_correction in IS_CORRECTIONS, "algo.is_correction",
          f"must be one of {IS_CORRECTIONS}")
  require(config.algo.is_threshold > 0, "algo.is_threshold", "must be > 0")
  if config.algo.name == "grpo" and config.stage == "rl":
    require(r.num_samples >= 2, "rollout.num_samples",
            f"group estimator {config.algo.estimator!r} compares samples of one prompt: "
            "needs at least 2")
  batch = r.num_prompts * r.num_samples
  for name in ("num_iterations", "num_mini_batches", "num_micro_batches"):
    require(isinstance(config.algo[name], int) and config.algo[name] >= 1, f"algo.{name}",
            "must be an integer >= 1")
  mini, micro = config.algo.num_mini_batches, config.algo.num_micro_batches
  require(config.stage != "rl" or batch % (mini * micro) == 0,
          "algo.num_micro_batches" if mini == 1 else "algo.num_mini_batches",
          f"num_mini_batches x num_micro_batches = {mini} x {micro} must divide the batch of "
          f"num_prompts x num_samples = {batch} completions")
  require(r.temperature >= 0, "rollout.temperature", "must be >= 0 (0 = greedy)")
  require(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
  require(config.beta >= 0, "beta", "must be >= 0")
  require(config.dynamic_sampling.max_rounds >= 1, "dynamic_sampling.max_rounds", "must be >= 1")
  require(config.async_rollouts.max_staleness >= 0, "async_rollouts.max_staleness",
          "must be >= 0")
  require(config.checkpoint.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
  require(config.beta > 0 or math.isinf(config.guards.max_kl), "guards.max_kl",
          "the KL guard measures KL to the reference, which exists only with beta > 0; set "
          "--config.beta or leave max_kl at inf")
  require(config.eval.num_samples >= 1, "eval.num_samples", "must be >= 1")
  for variant in config.eval.instruction_variants:
    require(isinstance(variant, str) and "{prompt}" in variant, "eval.instruction_variants",
            "every variant is an instruction text containing {prompt}")
  if num_devices is not None:
    _validate_mesh(config, num_devices)


def _validate_mesh(config, num_devices: int) -> None:
  from reasoning_rl import sharding  # imports jax; validation of the rest of the config does not

  counts = sharding.slice_device_counts(config.mesh.num_trainer_devices, num_devices,
                                        field="config.mesh.num_trainer_devices")
  for name, count in zip(("trainer", "sampler"), counts):
    sharding.resolve_mesh_shape(tuple(config.mesh[name]), count, field=f"config.mesh.{name}")


def check_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
  """Checks `--config.a.b=value` overrides before flag parsing, for one clear error each.

  An unknown field or a value that does not parse as the field's type raises ConfigError naming
  the field (ml_collections would otherwise fail deep inside flag parsing).
  """
  for dotted, text in overrides.items():
    node = config
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        parent = ".".join(["config"] + parts[:depth])
        known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        raise ConfigError(f"config.{dotted}: unknown field; {parent} has {known}")
      node = node[part]
    expected = type(node)
    try:
      if expected is bool:
        if text.lower() not in ("true", "false", "1", "0"):
          raise ValueError(text)
      elif expected in (int, float):
        expected(text)
    except ValueError:
      raise ConfigError(f"config.{dotted}={text!r}: expected {expected.__name__}") from None
