"""Every training-config field, declared once: its section, default, meaning and accepted values.

`base_config()`, the range checks of `config.validate`, the choice checks, `launch/train.py --help`
and docs/config.md are all derived from `SECTIONS`, and from `GROUPS` for the settings given as a
dict per pluggable choice (each reward-part kind's at config.rewards.<name>, each environment's at
config.environment.settings: `REWARD_PARTS`, `ENVIRONMENTS`), whose `Group.resolve` fills in their
defaults and checks them for the modules that implement them; the trainer's typed views of a section
(`rl.step_config.StepConfig`, `sampler.SamplingParams`, `lora.LoraSettings`) take their defaults from here
and their values from the config by the same names (`source`). Adding a field is one `Field` line.

JAX-free on purpose: `--help` and config validation run before any backend starts.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from reasoning_rl import registries  # the registries alone: no choice, no JAX
from reasoning_rl.errors import ConfigError
from reasoning_rl.plain_data import plain


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


@dataclasses.dataclass(frozen=True)
class OneOf:
  """A name from a fixed list (`values`) or from a registry of pluggable choices (`registry`, an
  attribute of `reasoning_rl.registry`, resolved by `config.check_choice`: users register their
  own, and this module stays free of the registry's imports)."""

  values: tuple = ()
  registry: str = ""

  def describe(self) -> str:
    if self.registry:
      return f"a name of registry.{self.registry}"
    return "one of " + " | ".join(repr(v) if v == "" else str(v) for v in self.values)


@dataclasses.dataclass(frozen=True)
class Text:
  """A string that fully matches `pattern` (a tag name, an identifier, a non-empty path);
  `wants` says which in words."""

  pattern: str
  wants: str

  def problem(self, value) -> str | None:
    if isinstance(value, str) and re.fullmatch(self.pattern, value):
      return None
    return f"must be {self.describe()}"

  def describe(self) -> str:
    return self.wants


@dataclasses.dataclass(frozen=True)
class ManyOf:
  """A non-empty list of names from `values` (a list or a tuple; read as a tuple)."""

  values: tuple

  def problem(self, value) -> str | None:
    if (isinstance(value, (list, tuple)) and value and
        all(isinstance(name, str) and name in self.values for name in value)):
      return None
    return f"must be {self.describe()}"

  def describe(self) -> str:
    return "a non-empty list of " + " | ".join(self.values)


class _Shown:
  """A default that is not a value, shown in --help and docs/config.md by what it means."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


# The default of a setting that has none: the config must give it.
REQUIRED = _Shown("(required)")


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field. `kind`: the value's type where the default does not say it (a None
  default); `typed_none`: the None default is an ml_collections placeholder of `kind`, so
  --config overrides parse as that type; `check`: a `Range`, a `OneOf`, a `Text`, a `ManyOf`, or
  None (free text, or a dict of settings checked where it is read: a task source's, or a reward
  part's / an environment's by its `Group`)."""

  name: str
  default: Any
  doc: str
  check: Range | OneOf | Text | ManyOf | None = None
  kind: type | None = None
  typed_none: bool = False


@dataclasses.dataclass(frozen=True)
class Section:
  name: str  # dotted path below `config` ("" = top level)
  doc: str
  fields: tuple[Field, ...]


def _int(low=None, high=None, meaning=""):
  return Range(int, low, high, meaning=meaning)


_POSITIVE = Range(float, 0, low_open=True)
_NON_NEGATIVE = Range(float, 0)
_FRACTION = Range(float, 0, 1)
_COUNT = _int(1)
_DTYPES = ("float32", "bfloat16")
# The kernels layer's names (reasoning_rl/kernels imports JAX; a test keeps the two equal).
TRAINING_KERNELS = ("auto", "reference", "splash", "pallas_gpu")
PAGED_KERNELS = ("auto", "gather", "pallas_tpu")
# What the backward pass recomputes (models.transformer.REMAT_POLICIES; a test keeps them equal).
REMAT_POLICIES = ("none", "full", "save_matmuls")

SECTIONS: tuple[Section, ...] = (
    Section("", "The run.", (
        Field("workdir", "", "where metrics.jsonl, tensorboard/, checkpoints/, rollouts/ and "
              "model/ go (a local path or gs://)"),
        Field("seed", 0, "root of every random stream (sampling, init, data order)",
              _int(0, 2**63 - 1)),  # a C long: jax.random.key's bound
        Field("total_steps", 10, "RL steps (one rollout batch + its updates each)", _COUNT),
        Field("stage", "rl", "rl | sft (cold-start SFT on sft.data_path) | rejection_sft "
              "(sample from the model, keep verified-correct traces, fine-tune on them). "
              "Checkpoints of every stage load as models: a stage starts from the previous one "
              "with --config.model.path=PREVIOUS_WORKDIR", OneOf(("rl", "sft", "rejection_sft"))),
        Field("dry_run", False, "print the memory / throughput plan of the target slice and exit"),
        Field("keep_freed_host_memory", True, "Linux/glibc: keep freed host memory for reuse "
              "instead of returning it to the OS, so a CPU step's multi-GB temporaries are not "
              "page-faulted (and zeroed) afresh every step; the process then holds its peak host "
              "memory until it exits (reasoning_rl/host_memory.py)"),
        Field("beta", 0.0, "KL weight against the frozen reference; 0 never loads the reference",
              Range(float, 0, meaning="0 = no KL term")),
    )),
    Section("model", "The policy: path = a Hugging Face directory, a .gguf file or a run's "
            "workdir; empty = a random model built from model.random with the tokenizer named "
            "by model.tokenizer.", (
        Field("path", "", "HF directory, .gguf file or training run to start from"),
        Field("tokenizer", "", "for a random model: a tokenizer path, or debug_arithmetic (a "
              "built-in character vocabulary for the synthetic debug task)"),
        Field("dtype", "float32", "compute dtype (activations, matmuls; the sampler's weights "
              "and KV cache)", OneOf(_DTYPES)),
        Field("weight_dtype", "float32", "the trainer's master weights and AdamW moments "
              "(reasoning_rl/precision.py): float32 keeps every update; bfloat16 (pure bf16, "
              "needs dtype=bfloat16) halves that memory but rounds small updates away. "
              "Gradients are summed over micro-batches in float32 either way; with LoRA the "
              "frozen base is held in dtype and the adapters in float32", OneOf(_DTYPES)),
        Field("attention_kernel", "auto", "training attention (reasoning_rl/kernels): auto "
              "takes the backend's flash kernel (splash on TPU, Pallas/Triton on GPU where it "
              "supports the model: no window, soft-cap or attention sinks) and the XLA "
              "reference on CPU; a kernel named off its backend runs in Pallas interpret mode "
              "(exact, slow)", OneOf(TRAINING_KERNELS)),
        Field("scan_layers", False, "the block stack as one scanned module (parameters and KV "
              "cache stacked on a leading layers axis, run by jax.lax.scan): the step and the "
              "sampler compile one block whatever the depth (benchmarks/RESULTS.md, \"Scanned "
              "layers\"). Same numbers; HF / GGUF / PEFT files and LoRA target names are "
              "unchanged; a run's checkpoints hold its own layout (a resume keeps it)"),
    )),
    Section("model.upcycle", "Sparse upcycling (Komatsuzaki et al. 2022, reasoning_rl/models/"
            "upcycle.py): the loaded dense model becomes a mixture of experts, each layer's MLP "
            "copied into num_experts experts behind a new router; it computes what the dense "
            "model computes until training makes the experts differ. Llama becomes Mixtral, "
            "Qwen3 becomes Qwen3-MoE (what save_hf writes).", (
        Field("num_experts", 0, "experts per layer (E)", _int(0, meaning="0 = off")),
        Field("experts_per_token", 2, "experts each token is sent to (k)", _COUNT),
    )),
    Section("model.random", "Shape of the random model (model.path empty); any other "
            "ModelConfig setting may be added.", (
        Field("model_type", "qwen2", "architecture family (llama, qwen2, qwen3, gemma, gemma2, "
              "gemma3)"),
        Field("hidden_size", 64, "model width (residual stream)", _COUNT),
        Field("intermediate_size", 128, "width of the MLP's hidden layer", _COUNT),
        Field("num_layers", 2, "transformer blocks", _COUNT),
        Field("num_heads", 4, "query heads", _COUNT),
        Field("num_kv_heads", 2, "key/value heads (grouped-query attention)", _COUNT),
        Field("head_dim", 16, "width of one head", _COUNT),
        Field("tie_word_embeddings", True, "the output projection is the embedding's transpose"),
        Field("attention_bias", True, "biases on the q/k/v projections (Qwen2)"),
    )),
    Section("lora", "LoRA / QLoRA (reasoning_rl/lora.py); rank 0 = full fine-tuning.", (
        Field("rank", 0, "adapter rank r", _int(0, meaning="0 = full fine-tuning")),
        Field("alpha", 16.0, "adapters scale by alpha / rank", _POSITIVE),
        Field("target_modules", r"layers/\d+/(attn|mlp)", "regex (full match) over module "
              "paths layers/<i>/attn and layers/<i>/mlp"),
        Field("base_quantization", "", "quantize the frozen base (QLoRA)",
              OneOf(("", "int8", "nf4"))),
        Field("quantization_tile", 64, "NF4 block size along the contracting axis",
              _int(0, meaning="0 = one scale per channel")),
        Field("sampler_weights", "adapters", "what the sampler gets after each step: the "
              "adapters, or the weights with the adapters folded in",
              OneOf(("adapters", "merged"))),
    )),
    Section("data", "Prompts. A source: kind = a name of registry.TASK_SOURCES "
            "(synthetic_arithmetic | reasoning_gym | jsonl …) plus its settings.", (
        Field("train", dict(kind="synthetic_arithmetic", seed=0), "training prompt source "
              "(its settings are checked by the source)"),
        Field("eval", dict(kind="synthetic_arithmetic", seed=10_000), "held-out prompt source"),
        Field("template", "plain", "plain ({prompt}), chat (the tokenizer's chat template around "
              "data.instruction) or r1zero (DeepSeek-R1-Zero's text prompt)",
              OneOf(("plain", "chat", "r1zero"))),
        Field("instruction", "{prompt}", "for chat: the user message; {prompt} is the task's "
              "question"),
        Field("system_prompt", "", "for chat: the system message (empty = none)"),
    )),
    Section("rollout", "Sampling on the sampler slice (reasoning_rl/sampler).", (
        Field("backend", "engine", "the rollout backend that samples the groups (a "
              "sampler.api.RolloutBackend registered by name; engine = this package's "
              "JetStream-API engine)", OneOf(registry="ROLLOUT_BACKENDS")),
        Field("num_prompts", 4, "P prompts per step", _COUNT),
        Field("num_samples", 4, "G completions per prompt (group size)", _COUNT),
        Field("max_new_tokens", 12, "completion budget", _COUNT),
        Field("temperature", 1.0, "sampling temperature", Range(float, 0, meaning="0 = greedy")),
        Field("top_p", 1.0, "nucleus filter (1 = off)", Range(float, 0, 1, low_open=True)),
        Field("top_k", 0, "keep the k likeliest tokens", _int(0, meaning="0 = off")),
        Field("min_p", 0.0, "keep p >= min_p * p_max after temperature (Nguyen et al. 2024); "
              "0 = off", _FRACTION),
        Field("stop_strings", ("</answer>",), "a completion ends after the first of these"),
        Field("max_prefill_length", 32, "longest prompt, in tokens (prompts are bucketed)",
              _COUNT),
        Field("max_concurrent_decodes", 16, "decode slots", _COUNT),
        Field("steps_per_call", 16, "decode steps per host round trip", _COUNT),
        Field("kv_page_size", 0, "a paged KV cache (sampler/paged.py): cache entries per page; "
              "pages are taken as sequences grow and returned when they end, and a group's "
              "prompt pages are shared by its samples", _int(0, meaning="0 = one contiguous "
                                                              "cache row per slot")),
        Field("kv_pages", 0, "pages in the paged cache's pool (with rollout.kv_page_size)",
              _int(0, meaning="0 = room for every slot's whole length")),
        Field("kv_page_kernel", "auto", "how decode attention reads the paged cache "
              "(reasoning_rl/kernels/paged.py): gather copies a layer's rows out of their pages; "
              "pallas_tpu reads them in place with JAX's Pallas TPU paged-attention kernel (one "
              "query per row, no sliding window or attention sinks: other layers gather; off a "
              "TPU in interpret mode, slow). auto takes "
              "pallas_tpu on a TPU with a bfloat16 cache (the kernel computes in bfloat16) and "
              "heads of a multiple of 128, and gather elsewhere", OneOf(PAGED_KERNELS)),
        Field("exact_logprobs", False, "zero-mismatch rollouts (sampler/exact.py, "
              "docs/off_policy.md): every token an exact draw from the training forward's policy "
              "(drafts verified by Gumbel-max coupling, near-ties repaired) and its log-probs that "
              "forward's, bit for bit, whatever the batch; synchronous runs then take π_old = μ "
              "from the sampler without recomputing it. Single-turn, engine backend only"),
    )),
    Section("environment", "Multi-turn rollouts (reasoning_rl/sampler/multiturn.py): the model "
            "acts in an environment (a tool, a game) over several turns; observation tokens are "
            "context, not trained on. rollout.max_new_tokens then bounds a whole episode's "
            "completion, observations included.", (
        Field("name", "", "empty = single-turn completions; else a name of "
              "registry.ENVIRONMENTS (python_tool, guess_number, …)"),
        Field("settings", {}, "the environment's own settings (listed per environment below, "
              "after the sections)"),
        Field("max_turns", 4, "model turns per episode", _COUNT),
        Field("turn_tokens", 0, "model tokens per turn",
              _int(0, meaning="0 = rollout.max_new_tokens")),
        Field("observation_format", "inline", "inline (the observation inside the assistant's "
              "message, ToRL / ReTool style), chat (a tool turn of the tokenizer's chat "
              "template) or raw (the text as it is, e.g. a calculator's value after '=')",
              OneOf(("inline", "chat", "raw"))),
        Field("step_workers", 8, "environment steps run at once (threads)", _COUNT),
    )),
    Section("rewards", "Rewards: a weighted sum of named parts, each {weight, kind, …settings of "
            "its kind} (reasoning_rl/verifiers/rewards.py); the settings of every kind are listed "
            "below, after the sections.", ()),
    Section("verifier", "Scoring completions (reasoning_rl/workers).", (
        Field("num_workers", 2, "verifier worker processes",
              _int(0, meaning="0 = score in this process")),
        Field("item_timeout_s", 10.0, "seconds one completion may take to score", _POSITIVE),
        Field("redteam", True, "probe the rewards with known exploits before training"),
        Field("allow_exploits", False, "explicit, logged override of a failed red team"),
    )),
    Section("algo", "Advantages and loss (reasoning_rl/rl).", (
        Field("name", "grpo", "grpo (any group estimator) | ppo (value head + GAE)",
              OneOf(("grpo", "ppo"))),
        Field("estimator", "grpo", "group advantage estimator (grpo | dr_grpo | rloo | "
              "reinforce_pp)", OneOf(registry="ADVANTAGE_ESTIMATORS")),
        Field("kl_estimator", "k3", "KL estimator of the beta term",
              OneOf(registry="KL_ESTIMATORS")),
        Field("epsilon_low", 0.2, "clip floor 1 - epsilon_low of the ratio", _FRACTION),
        Field("epsilon_high", 0.2, "clip ceiling 1 + epsilon_high (> epsilon_low is DAPO's "
              "clip-higher)", _NON_NEGATIVE),
        Field("dual_clip", None, "dual-clip bound c on negative advantages",
              Range(float, 1, low_open=True, none_ok=True, meaning="None = off"), kind=float),
        Field("loss_agg", "seq-mean-token-mean", "how token losses become the batch loss",
              OneOf(registry="LOSS_AGGREGATIONS")),
        Field("entropy_coef", 0.0, "entropy bonus weight", Range(float)),
        Field("num_iterations", 1, "μ (GRPO's notation, Shao et al. 2024): passes over each "
              "rollout batch against a fixed π_old; with μ·M > 1 the ratio moves off 1 after "
              "the first update, so clipping can fire", _COUNT),
        Field("num_mini_batches", 1, "M: optimizer updates per pass, each on a disjoint 1/M of "
              "the batch's rows (PPO mini-batches); the learning-rate schedule advances per "
              "update, warmup_steps / total_steps stay in RL steps (scaled by μ·M)", _COUNT),
        Field("num_micro_batches", 0, "gradient accumulation inside each update (memory, not "
              "maths); 0 = chosen at start-up for the machine (reasoning_rl/step_layout.py): on "
              "TPU / GPU the fewest whose step fits the device's memory, on a CPU micro-batches "
              "of at most ~1k positions", _int(0, meaning="0 = chosen for the machine")),
        Field("logprob_chunk", 128, "time steps projected to the vocabulary at once", _COUNT),
        Field("remat", "none", "what the backward pass recomputes (Chen et al. 2016): none "
              "(every block's activations kept) | full (only each block's input kept, the "
              "block rebuilt: one layer's activations in memory, about one more forward) | "
              "save_matmuls (the projections' outputs kept; norms, attention scores and "
              "activations rebuilt)", OneOf(REMAT_POLICIES)),
        Field("packing", None, "padding-free training (rl/packing.py): sequences packed into "
              "rows with segment ids; positions a batch's tokens do not reach are skipped and "
              "the vocabulary head runs only at completion tokens. Same loss and gradients. "
              "None = chosen at start-up (reasoning_rl/step_layout.py): on for RL stages",
              kind=bool, typed_none=True),
        Field("packed_row_factor", 1, "k: packed rows are k × (max_prefill_length + "
              "max_new_tokens) long (R / k per micro-batch): long sequences waste less of a "
              "row, attention costs k times more per token", _COUNT),
        Field("loss_type", "ppo", "ppo: PPO's clipped token ratio (Schulman et al. 2017) | "
              "gspo / gspo-token: GSPO's length-normalised sequence ratio (Zheng et al. 2025) | "
              "cispo: clipped stop-gradient IS weight on a REINFORCE term (MiniMax-M1)",
              OneOf(registry="LOSS_TYPES")),
        Field("is_correction", "none", "correction for the sampler's log-probs differing from "
              "the trainer's (kernels, precision, staleness): none | token-truncate | token-mask "
              "| sequence-truncate | sequence-mask with threshold is_threshold (TIS, Yao et al. "
              "2025; IMPALA, Espeholt et al. 2018); asynchronous rollouts always correct (none "
              "then means token-truncate)", OneOf(registry="IS_CORRECTIONS")),
        Field("is_threshold", 2.0, "C of the importance correction", _POSITIVE),
        Field("truncated_ratio", True, "the ratio of the distribution the sampler draws from "
              "(docs/off_policy.md): π_θ and π_old after the rollout's temperature / top_k / "
              "top_p / min_p, renormalised — exact for the policy actually sampled; False: the "
              "full-softmax ratio, biased when the rollout warps. Applied only when the rollout "
              "does (packed rows carry each position's settings)"),
        Field("vf_coef", 0.5, "ppo: value-loss weight (Schulman et al. 2017)", _NON_NEGATIVE),
        Field("value_clip", 0.2, "ppo: value clip ε_v", _POSITIVE),
        Field("gamma", 1.0, "ppo: discount γ (GAE, Schulman et al. 2016)", _FRACTION),
        Field("gae_lambda", 0.95, "ppo: GAE λ", _FRACTION),
        Field("routing_replay", False, "mixture-of-experts models: the trainer's π_θ and π_old "
              "forwards send each token to the experts the sampler chose for it instead of "
              "their own top-k (rollout routing replay, R3: Ma et al. 2025, arXiv:2510.11370); "
              "the weights of those experts still come from the trainer's router, which keeps "
              "its gradient. Under rollout.exact_logprobs the sampler's experts are the "
              "canonical forward's and are always replayed (docs/moe.md)"),
        Field("moe_load_balance_coef", 0.0, "mixture-of-experts models: weight of the load-"
              "balancing loss E·Σ_i f_i·P_i (Switch Transformer, Fedus et al. 2021) averaged over "
              "sparse layers; RL usually trains without it", Range(float, 0, meaning="0 = off")),
        Field("moe_router_z_coef", 0.0, "mixture-of-experts models: weight of the router "
              "z-loss, mean logsumexp(router logits)² (ST-MoE, Zoph et al. 2022)",
              Range(float, 0, meaning="0 = off")),
    )),
    Section("optim", "AdamW (Loshchilov & Hutter 2019) with linear warm-up then cosine decay, "
            "after clipping the global gradient norm.", (
        Field("learning_rate", 1e-3, "peak learning rate", _NON_NEGATIVE),
        Field("warmup_steps", 0, "linear warm-up, in RL steps", _int(0)),
        Field("final_lr_fraction", 0.1, "the cosine decays to this fraction of the peak",
              _FRACTION),
        Field("weight_decay", 0.0, "decoupled weight decay", _NON_NEGATIVE),
        Field("max_grad_norm", 1.0, "global gradient-norm clip (inf = off)",
              Range(float, 0, low_open=True, infinite_ok=True)),
        Field("b1", 0.9, "first-moment decay (Kingma & Ba 2015)",
              Range(float, 0, 1, high_open=True)),
        Field("b2", 0.999, "second-moment decay", Range(float, 0, 1, high_open=True)),
        Field("eps", 1e-8, "AdamW's denominator epsilon", _POSITIVE),
    )),
    Section("dynamic_sampling", "DAPO dynamic sampling: sample extra prompts, drop groups whose "
            "rewards are all equal, refill.", (
        Field("enabled", False, "turn it on"),
        Field("max_rounds", 3, "sampling rounds per step before training on what is there "
              "(nothing: no update)",
              _COUNT),
    )),
    Section("sft", "SFT stages (DeepSeek-AI 2025, §2.3): loss on completion tokens only.", (
        Field("data_path", "", 'JSONL rows {"prompt"|"question": …, "completion"|"response": …}'),
        Field("batch_size", 16, "rows per step; the data is walked in a seeded order, epoch by "
              "epoch", _COUNT),
    )),
    Section("rejection", "Rejection-sampling SFT (stage = rejection_sft).", (
        Field("num_prompts", 64, "training prompts sampled from (data.train)", _COUNT),
        Field("num_samples", 8, "samples per prompt", _COUNT),
        Field("temperature", 1.0, "sampling temperature", Range(float, 0, meaning="0 = greedy")),
        Field("keep", "shortest", "shortest correct trace per prompt | all (distinct) correct "
              "ones", OneOf(("shortest", "all"))),
    )),
    Section("async_rollouts", "Asynchronous rollouts: batch s is sampled with policy version "
            "s - max_staleness while step s - 1 trains; lagging batches are corrected by "
            "truncated importance sampling (algo.is_correction).", (
        Field("enabled", None, "None = automatic: on when trainer and sampler are different "
              "devices (mesh.num_trainer_devices > 0), off when they share them; True / False "
              "force it", kind=bool, typed_none=True),
        Field("max_staleness", 1, "policy versions a trained batch may lag", _int(0)),
    )),
    Section("partial_rollouts", "Partial rollouts (reasoning_rl/loop/partial_rollouts.py, "
            "docs/off_policy.md): a step trains on the first rollout.num_prompts groups to "
            "complete out of more in flight; samples still running continue under the next "
            "weights, each token keeping the version that drew it, corrected per token "
            "(algo.is_correction). Single process, single-turn, synchronous rollouts.", (
        Field("enabled", False, "on: long completions no longer hold up a step", kind=bool),
        Field("groups_in_flight", 0, "prompts in flight at once (more than rollout.num_prompts, "
              "or no round can end before all of them do)",
              _int(0, meaning="0 = 2 x rollout.num_prompts")),
        Field("max_lag", 2, "policy versions a trained token may lag the weights training on "
              "it; a sample holding an older token restarts from its first token", _int(0)),
    )),
    Section("mesh", "Devices: one list split into trainer and sampler slices, each its own "
            "(data, fsdp, tensor) mesh.", (
        Field("num_trainer_devices", 0, "devices of the trainer slice",
              _int(0, meaning="0 = every device does both")),
        Field("trainer", (1, -1, 1), "trainer mesh (data, fsdp, tensor), or (data, fsdp, "
              "expert, tensor) to split a mixture of experts' experts (and the batch) over an "
              "expert axis (docs/moe.md); -1 = the rest"),
        Field("sampler", (1, 1, -1), "sampler mesh (data, fsdp, tensor); -1 = the rest"),
        Field("num_slices", 0, "TPU Multislice slices; N > 1 on devices without slices "
              "simulates N; on several slices mesh.trainer is one slice's mesh and the slices "
              "multiply its data axis", _int(0, meaning="0 = the devices' own slices")),
    )),
    Section("target", "The slice the dry run plans for.", (
        Field("tpu", "cpu", "v4 | v5e | v5p | v6e | v7x | cpu"),
        Field("num_devices", 0, "JAX devices of one slice, one per chip (v7x: two)",
              _int(0, meaning="0 = this machine's")),
        Field("num_slices", 1, "slices joined over the data-center network "
              "(launch/gcp/commands.py --num_slices)", _COUNT),
    )),
    Section("resume", "A rerun on a workdir resumes it.", (
        Field("allow_changes", (), "fields that may differ from the run's first start "
              "(WORKDIR/run_config.json), e.g. (\"total_steps\",) — the schedule then stretches "
              "to the new total — or (\"eval.*\",); display and storage fields (logging.*, "
              "checkpoint cadence, verifier.num_workers) and the step's layout (algo.packing, "
              "algo.num_micro_batches) may always change"),
    )),
    Section("checkpoint", "Orbax checkpoints under WORKDIR/checkpoints.", (
        Field("every_steps", 5, "save cadence, in steps", _COUNT),
        Field("every_minutes", 0.0, "also save at the first step that ends this long after the "
              "last save started, unless a save is still in flight (time-based, as MaxText and "
              "Tunix offer; a resume from any step is exact)", Range(float, 0, meaning="0 = off")),
        Field("keep", 2, "newest checkpoints kept", _COUNT),
        Field("async_save", True, "write in the background while training goes on"),
        Field("stop_deadline_s", 25.0, "after SIGTERM / SIGINT the run finishes its step, saves "
              "and exits (143 / 130); still running this long after the signal (a step or a "
              "save too long for the notice, a store that stopped answering) it exits at once "
              "with the same code, resuming later from the previous checkpoint; keep it under "
              "the platform's grace (GKE and Spot TPU: 30 s)", _POSITIVE),
    )),
    Section("storage", "Local paths and gs:// (docs/storage.md).", (
        Field("timeout_s", 120.0, "deadline of one storage call, its retries included (a "
              "transfer of B bytes gets B / 10 MiB/s more); past it the run exits 4 naming the "
              "call and the checkpoint a rerun resumes from", _POSITIVE),
    )),
    Section("eval", "Held-out evaluation (data.eval).", (
        Field("every_steps", 0, "cadence in steps",
              _int(0, meaning="0 = only before and after training")),
        Field("num_examples", 16, "held-out prompts", _COUNT),
        Field("max_new_tokens", 0, "completion budget",
              _int(0, meaning="0 = rollout.max_new_tokens")),
        Field("num_samples", 1, "samples per prompt; > 1 adds pass@k and maj@k (Chen et al. "
              "2021)", _COUNT),
        Field("temperature", 0.0, "sampling temperature (0 = greedy pass@1)",
              Range(float, 0, meaning="0 = greedy")),
        Field("canaries", (), "prompts whose completions are logged verbatim at every "
              "evaluation"),
        Field("instruction_variants", (), "rewordings of data.instruction (each with "
              "{prompt}): the held-out set is evaluated once more under each (results under "
              "'variants' in eval/step_*.json)"),
    )),
    Section("logging", "What the run writes for people.", (
        Field("rollouts_every_steps", 1, "cadence of WORKDIR/rollouts/ records",
              _int(0, meaning="0 = never")),
        Field("rollout_experts", True, "mixture-of-experts models: each rollout record keeps "
              "the experts the sampler routed its prompt and completion tokens to (`experts`: "
              "[tokens, sparse layers, k] as base64 bytes, docs/moe.md); ~1 byte per token, "
              "layer and k: turn off for long completions of large models"),
        Field("tensorboard", True, "write WORKDIR/tensorboard/"),
        Field("progress_bar", True, "one live progress line on the terminal"),
        Field("peak_flops_per_device", 4e11, "peak FLOP/s of one device, the denominator of "
              "throughput/rl_mfu", _POSITIVE),
    )),
    Section("guards", "Stop a run that went wrong (reasoning_rl/guards.py); STOPPED.md says why.", (
        Field("max_kl", math.inf, "mean KL to the reference above this stops the run",
              Range(float, 0, low_open=True, infinite_ok=True, meaning="inf = off")),
        Field("min_entropy", 0.0, "mean token entropy below this stops the run",
              Range(float, 0, meaning="0 = off")),
        Field("max_verifier_timeout_rate", 0.5, "share of a step's groups the scorer timed out "
              "on (a slow machine?)", Range(float, 0, 1, meaning="1 = off")),
        Field("max_verifier_error_rate", 0.1, "share of a step's groups the scorer failed on "
              "(verifier bugs)", Range(float, 0, 1, meaning="1 = off")),
        Field("max_skipped_updates", 10, "consecutive non-finite updates",
              _int(0, meaning="0 = off")),
        Field("heldout_drop_evals", 0, "held-out accuracy fell at each of the last K "
              "evaluations while train reward rose", _int(0, meaning="0 = off")),
        Field("max_length_growth", math.inf, "mean held-out length grew (relatively) this much "
              "more than accuracy over the last length_growth_evals evaluations",
              Range(float, 0, low_open=True, infinite_ok=True, meaning="inf = off")),
        Field("length_growth_evals", 2, "window of the length-growth guard", _COUNT),
        Field("max_routing_collapse", 0.95, "mixture-of-experts models: a step whose busiest "
              "expert (in any sparse layer, over the step's tokens) took this share of the most "
              "it could take (max/mean tokens per expert divided by E/k; 1 = every token sent "
              "to the same k experts) stops the run", Range(float, 0, 1, low_open=True,
                                                            meaning="1 = off")),
    )),
)

# The rewards a fresh config scores with (a dict of named parts, each checked by its kind's Group).
DEFAULT_REWARDS = {"correct": {"weight": 1.0, "verifier": "math", "extract": "answer"}}


@dataclasses.dataclass(frozen=True)
class Group:
  """The settings of one pluggable choice, which a config gives as a dict: a reward part of kind
  `choice` (at config.rewards.<name>) or the environment `choice` (at config.environment.settings).
  Declared with `Field`s like a section; `resolve` fills in the defaults and checks every value
  against its declaration, so the implementing module holds no defaults or type checks of its
  own."""

  path: str  # where the dict sits: "rewards.<name>" | "environment.settings"
  choice: str  # the reward-part kind / environment name
  doc: str
  fields: tuple[Field, ...]

  @property
  def qualifier(self) -> str:
    """Which choice the settings belong to, as --help and docs/config.md head them."""
    selector = "kind" if self.path.startswith("rewards.") else "environment.name"
    return f"({selector} = {self.choice})"

  @property
  def title(self) -> str:
    return f"{self.path} {self.qualifier}"

  def names(self) -> tuple[str, ...]:
    return tuple(item.name for item in self.fields)

  def defaults(self) -> dict[str, Any]:
    return {item.name: item.default for item in self.fields}

  def resolve(self, given: Any, *, field: str, floats: bool = False) -> dict[str, Any]:
    """`given` (a mapping; None = empty) with every default filled in and every value checked:
    a ConfigError names config.<field>.<setting> and what it accepts.

    field: where `given` sits, e.g. "rewards.format" or "environment.settings".
    floats: an integer given for a real-valued setting is read as a float (environments hold
    their settings as attributes of that type).
    """
    given = {} if given is None else plain(given)
    if not isinstance(given, Mapping):
      raise ConfigError(f"config.{field}={given!r}: must be a mapping of setting name -> value")
    names = self.names()
    unknown = sorted(set(given) - set(names), key=str)
    if unknown:
      owner = (f"a {self.choice!r} reward part" if self.path.startswith("rewards.")
               else f"environment {self.choice!r}")
      raise ConfigError(f"config.{field}.{unknown[0]}: not a setting of {owner}; its settings "
                        f"are {sorted(names)}")
    return {item.name: checked(f"{field}.{item.name}", item, given.get(item.name, item.default),
                               floats=floats)
            for item in self.fields}


def checked(dotted: str, item: Field, value: Any, *, floats: bool = False) -> Any:
  """`value` as field `item` of config.<dotted> holds it (a list of a `ManyOf` as a tuple; with
  `floats`, an integer of a real `Range` as a float), or a ConfigError naming config.<dotted>, the
  value, what the field accepts and its default (where that is a value it accepts)."""
  if value is REQUIRED:
    raise ConfigError(f"config.{dotted} is missing; set it to {accepts(item)} ({item.doc})")
  if (floats and isinstance(item.check, Range) and item.check.kind is float
      and isinstance(value, int) and not isinstance(value, bool)):
    value = float(value)
  problem = _problem(item, value)
  if problem:
    usable_default = not isinstance(item.default, _Shown) and not _problem(item, item.default)
    raise ConfigError(f"config.{dotted}={value!r}: {problem}"
                      + (f" (default {item.default!r})" if usable_default else ""))
  return tuple(value) if isinstance(item.check, ManyOf) else value


def _problem(item: Field, value: Any) -> str | None:
  """Why `item` refuses `value`, or None."""
  rule = item.check
  if isinstance(item.default, bool) or item.kind is bool:
    return None if isinstance(value, bool) else "must be True or False"
  if isinstance(rule, OneOf) and rule.registry:
    registry = getattr(registries, rule.registry)
    return None if isinstance(value, str) and value in registry else (
        f"unknown {registry.kind}; use one of {list(registry.names())}")
  if isinstance(rule, OneOf):
    return None if value in rule.values else f"must be {rule.describe()}"
  if rule is not None:
    return rule.problem(value)
  if isinstance(item.default, str):
    return None if isinstance(value, str) else "must be a string"
  if item.kind is not None and value is not None and not isinstance(value, item.kind):
    return f"must be a {item.kind.__name__} or None"
  return None


# The names the verifiers and environments define (they import more than this module may; a test
# keeps each equal to its module's).
EXTRACT_MODES = ("answer_or_boxed", "answer", "boxed", "last_number", "final_answer")  # math_answers
USE_EACH_MODES = ("exactly_once", "at_most_once")  # verifiers.logic
SCRIPTS = ("latin", "cjk", "han", "kana", "hangul", "cyrillic", "greek", "arabic", "hebrew",
           "devanagari", "thai")  # verifiers.format.SCRIPT_NAME_PREFIXES
LENGTH_METHODS = ("dapo", "kimi", "lcpo", "lcpo_max")  # verifiers.rewards
CODE_ISOLATIONS = ("namespaces", "rlimits_only")  # the code sandbox's
JUDGE_MODES = ("fallback", "alone")  # verifiers.judge.MODES
JUDGEABLE_STATUSES = ("wrong", "no_answer", "multiple_answers", "hedged", "unevaluated",
                      "unparseable", "too_large", "timeout")  # verifiers.judge: never "correct"
JUDGE_TEMPLATES = ("yes_no", "score")  # verifiers.judge.TEMPLATES
REWARD_MODEL_TRANSFORMS = ("none", "sigmoid")  # verifiers.reward_model_part.TRANSFORMS

_TAG = Text(r"[A-Za-z][A-Za-z0-9_\-]*", "a tag name: a letter, then letters, digits, '_' or '-' "
            "(e.g. 'think')")
_IDENTIFIER = Text(r"[A-Za-z_][A-Za-z0-9_]*", "an identifier (e.g. 'correct')")
_SECONDS = _POSITIVE


def _model_path(what: str) -> Text:
  return Text(r"(?s).+", f"{what} (required)")


# Every reward part has these two besides its kind's settings (rewards.build_parts reads them).
PART_WEIGHT = Field("weight", REQUIRED, "its weight in the total reward: Σ weight · value",
                    Range(float), kind=float)
PART_KIND = Field("kind", _Shown("(the part's name)"), "which kind of part (a name of "
                  "registry.REWARD_PARTS); two parts of one kind need distinct names and a kind",
                  OneOf(registry="REWARD_PARTS"))

REWARD_PARTS: dict[str, Group] = {group.choice: group for group in (
    Group("rewards.<name>", "correct", "1 if the answer is right, by the named verifier; at "
          "most one part of this kind.", (
        Field("verifier", "math", "math | countdown | reasoning_gym | code | auto (routes by "
              "task kind)", OneOf(registry="VERIFIERS")),
        Field("extract", "answer_or_boxed", "where the answer is read (none: countdown / "
              "reasoning_gym read the whole answer span's text as is; not for math)",
              OneOf(EXTRACT_MODES + ("none",))),
        Field("timeout_s", 5.0, "seconds one check may take (math-verify, code tests)", _SECONDS),
        Field("answer_tag", "answer", "the tag the answer is written in", _TAG),
        Field("think_tag", "think", "math: the reasoning tag, whose content never answers "
              "(must differ from answer_tag)", _TAG),
        Field("use_each", "exactly_once", "countdown: how often each given number may be used",
              OneOf(USE_EACH_MODES)),
        Field("allow_unary_minus", False, "countdown: accept -x in the expression"),
        Field("success_threshold", 1.0, "reasoning_gym: the dataset's score at or above which "
              "the answer counts as right", _FRACTION),
        Field("partial_credit", False, "code: the share of tests passed instead of "
              "all-or-nothing"),
        Field("code_isolation", "namespaces", "code: the sandbox's isolation; rlimits_only is an "
              "explicit, logged acceptance of weaker isolation", OneOf(CODE_ISOLATIONS)),
    )),
    Group("rewards.<name>", "format", "1 if the completion has the "
          "<think>…</think><answer>…</answer> shape (DeepSeek-R1 2025).", (
        Field("think_tag", "think", "the reasoning tag (must differ from answer_tag)", _TAG),
        Field("answer_tag", "answer", "the answer tag", _TAG),
        Field("require_nonempty_think", True, "the reasoning span must hold text"),
        Field("require_nonempty_answer", True, "the answer span must hold text"),
        Field("think_open_in_prompt", False, "the prompt already opened the reasoning tag"),
        Field("pattern", None, "a regular expression the whole completion must match instead "
              "of the tag shape (None = the tag shape)", kind=str),
    )),
    Group("rewards.<name>", "language", "Share of the reasoning written in one script "
          "(DeepSeek-R1 2025, language consistency).", (
        Field("script", "latin", "the script the reasoning should be written in",
              OneOf(SCRIPTS)),
        Field("think_tag", "think", "the reasoning tag", _TAG),
        Field("think_open_in_prompt", False, "the prompt already opened the reasoning tag"),
    )),
    Group("rewards.<name>", "length", "Length shaping: dapo (overlong penalty, DAPO 2025), kimi "
          "(Kimi k1.5 2025, per group), lcpo / lcpo_max (L1, Aggarwal & Welleck 2025); kimi and "
          "lcpo_max need a correct part.", (
        Field("method", "dapo", "the shaping", OneOf(LENGTH_METHODS)),
        Field("cache_len", None, "dapo: L_cache, the soft zone before the limit, in tokens "
              "(required by dapo)", Range(int, 1, none_ok=True), kind=int),
        Field("max_len", None, "dapo: L_max in tokens (None = the record's max_new_tokens)",
              Range(int, 1, none_ok=True), kind=int),
        Field("alpha", 3e-4, "lcpo / lcpo_max: penalty per token off the target", Range(float)),
        Field("delta", 0.5, "lcpo_max: the reward's floor", Range(float)),
        Field("target_tokens", None, "lcpo / lcpo_max: the length target (None = the record's "
              "metadata target_tokens)", Range(int, 1, none_ok=True), kind=int),
    )),
    Group("rewards.<name>", "environment", "A part of a multi-turn episode's outcome as its "
          "environment reported it (environment.name).", (
        Field("part", "correct", "the outcome part read", _IDENTIFIER),
    )),
    Group("rewards.<name>", "judge", "An LLM judge's verdict on the final answer "
          "(reasoning_rl/verifiers/judge.py), alone or where the math verifier cannot read it; "
          "model-scored on the main process.", (
        Field("model", "", "the judge model: an HF directory, .gguf or run workdir, as "
              "model.path", _model_path("a model path (HF dir, .gguf or run workdir), as "
                                        "config.model.path")),
        Field("dtype", "float32", "the judge's compute dtype", OneOf(_DTYPES)),
        Field("mode", "fallback", "fallback: the judge decides only where the rule verifier's "
              "status is in fallback_statuses; alone: every answer is judged", OneOf(JUDGE_MODES)),
        Field("fallback_statuses", ("no_answer", "unparseable", "unevaluated", "timeout"),
              "fallback: the rule verifier's statuses the judge decides (correct is never "
              "overruled)", ManyOf(JUDGEABLE_STATUSES)),
        Field("template", "yes_no", "yes_no (Yes / No: 1 / 0) | score (an integer 0-10, / 10)",
              OneOf(JUDGE_TEMPLATES)),
        Field("max_new_tokens", 8, "the judge's decode budget", _COUNT),
        Field("max_prompt_tokens", 512, "the judge engine's prefill length (longer prompts keep "
              "their last tokens)", _COUNT),
        Field("batch_size", 16, "the judge engine's decode slots", _COUNT),
        Field("cache_size", 4096, "verdicts kept (least recently used out)",
              _int(0, meaning="0 = no cache")),
        Field("extract", "answer_or_boxed", "how the answer is read, as the correct part's",
              OneOf(EXTRACT_MODES)),
        Field("answer_tag", "answer", "the answer tag", _TAG),
        Field("think_tag", "think", "the reasoning tag (must differ from answer_tag)", _TAG),
        Field("timeout_s", 5.0, "seconds the rule verifier may take", _SECONDS),
    )),
    Group("rewards.<name>", "reward_model", "A Hugging Face Llama / Qwen2 "
          "*ForSequenceClassification checkpoint's score of (prompt, completion) "
          "(reasoning_rl/verifiers/reward_model_part.py); model-scored on the main process.", (
        Field("model", "", "the checkpoint directory (local)", _model_path(
            "the directory of a Hugging Face LlamaForSequenceClassification or "
            "Qwen2ForSequenceClassification checkpoint")),
        Field("dtype", "float32", "compute dtype", OneOf(_DTYPES)),
        Field("label", 0, "which output of the head is the reward", _int(0)),
        Field("transform", "none", "none (the raw score) | sigmoid",
              OneOf(REWARD_MODEL_TRANSFORMS)),
        Field("max_tokens", 2048, "longest scored sequence (a longer one keeps its last tokens)",
              _COUNT),
        Field("batch_size", 16, "rows per forward", _COUNT),
    )),
)}

ENVIRONMENTS: dict[str, Group] = {group.choice: group for group in (
    Group("environment.settings", "calculator", "Exact arithmetic after '=' "
          "(reasoning_rl/environments/calculator.py).", (
        Field("max_calls", 8, "calculator calls per episode", _int(1, 256)),
    )),
    Group("environment.settings", "guess_number", "Find a secret integer from higher / lower "
          "answers (reasoning_rl/environments/guess_number.py).", (
        Field("max_guesses", 10, "guesses per episode", _int(1, 1000)),
    )),
    Group("environment.settings", "python_tool", "<python> blocks run in the code sandbox; the "
          "task's verifier judges the final turn (reasoning_rl/environments/python_tool.py).", (
        Field("max_calls", 4, "programs run per episode", _int(1, 64)),
        Field("timeout_s", 5.0, "wall deadline of one program", Range(float, 0, 60,
                                                                      low_open=True)),
        Field("observation_max_chars", 1024, "characters of output shown", _int(16, 65536)),
        Field("memory_mb", 1024, "memory of all the program's processes together",
              _int(128, 65536)),
        Field("keep_state", False, "every earlier cell runs again first (one interpreter's "
              "state)"),
        Field("isolation", "namespaces", "the sandbox's isolation", OneOf(CODE_ISOLATIONS)),
        Field("verifier", "math", "the correct verifier of the final turn (not code)",
              OneOf(registry="VERIFIERS")),
        Field("extract", "final_answer", "where the verifier reads the answer",
              OneOf(EXTRACT_MODES + ("none",))),
        Field("answer_tag", "answer", "the answer tag", _TAG),
        Field("verify_timeout_s", 5.0, "seconds the verifier may take",
              Range(float, 0, 60, low_open=True)),
    )),
)}

# Every Group, in the order --help and docs/config.md list them.
GROUPS: tuple[Group, ...] = tuple(REWARD_PARTS.values()) + tuple(ENVIRONMENTS.values())


def fields() -> dict[str, Field]:
  """{dotted name: Field} in declaration order."""
  return {(f"{section.name}.{field.name}" if section.name else field.name): field
          for section in SECTIONS for field in section.fields}


FIELDS: dict[str, Field] = fields()


def field(dotted: str) -> Field:
  try:
    return FIELDS[dotted]
  except KeyError:
    raise KeyError(f"config.{dotted} is not a declared field") from None


def default(dotted: str):
  return FIELDS[dotted].default


def base_config() -> ml_collections.ConfigDict:
  """A config holding every field's default: what config files start from."""
  root = ml_collections.ConfigDict()
  for section in SECTIONS:
    node = root
    for part in filter(None, section.name.split(".")):
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    if section.name == "rewards":
      root.rewards = ml_collections.ConfigDict(DEFAULT_REWARDS)
      continue
    for item in section.fields:
      if item.typed_none:
        node[item.name] = ml_collections.config_dict.placeholder(item.kind)
      elif isinstance(item.default, dict):
        node[item.name] = ml_collections.ConfigDict(dict(item.default))
      else:
        node[item.name] = item.default
  return root


def value_at(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def values_of(view_class, config, **derived) -> dict[str, Any]:
  """The keyword arguments of a typed view (a dataclass whose fields carry `source` metadata
  naming their config field, as `sourced` makes) read from `config`, plus `derived` values
  for the fields that are not one config field each."""
  out = {}
  for item in dataclasses.fields(view_class):
    source = item.metadata.get("source")
    if item.name in derived:
      out[item.name] = derived[item.name]
    elif source:
      out[item.name] = value_at(config, source)
  unknown = set(derived) - {item.name for item in dataclasses.fields(view_class)}
  if unknown:
    raise TypeError(f"{view_class.__name__} has no fields {sorted(unknown)}")
  return out


_UNSET = object()


def sourced(dotted: str, *, default_factory: Callable | None = None, default: Any = _UNSET):
  """A typed view's field that IS config field `dotted`: same default, read by `values_of`.
  `default` replaces the config's where the config's means "chosen at start-up"
  (`step_layout`): a view holds resolved values only."""
  declared = field(dotted)
  if default_factory is not None:
    return dataclasses.field(default_factory=default_factory, metadata={"source": dotted})
  if default is _UNSET:
    return dataclasses.field(default=declared.default, metadata={"source": dotted})
  # the config's own default (None / 0: open) is kept beside it for the schema test
  return dataclasses.field(default=default, metadata={"source": dotted,
                                                      "open_default": declared.default})


def _kind_name(item: Field) -> str:
  value = item.default
  if isinstance(value, _Shown):
    return (item.kind or str).__name__
  kind = item.kind or type(value)
  if isinstance(value, dict):
    return "dict"
  if isinstance(value, tuple):
    return "tuple"
  return ("bool" if kind is bool else kind.__name__) + (" | None" if value is None else "")


def accepts(item: Field) -> str:
  if isinstance(item.default, bool) or item.kind is bool:
    return "True or False" + (" or None" if item.default is None else "")
  if item.check is not None:
    return item.check.describe()
  return ""


def listing() -> list[tuple[str, str, str, list[tuple[str, Field]]]]:
  """What --help and docs/config.md show, in order: (path, qualifier, doc, [(dotted name,
  field)]) for every section, then what every reward part sets, then every Group."""
  out = [(section.name, "", section.doc,
          [(f"{section.name}.{item.name}" if section.name else item.name, item)
           for item in section.fields]) for section in SECTIONS]
  out.append(("rewards.<name>", "(every kind)", "Every reward part sets its weight; its kind is "
              "its name unless given. The settings of each kind follow.",
              [(f"rewards.<name>.{item.name}", item) for item in (PART_WEIGHT, PART_KIND)]))
  for group in GROUPS:
    out.append((group.path, group.qualifier, group.doc,
                [(f"{group.path}.{item.name}", item) for item in group.fields]))
  return out


def help_text() -> str:
  """Every field, grouped by section, then every reward-part kind's and environment's settings:
  --config.NAME=DEFAULT, type, accepted values, meaning."""
  lines = ["Config fields (override any with --config.NAME=VALUE):"]
  for path, qualifier, doc, entries in listing():
    lines.append("")
    heading = (path or "run") + (f" {qualifier}" if qualifier else "")
    lines.append(textwrap.fill(f"[{heading}] {doc}", width=100))
    for dotted, item in entries:
      rule = accepts(item)
      lines.append(f"  --config.{dotted}={item.default!r}  ({_kind_name(item)}"
                   f"{'; ' + rule if rule else ''})")
      lines.append(textwrap.fill(item.doc, width=100, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6))
  return "\n".join(lines) + "\n"


def markdown_table() -> str:
  """docs/config.md: one table per section and Group (a test keeps the file equal to this)."""
  out = ["# Config fields", "",
         "Generated from `reasoning_rl/config_schema.py` (`python -m reasoning_rl.config_schema "
         "> docs/config.md`); `python launch/train.py --help` prints the same. Override any "
         "field with `--config.NAME=VALUE`.", ""]
  for path, qualifier, doc, entries in listing():
    out += [f"## `{path or '(top level)'}`" + (f" {qualifier}" if qualifier else ""), "", doc, ""]
    if not entries:
      continue
    out += ["| field | default | accepts | meaning |", "|---|---|---|---|"]
    for _, item in entries:
      text = item.doc.replace("|", "\\|")
      rule = accepts(item).replace("|", "\\|")
      shown = repr(item.default).replace("|", "\\|")
      out.append(f"| `{item.name}` | `{shown}` | {rule} | {text} |")
    out.append("")
  return "\n".join(out)


if __name__ == "__main__":
  print(markdown_table(), end="")
