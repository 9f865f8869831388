"""Every training-config field, its default and its meaning, plus validation.

Config files in configs/ start from `base_config()` and override what differs; `launch/train.py`
applies `--config.a.b=value` overrides and then `validate(config)` raises one `ConfigError` naming
the first bad field before anything is loaded or compiled.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from reasoning_rl.errors import ConfigError, ExitCode


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
  # dtype: the compute dtype (activations, matmuls; the sampler's weights and KV cache):
  # float32 | bfloat16. weight_dtype: the trainer's master weights and AdamW moments (mixed
  # precision, reasoning_rl/precision.py): float32 keeps every update; bfloat16 ("pure bf16")
  # halves that memory but rounds small updates away (a warning says how many); it needs
  # dtype=bfloat16 too. Gradients are summed over micro-batches in float32 either way. With LoRA
  # the frozen base is held in dtype and the adapters in float32.
  c.model.dtype = "float32"
  c.model.weight_dtype = "float32"
  # Training attention (reasoning_rl/kernels): auto | reference | splash | pallas_gpu. auto takes
  # the flash kernel of the backend (splash on TPU, Pallas/Triton on GPU) and the XLA reference
  # on CPU; a kernel named off its backend runs in Pallas interpret mode (exact, slow).
  c.model.attention_kernel = "auto"
  # The block stack as one scanned module (parameters and KV cache stacked on a leading layers
  # axis, run by jax.lax.scan): the step and the sampler compile one block whatever the depth
  # (benchmarks/RESULTS.md, "Scanned layers"). Same numbers; HF / GGUF / PEFT files and LoRA
  # target names are unchanged; a run's checkpoints hold its own layout (a resume keeps it).
  c.model.scan_layers = False
  c.model.random = ml_collections.ConfigDict(dict(
      model_type="qwen2", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=16, tie_word_embeddings=True, attention_bias=True))

  # LoRA / QLoRA (reasoning_rl/lora.py): rank 0 = full fine-tuning. The adapters scale by
  # alpha / rank; target_modules is a regex (full match) over module paths layers/<i>/attn and
  # layers/<i>/mlp; base_quantization "" | int8 | nf4 quantizes the frozen base (QLoRA), NF4 in
  # blocks of quantization_tile along the contracting axis (0 = per channel); the sampler gets
  # the adapters after each step, or ("merged") the weights with the adapters folded in.
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0
  c.lora.alpha = 16.0
  c.lora.target_modules = r"layers/\d+/(attn|mlp)"
  c.lora.base_quantization = ""
  c.lora.quantization_tile = 64
  c.lora.sampler_weights = "adapters"

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
  c.rollout.min_p = 0.0  # keep p >= min_p * p_max after temperature (Nguyen et al. 2024); 0 = off
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
  # What the backward pass recomputes, by name: "" = as algo.remat says (True = full); none |
  # full (each block from its input) | save_matmuls (the projections' outputs are kept; attention
  # scores, norms and activations recomputed). Overrides algo.remat when set.
  c.algo.remat_policy = ""
  # Padding-free training (rl/packing.py): sequences packed into rows with segment ids; a
  # micro-batch is a padded micro-batch's positions and those a batch's tokens do not reach are
  # skipped; the vocabulary head runs only at completion tokens. Same loss and gradients.
  c.algo.packing = False
  # k: packed rows are k × (max_prefill_length + max_new_tokens) long (R / k per micro-batch):
  # long sequences waste less of a row, attention costs k times more per token.
  c.algo.packed_row_factor = 1
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
  # The ratio of the distribution the sampler draws from (docs/off_policy.md): π_θ and π_old are
  # both the model's distribution after the rollout's temperature / top_k / top_p / min_p,
  # renormalised — an exact importance ratio for the policy actually sampled. False: the
  # full-softmax ratio, exact only when rollouts sample the model as is (temperature 1, no
  # filter), biased otherwise (measured: docs/off_policy.md). Not with algo.packing when the
  # rollout truncates or rescales; the step applies it only when the rollout does (otherwise the
  # two ratios are the same).
  c.algo.truncated_ratio = True
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

  # Asynchronous rollouts: batch s is sampled with policy version s - max_staleness, while step
  # s - 1 trains. enabled: None = automatic: on when trainer and sampler are different devices
  # (mesh.num_trainer_devices > 0: otherwise one of them idles while the other works), off when
  # they share them (nothing to overlap); True / False force it. Lagging batches are corrected by
  # truncated importance sampling against the sampler's log-probs (algo.is_correction).
  c.async_rollouts = ml_collections.ConfigDict()
  c.async_rollouts.enabled = ml_collections.config_dict.placeholder(bool)
  c.async_rollouts.max_staleness = 1

  # Devices: one list split into trainer and sampler slices, each its own (data, fsdp, tensor) mesh.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.num_trainer_devices = 0  # 0 = all devices shared by both roles (single-device demos)
  c.mesh.trainer = (1, -1, 1)
  c.mesh.sampler = (1, 1, -1)
  # Slices (TPU Multislice, joined over the data-center network): 0 = as the devices say (a
  # multi-slice TPU run's slice_index; one slice elsewhere); N > 1 on devices without slices
  # simulates N (equal groups of processes, or of one process's devices). On several slices
  # `mesh.trainer` is one slice's mesh and the slices the trainer spans multiply its data axis.
  c.mesh.num_slices = 0

  # The slice the dry run plans for: tpu = v4 | v5e | v5p | v6e | v7x | cpu; num_devices = JAX
  # devices of one slice, one per chip (v7x: two) (0 = this machine's devices); num_slices:
  # that many such slices joined over the data-center network (TPU Multislice;
  # launch/gcp/commands.py --num_slices).
  c.target = ml_collections.ConfigDict(dict(tpu="cpu", num_devices=0, num_slices=1))

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


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a numeric field accepts: an integer or a real number between optional bounds
  (`low` / `high`, inclusive unless `*_open`). Reals must be finite unless `infinite_ok` (an
  unbounded setting, e.g. a guard that is off); `none_ok` accepts None (a feature that is off)."""

  kind: type = float
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  infinite_ok: bool = False
  none_ok: bool = False
  meaning: str = ""  # what a special value means, appended to the error ("0 = off")

  def problem(self, value) -> str | None:
    """Why `value` is refused, or None."""
    if value is None and self.none_ok:
      return None
    kinds = (int,) if self.kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
        isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and
                                                            not self.infinite_ok))):
      return f"must be {self.describe()}"
    if ((self.low is not None and (value <= self.low if self.low_open else value < self.low)) or
        (self.high is not None and (value >= self.high if self.high_open else value > self.high))):
      return f"must be {self.describe()}"
    return None

  def describe(self) -> str:
    noun = "an integer" if self.kind is int else "a number"
    if self.low is not None and self.high is not None:
      bounds = (f" in {'(' if self.low_open else '['}{self.low:g}, "
                f"{self.high:g}{')' if self.high_open else ']'}")
    elif self.low is not None:
      bounds = f" {'>' if self.low_open else '>='} {self.low:g}"
    elif self.high is not None:
      bounds = f" {'<' if self.high_open else '<='} {self.high:g}"
    else:
      bounds = ""
    extras = [text for text in ("inf allowed" if self.infinite_ok else "",
                                "or None" if self.none_ok else "", self.meaning) if text]
    return noun + bounds + (f" ({'; '.join(extras)})" if extras else "")


def _int(low=None, high=None, meaning=""):
  return Range(int, low, high, meaning=meaning)


_POSITIVE = Range(float, 0, low_open=True)
_NON_NEGATIVE = Range(float, 0)
_FRACTION = Range(float, 0, 1)

# The range of every numeric field of `base_config()`, section by section in its order; `validate`
# checks them all, and a test fails if a numeric field is added without an entry here. Task
# settings (data.*) and reward parts (rewards.*) are checked where they are built.
FIELD_RANGES: dict[str, Range] = {
    "seed": _int(0),
    "total_steps": _int(1),
    **{f"model.random.{name}": _int(1) for name in (
        "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
        "head_dim")},
    "lora.rank": _int(0, meaning="0 = full fine-tuning"),
    "lora.alpha": _POSITIVE,
    "lora.quantization_tile": _int(0, meaning="0 = one scale per channel"),
    **{f"rollout.{name}": _int(1) for name in (
        "num_prompts", "num_samples", "max_new_tokens", "max_prefill_length",
        "max_concurrent_decodes", "steps_per_call")},
    "rollout.temperature": Range(float, 0, meaning="0 = greedy"),
    "rollout.top_p": Range(float, 0, 1, low_open=True),
    "rollout.top_k": _int(0, meaning="0 = off"),
    "rollout.min_p": _FRACTION,
    "verifier.num_workers": _int(0, meaning="0 = score in this process"),
    "verifier.item_timeout_s": _POSITIVE,
    "algo.epsilon_low": _FRACTION,  # the ratio's floor 1 - epsilon_low stays >= 0
    "algo.epsilon_high": _NON_NEGATIVE,
    "algo.dual_clip": Range(float, 1, low_open=True, none_ok=True, meaning="None = off"),
    "algo.entropy_coef": Range(float),
    "algo.num_iterations": _int(1),
    "algo.num_mini_batches": _int(1),
    "algo.num_micro_batches": _int(1),
    "algo.packed_row_factor": _int(1),
    "algo.logprob_chunk": _int(1),
    "algo.is_threshold": _POSITIVE,
    "algo.vf_coef": _NON_NEGATIVE,
    "algo.value_clip": _POSITIVE,
    "algo.gamma": _FRACTION,
    "algo.gae_lambda": _FRACTION,
    "beta": Range(float, 0, meaning="0 = no KL term"),
    "optim.learning_rate": _NON_NEGATIVE,
    "optim.warmup_steps": _int(0),
    "optim.final_lr_fraction": _FRACTION,
    "optim.weight_decay": _NON_NEGATIVE,
    "optim.max_grad_norm": Range(float, 0, low_open=True, infinite_ok=True),
    "optim.b1": Range(float, 0, 1, high_open=True),
    "optim.b2": Range(float, 0, 1, high_open=True),
    "optim.eps": _POSITIVE,
    "dynamic_sampling.max_rounds": _int(1),
    "sft.batch_size": _int(1),
    "rejection.num_prompts": _int(1),
    "rejection.num_samples": _int(1),
    "rejection.temperature": Range(float, 0, meaning="0 = greedy"),
    "async_rollouts.max_staleness": _int(0),
    "mesh.num_trainer_devices": _int(0, meaning="0 = every device does both"),
    "mesh.num_slices": _int(0, meaning="0 = the devices' own slices"),
    "target.num_devices": _int(0, meaning="0 = this machine's"),
    "target.num_slices": _int(1),
    "checkpoint.every_steps": _int(1),
    "checkpoint.keep": _int(1),
    "eval.every_steps": _int(0, meaning="0 = only before and after training"),
    "eval.num_examples": _int(1),
    "eval.max_new_tokens": _int(0, meaning="0 = rollout.max_new_tokens"),
    "eval.num_samples": _int(1),
    "eval.temperature": Range(float, 0, meaning="0 = greedy"),
    "logging.rollouts_every_steps": _int(0, meaning="0 = never"),
    "logging.peak_flops_per_device": _POSITIVE,
    "guards.max_kl": Range(float, 0, low_open=True, infinite_ok=True, meaning="inf = off"),
    "guards.min_entropy": Range(float, 0, meaning="0 = off"),
    "guards.max_verifier_timeout_rate": Range(float, 0, 1, meaning="1 = off"),
    "guards.max_verifier_error_rate": Range(float, 0, 1, meaning="1 = off"),
    "guards.max_skipped_updates": _int(0, meaning="0 = off"),
    "guards.heldout_drop_evals": _int(0, meaning="0 = off"),
    "guards.max_length_growth": Range(float, 0, low_open=True, infinite_ok=True,
                                      meaning="inf = off"),
    "guards.length_growth_evals": _int(1),
}


def check_range(dotted: str, value) -> None:
  """ConfigError naming `config.<dotted>` when `value` is outside FIELD_RANGES[dotted]."""
  problem = FIELD_RANGES[dotted].problem(value)
  if problem:
    raise ConfigError(f"config.{dotted}={value!r}: {problem}")


def _field(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def rollout_rescales(config: ml_collections.ConfigDict) -> bool:
  """Whether rollouts sample from another distribution than the model's own (temperature other
  than 1, or a top-k / top-p / min-p filter; greedy rows keep the full softmax): only then does
  `algo.truncated_ratio` change the ratio, so only then does the step rebuild the truncation."""
  r = config.rollout
  return r.temperature not in (0, 1.0) or r.top_p < 1.0 or r.top_k > 0 or r.min_p > 0


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None,
             num_slices: int = 1) -> None:
  """Raises ConfigError naming the first inconsistent field."""

  def require(condition: bool, field: str, message: str):
    if not condition:
      raise ConfigError(f"config.{field}={_field(config, field)!r}: {message}")

  require(bool(config.workdir), "workdir", "set --config.workdir=DIR (metrics, checkpoints, "
          "rollouts go there)")
  require(isinstance(config.keep_freed_host_memory, bool), "keep_freed_host_memory",
          "must be True or False")
  for dotted in FIELD_RANGES:
    check_range(dotted, _field(config, dotted))
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
  require(config.model.weight_dtype in ("float32", "bfloat16"), "model.weight_dtype",
          "must be float32 (master weights, the default) or bfloat16")
  require(config.model.weight_dtype == "float32" or config.model.dtype == "bfloat16",
          "model.weight_dtype", "bfloat16 weights with float32 compute lose the updates and gain "
          "no speed; use weight_dtype=float32, or dtype=bfloat16 as well")
  require(config.data.template in ("plain", "chat", "r1zero"), "data.template",
          "must be plain, chat or r1zero")
  from reasoning_rl.kernels import TRAINING_KERNELS  # pylint: disable=import-outside-toplevel
  from reasoning_rl.lora import LoraSettings  # pylint: disable=import-outside-toplevel

  require(config.model.attention_kernel in TRAINING_KERNELS, "model.attention_kernel",
          f"must be one of {', '.join(TRAINING_KERNELS)}")
  from reasoning_rl.models.transformer import REMAT_POLICIES  # pylint: disable=import-outside-toplevel

  require(config.algo.remat_policy in ("", *REMAT_POLICIES), "algo.remat_policy",
          f"must be '' (as algo.remat says) or one of {', '.join(REMAT_POLICIES)}")
  require(not (config.algo.remat and config.algo.remat_policy == "none"), "algo.remat_policy",
          "'none' contradicts algo.remat=True; set one of them")
  LoraSettings.from_config(config).validate()
  r = config.rollout
  require(config.algo.name in ("grpo", "ppo"), "algo.name", "must be grpo or ppo")
  from reasoning_rl import registry  # pylint: disable=import-outside-toplevel

  for choices, name in ((registry.ADVANTAGE_ESTIMATORS, config.algo.estimator),
                        (registry.LOSS_TYPES, config.algo.loss_type),
                        (registry.LOSS_AGGREGATIONS, config.algo.loss_agg),
                        (registry.KL_ESTIMATORS, config.algo.kl_estimator),
                        (registry.IS_CORRECTIONS, config.algo.is_correction)):
    choices.get(name)  # ConfigError: config.<field>=...: unknown ...; use one of [...]
  for split in ("train", "eval"):
    source = config.data[split]
    registry.TASK_SOURCES.get(source.get("kind") if hasattr(source, "get") else None,
                              field=f"data.{split}.kind")
  from reasoning_rl.verifiers.rewards import build_parts  # pylint: disable=import-outside-toplevel

  build_parts(config.rewards)  # every part's kind and settings
  if config.algo.name == "grpo" and config.stage == "rl":
    require(r.num_samples >= 2, "rollout.num_samples",
            f"group estimator {config.algo.estimator!r} compares samples of one prompt: "
            "needs at least 2")
  batch = r.num_prompts * r.num_samples
  mini, micro = config.algo.num_mini_batches, config.algo.num_micro_batches
  require(config.stage != "rl" or batch % (mini * micro) == 0,
          "algo.num_micro_batches" if mini == 1 else "algo.num_mini_batches",
          f"num_mini_batches x num_micro_batches = {mini} x {micro} must divide the batch of "
          f"num_prompts x num_samples = {batch} completions")
  require(not config.algo.packing or config.stage != "rl"
          or (batch // (mini * micro)) % config.algo.packed_row_factor == 0,
          "algo.packed_row_factor", f"packed rows {config.algo.packed_row_factor} times as long "
          f"must evenly share the {batch // max(mini * micro, 1)} rows of a micro-batch")
  require(isinstance(config.algo.truncated_ratio, bool), "algo.truncated_ratio",
          "must be True (π_θ / π_old of the sampler's truncated distribution) or False (the "
          "full-softmax ratio)")
  require(not (config.stage == "rl" and config.algo.truncated_ratio and config.algo.packing
               and rollout_rescales(config)), "algo.truncated_ratio",
          "packed batches do not carry the per-row sampling settings the truncated ratio needs, "
          "and this rollout rescales or truncates (rollout.temperature / top_p / top_k / min_p): "
          "set algo.packing=False, or algo.truncated_ratio=False to accept the biased "
          "full-softmax ratio")
  require(config.beta > 0 or math.isinf(config.guards.max_kl), "guards.max_kl",
          "the KL guard measures KL to the reference, which exists only with beta > 0; set "
          "--config.beta or leave max_kl at inf")
  for variant in config.eval.instruction_variants:
    require(isinstance(variant, str) and "{prompt}" in variant, "eval.instruction_variants",
            "every variant is an instruction text containing {prompt}")
  if num_devices is not None:
    _validate_mesh(config, num_devices, num_slices)


def _validate_mesh(config, num_devices: int, num_slices: int) -> None:
  from reasoning_rl import sharding  # imports jax; validation of the rest of the config does not

  counts = sharding.slice_device_counts(config.mesh.num_trainer_devices, num_devices,
                                        field="config.mesh.num_trainer_devices")
  trainer_slices = sharding.slices_spanned(counts[0], num_devices, num_slices)
  data, fsdp, _ = sharding.multi_slice_mesh_shape(tuple(config.mesh.trainer), counts[0],
                                                  trainer_slices, field="config.mesh.trainer")
  sharding.resolve_mesh_shape(tuple(config.mesh.sampler), counts[1], field="config.mesh.sampler")
  # The step's batch is split row-wise over the trainer mesh's data x fsdp devices
  # (sharding.batch_sharding): a row count they do not divide fails in JAX only once the first
  # batch is placed, after the model load and the step-0 evaluation.
  if config.stage == "rl":
    field, rows = "rollout.num_prompts", config.rollout.num_prompts * config.rollout.num_samples
    what = f"num_prompts x num_samples = {rows} completions"
  else:
    field, rows = "sft.batch_size", config.sft.batch_size
    what = f"{rows} examples"
  if rows % (data * fsdp):
    raise ConfigError(
        f"config.{field}={_field(config, field)!r}: the batch of {what} is split over the "
        f"trainer mesh's data x fsdp = {data} x {fsdp} devices, which must divide it; change "
        f"the batch or config.mesh.trainer")


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


def config_args(argv: list[str]) -> tuple[str | None, dict[str, str]]:
  """(config file, {field: value}) from a launcher's command line, in either flag form:
  `--config=FILE --config.a.b=v` or `--config FILE --config.a.b v` (absl accepts both)."""
  path, overrides, args = None, {}, list(argv[1:])
  for index, arg in enumerate(args):
    if arg == "--":
      break
    if not (arg == "--config" or arg.startswith(("--config=", "--config."))):
      continue
    name, has_value, value = arg[2:].partition("=")
    if not has_value:
      following = args[index + 1] if index + 1 < len(args) else None
      if following is None or following.startswith("--"):
        if name == "config":
          raise ConfigError("--config: missing its file; pass --config=configs/NAME.py")
        value = "true"  # absl's bare boolean form, `--config.dry_run`
      else:
        value = following
    if name == "config":
      path = value
    else:
      overrides[name[len("config."):]] = value
  return path, overrides


def precheck_command_line(argv: list[str]) -> None:
  """One ConfigError for a missing config file, an unknown field or an unparsable value, before
  absl parses the flags (whose errors are tracebacks or multi-line)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  argument, overrides = config_args(argv)
  if argument is None:
    raise ConfigError("--config: missing; pass --config=configs/NAME.py")
  # FILE:VARIANT passes VARIANT to get_config (ml_collections' convention; recipes use it for
  # their debug-sized variant)
  path, *variant = argument.split(":", 1)
  if not pathlib.Path(path).is_file():
    raise ConfigError(f"--config={argument}: no such config file")
  spec = importlib.util.spec_from_file_location("_config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config={argument}: the file defines no get_config()")
  check_overrides(module.get_config(*variant), overrides)


def precheck_or_exit(argv: list[str]) -> None:
  """`precheck_command_line` for a launcher's `__main__`: a bad command line prints one line and
  exits 2 (the bad-config exit code)."""
  import sys  # pylint: disable=import-outside-toplevel

  try:
    precheck_command_line(argv)
  except ConfigError as error:
    print(f"error: ConfigError: {error}", file=sys.stderr)
    sys.exit(ExitCode.BAD_INPUT)
