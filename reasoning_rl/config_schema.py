"""Every training-config field, declared once: its section, default, meaning and accepted values.

`base_config()`, the range checks of `config.validate`, the choice checks, `launch/train.py --help`
and docs/config.md (`config_help`) are all derived from `SECTIONS`, and from `config_groups.GROUPS`
for the settings given as a dict per pluggable choice (each reward-part kind's at
config.rewards.<name>, each environment's at config.environment.settings), declared with the same
`Field`s and checked by the same `checked` (`config_fields`: how a field is declared and checked); the trainer's typed views of a section
(`rl.step_config.StepConfig`, `sampler.SamplingParams`, `lora.LoraSettings`) take their defaults from here
and their values from the config by the same names (`source`). Adding a field is one `Field` line.

JAX-free on purpose: `--help` and config validation run before any backend starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import ml_collections

from reasoning_rl.config_fields import (COUNT, FRACTION, NON_NEGATIVE, POSITIVE, Field, OneOf,
                                        Range, Satisfies, Section, Text, int_range)


_IMPORT_PATH_OR_EMPTY = r"([A-Za-z_][\w.]*:[A-Za-z_][\w.]*)?"
DTYPES = ("float32", "bfloat16")
# The kernels layer's names (reasoning_rl/kernels imports JAX; a test keeps the two equal).
TRAINING_KERNELS = ("auto", "reference", "splash", "pallas_gpu")
PAGED_KERNELS = ("auto", "gather", "pallas_tpu")
# What the backward pass recomputes (models.transformer reads them from here).
REMAT_POLICIES = ("none", "full", "save_matmuls")

SECTIONS: tuple[Section, ...] = (
    Section("", "The run.", (
        Field("workdir", "", "where metrics.jsonl, tensorboard/, checkpoints/, rollouts/ and "
              "model/ go (a local path or gs://)"),
        Field("seed", 0, "root of every random stream (sampling, init, data order)",
              int_range(0, 2**63 - 1)),  # a C long: jax.random.key's bound
        Field("total_steps", 10, "RL steps (one rollout batch + its updates each)", COUNT),
        Field("stage", "rl", "rl | sft (cold-start SFT on sft.data_path) | rejection_sft "
              "(sample from the model, keep verified-correct traces, fine-tune on them). "
              "Checkpoints of every stage load as models: a stage starts from the previous one "
              "with --config.model.path=PREVIOUS_WORKDIR", OneOf(("rl", "sft", "rejection_sft"))),
        Field("dry_run", False, "print the memory / throughput plan of the target slice and exit"),
        Field("keep_freed_host_memory", None, "Linux/glibc: keep freed host memory for reuse "
              "instead of returning it to the OS, so a CPU step's multi-GB temporaries are not "
              "page-faulted (and zeroed) afresh every step; the process then holds its peak host "
              "memory until it exits (reasoning_rl/host_memory.py). None = on, except in agent "
              "runs (agent.entry), whose sampler compiles programs for new conversation lengths "
              "all run long and whose kept heap then grows with each of them",
              kind=bool, typed_none=True),
        Field("beta", 0.0, "KL weight against the frozen reference; 0 never loads the reference",
              Range(float, 0, meaning="0 = no KL term")),
    )),
    Section("model", "The policy: path = a Hugging Face directory, a .gguf file or a run's "
            "workdir; empty = a random model built from model.random with the tokenizer named "
            "by model.tokenizer.", (
        Field("path", "", "HF directory, .gguf file or training run to start from"),
        Field("tokenizer", "", "for a random model: a tokenizer path, or debug_arithmetic (a "
              "built-in character vocabulary for the synthetic debug task; debug_arithmetic_chat: "
              "the same with a chat template, for agent runs)"),
        Field("dtype", "float32", "compute dtype (activations, matmuls; the sampler's weights "
              "and KV cache)", OneOf(DTYPES)),
        Field("weight_dtype", "float32", "the trainer's master weights and AdamW moments "
              "(reasoning_rl/precision.py): float32 keeps every update; bfloat16 (pure bf16, "
              "needs dtype=bfloat16) halves that memory but rounds small updates away. "
              "Gradients are summed over micro-batches in float32 either way; with LoRA the "
              "frozen base is held in dtype and the adapters in float32", OneOf(DTYPES)),
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
        Field("num_experts", 0, "experts per layer (E)", int_range(0, meaning="0 = off")),
        Field("experts_per_token", 2, "experts each token is sent to (k)", COUNT),
    )),
    Section("model.random", "Shape of the random model (model.path empty); any other "
            "ModelConfig setting may be added.", (
        Field("model_type", "qwen2", "architecture family (llama, qwen2, qwen3, gemma, gemma2, "
              "gemma3)"),
        Field("hidden_size", 64, "model width (residual stream)", COUNT),
        Field("intermediate_size", 128, "width of the MLP's hidden layer", COUNT),
        Field("num_layers", 2, "transformer blocks", COUNT),
        Field("num_heads", 4, "query heads", COUNT),
        Field("num_kv_heads", 2, "key/value heads (grouped-query attention)", COUNT),
        Field("head_dim", 16, "width of one head", COUNT),
        Field("tie_word_embeddings", True, "the output projection is the embedding's transpose"),
        Field("attention_bias", True, "biases on the q/k/v projections (Qwen2)"),
    )),
    Section("lora", "LoRA / QLoRA (reasoning_rl/lora.py); rank 0 = full fine-tuning.", (
        Field("rank", 0, "adapter rank r", int_range(0, meaning="0 = full fine-tuning")),
        Field("alpha", 16.0, "adapters scale by alpha / rank", POSITIVE),
        Field("target_modules", r"layers/\d+/(attn|mlp)", "regex (full match) over module "
              "paths layers/<i>/attn and layers/<i>/mlp"),
        Field("base_quantization", "", "quantize the frozen base (QLoRA)",
              OneOf(("", "int8", "nf4"))),
        Field("quantization_tile", 64, "NF4 block size along the contracting axis",
              int_range(0, meaning="0 = one scale per channel")),
        Field("sampler_weights", "adapters", "what the sampler gets after each step: the "
              "adapters, or the weights with the adapters folded in",
              OneOf(("adapters", "merged"))),
    )),
    Section("data", "Prompts. A source: kind = a name of registry.TASK_SOURCES "
            "(synthetic_arithmetic | reasoning_gym | jsonl …) plus its settings.", (
        Field("train", dict(kind="synthetic_arithmetic", seed=0), "training prompt source "
              "(kind plus its settings, listed per kind after the sections)"),
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
        Field("num_prompts", 4, "P prompts per step", COUNT),
        Field("num_samples", 4, "G completions per prompt (group size)", COUNT),
        Field("max_new_tokens", 12, "completion budget", COUNT),
        Field("temperature", 1.0, "sampling temperature", Range(float, 0, meaning="0 = greedy")),
        Field("top_p", 1.0, "nucleus filter (1 = off)", Range(float, 0, 1, low_open=True)),
        Field("top_k", 0, "keep the k likeliest tokens", int_range(0, meaning="0 = off")),
        Field("min_p", 0.0, "keep p >= min_p * p_max after temperature (Nguyen et al. 2024); "
              "0 = off", FRACTION),
        Field("stop_strings", ("</answer>",), "a completion ends after the first of these"),
        Field("max_prefill_length", 32, "longest prompt, in tokens (prompts are bucketed)",
              COUNT),
        Field("max_concurrent_decodes", 16, "decode slots", COUNT),
        Field("steps_per_call", 16, "decode steps per host round trip", COUNT),
        Field("kv_page_size", 0, "a paged KV cache (sampler/paged.py): cache entries per page; "
              "pages are taken as sequences grow and returned when they end, and a group's "
              "prompt pages are shared by its samples", int_range(0, meaning="0 = one contiguous "
                                                              "cache row per slot")),
        Field("kv_pages", 0, "pages in the paged cache's pool (with rollout.kv_page_size)",
              int_range(0, meaning="0 = room for every slot's whole length")),
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
              "from the sampler without recomputing it. Single-turn rollouts and agent runs' turns "
              "(agent.entry, each verified before its reply is sent; docs/agents.md), not "
              "in-process environments; engine backend only"),
        Field("weight_quantization", "none", "the sampler decodes with quantized weights "
              "(reasoning_rl/sampler/quantized.py, qwix PTQ; docs/off_policy.md): int8 or fp8 "
              "(float8_e4m3fn) per output channel for every projection of the blocks, "
              "re-quantized from the trainer's weights at each weight sync, which sends the "
              "quantized form; embeddings, LM head, norms and the KV cache keep model.dtype, and "
              "the trainer its own weights. The rollouts' μ is then the quantized model, so the "
              "loss always corrects against it (algo.is_correction none means token-truncate). "
              "Not with rollout.exact_logprobs, MoE or latent-attention models, "
              "model.scan_layers, or lora.sampler_weights='adapters'",
              OneOf(("none", "int8", "fp8"))),
    )),
    Section("environment", "Multi-turn rollouts (reasoning_rl/sampler/multiturn.py): the model "
            "acts in an environment (a tool, a game) over several turns; observation tokens are "
            "context, not trained on. rollout.max_new_tokens then bounds a whole episode's "
            "completion, observations included.", (
        Field("name", "", "empty = single-turn completions; else a name of "
              "registry.ENVIRONMENTS (python_tool, guess_number, …)"),
        Field("settings", {}, "the environment's own settings (listed per environment below, "
              "after the sections)"),
        Field("max_turns", 4, "model turns per episode", COUNT),
        Field("turn_tokens", 0, "model tokens per turn",
              int_range(0, meaning="0 = rollout.max_new_tokens")),
        Field("observation_format", "inline", "inline (the observation inside the assistant's "
              "message, ToRL / ReTool style), chat (a tool turn of the tokenizer's chat "
              "template) or raw (the text as it is, e.g. a calculator's value after '=')",
              OneOf(("inline", "chat", "raw"))),
        Field("step_workers", 8, "environment steps run at once (threads)", COUNT),
    )),
    Section("agent", "Agent rollouts (reasoning_rl/agents, docs/agents.md): a program of your "
            "own plays each episode through an OpenAI-compatible rollout server, and the run "
            "trains on the exact tokens it made the model see and write.", (
        Field("entry", "", "empty = the built-in rollouts; else 'module:function', an "
              "`async def run(client, example) -> float | dict[str, float]` given an "
              "openai.AsyncOpenAI client of its own session and one task example"),
        Field("history_mismatch", "split", "a request whose rendered prompt does not extend "
              "its session's tokens (the chat template rewrote history, e.g. Qwen3 dropping "
              "earlier <think> blocks): split = start a new segment there (an episode's first "
              "segment trains in its group's row, the others in agent.segment_rows); "
              "refuse = answer HTTP 400 with the reason",
              OneOf(("split", "refuse"))),
        Field("segment_rows", 0, "batch rows added to every step for the segments of split "
              "episodes (history_mismatch='split') past each episode's first, each trained with "
              "its episode's advantage and counted as a sequence of its own; segments beyond "
              "them are counted (episode/split_segments_dropped), not trained. 0 = none (only "
              "each episode's first segment trains). The step's "
              "batch has num_prompts x num_samples + segment_rows rows, so the mini- and "
              "micro-batch counts and the trainer's data devices must divide that sum",
              int_range(0)),
        Field("tool_syntax", "", "the tool-call syntax the model was trained on, for a chat "
              "template that shows none: hermes (<tool_call> JSON: Hermes, Qwen) | llama3 "
              "(Llama 3.1 JSON); the request's tools are then described in the system message "
              "and its tool history written in that syntax. Empty = read it from the template "
              "(a request with tools the template cannot render is answered HTTP 400)",
              OneOf(("", "hermes", "llama3"))),
        Field("episode_timeout_s", 300.0, "an episode running longer is dropped and counted "
              "(episode/failed_frac)", POSITIVE),
        Field("min_episodes_per_group", 2, "a prompt with fewer episodes that finished is "
              "skipped (at most rollout.num_samples)", COUNT),
        Field("max_failed_frac", 0.5, "a step whose share of failed episodes (raised or timed "
              "out) is above this stops the run (reasoning_rl/guards.py)",
              Range(float, 0, 1, meaning="1 = off")),
        # The hub adapters' settings (docs/agent_hubs.md): read only by an entry marked
        # takes_agent_settings (reasoning_rl/agents/entry.py refuses them for any other).
        Field("env_id", "", "hub adapters, verifiers: the taskset's id as vf-eval takes it (an "
              "importable package exporting a verifiers Taskset)"),
        Field("environment", "", "hub adapters, OpenEnv: the Environment class, "
              "'package.module:Class'", Text(_IMPORT_PATH_OR_EMPTY, "'package.module:Class'")),
        Field("env_args", {}, "hub adapters: the environment's own arguments (verifiers: its "
              "EnvConfig fields, e.g. {'taskset': {...}}; OpenEnv: the constructor's keywords)",
              Satisfies(lambda value: isinstance(value, dict), "a dict of the environment's "
                        "arguments")),
        Field("transport", "in_process", "hub adapters, OpenEnv: in_process (a fresh instance "
              "per episode) or server (OpenEnv's own app on 127.0.0.1, a WebSocket session per "
              "episode)", OneOf(("in_process", "server"))),
        Field("action", "", "hub adapters, OpenEnv: 'module:function' turning the model's reply "
              "into the Action's fields; empty = a JSON object reply, else the reply as the "
              "Action's one required field", Text(_IMPORT_PATH_OR_EMPTY, "'module:function'")),
        Field("observation", "", "hub adapters, OpenEnv: 'module:function' turning an "
              "observation's fields into the next user message; empty = its one text field, "
              "else its fields as JSON", Text(_IMPORT_PATH_OR_EMPTY, "'module:function'")),
        Field("system_prompt", "", "hub adapters, OpenEnv: a system message opening every "
              "episode (empty = none)"),
        Field("max_turns", 8, "hub adapters, OpenEnv: model turns per episode at most", COUNT),
        Field("turn_tokens", 0, "hub adapters, OpenEnv: max_tokens of each model turn",
              int_range(0, meaning="0 = none: a turn may take what is left of the episode's "
                        "rollout.max_new_tokens")),
        Field("model", "policy", "hub adapters: the model name the environment's requests "
              "send (the rollout server answers any)", Text(r"(?s).+", "a non-empty name")),
    )),
    Section("rewards", "Rewards: a weighted sum of named parts, each {weight, kind, …settings of "
            "its kind} (reasoning_rl/verifiers/rewards.py); the settings of every kind are listed "
            "below, after the sections.", ()),
    Section("verifier", "Scoring completions (reasoning_rl/workers).", (
        Field("num_workers", 2, "verifier worker processes",
              int_range(0, meaning="0 = score in this process")),
        Field("item_timeout_s", 10.0, "seconds one completion may take to score", POSITIVE),
        Field("redteam", True, "probe the rewards with known exploits before training"),
        Field("allow_exploits", False, "explicit, logged override of a failed red team"),
    )),
    Section("teacher", "On-policy distillation (docs/distillation.md, reasoning_rl/rl/"
            "distillation.py): a frozen teacher scores every token the student samples, and "
            "each token's advantage is −kl_coef · (log μ − log π_teacher), the per-token "
            "reverse KL (Agarwal et al. 2024, GKD; Qwen3; Thinking Machines 2025), alone or "
            "added to the verifiable-reward advantage. The teacher sits on the sampler's "
            "devices and needs the student's tokenizer.", (
        Field("path", "", "the teacher: a Hugging Face directory, a .gguf file or a training "
              "run's workdir (its newest checkpoint); empty = no distillation"),
        Field("kl_coef", 1.0, "weight c of the distillation advantage −c · (log μ − log "
              "π_teacher) of each sampled token", POSITIVE),
        Field("reward_weight", 0.0, "weight of the verifiable-reward (group) advantage added "
              "to each token's distillation advantage (prime-rl's adv_tau)",
              Range(float, 0, meaning="0 = distillation alone")),
        Field("discount", 0.0, "γ: a token's distillation advantage also sums the later "
              "tokens' reverse KL, discounted by γ (Tinker's kl_discount_factor)",
              Range(float, 0, 1, meaning="0 = each token's own")),
        Field("max_batch", 16, "completions per teacher forward (memory: one forward holds "
              "max_batch rows of max_prefill_length + max_new_tokens positions)", COUNT),
    )),
    Section("algo", "Advantages and loss (reasoning_rl/rl).", (
        Field("name", "grpo", "grpo (any group estimator) | ppo (value head + GAE)",
              OneOf(("grpo", "ppo"))),
        Field("estimator", "grpo", "group advantage estimator (grpo | dr_grpo | rloo | "
              "reinforce_pp)", OneOf(registry="ADVANTAGE_ESTIMATORS")),
        Field("kl_estimator", "k3", "KL estimator of the beta term",
              OneOf(registry="KL_ESTIMATORS")),
        Field("epsilon_low", 0.2, "clip floor 1 - epsilon_low of the ratio", FRACTION),
        Field("epsilon_high", 0.2, "clip ceiling 1 + epsilon_high (> epsilon_low is DAPO's "
              "clip-higher)", NON_NEGATIVE),
        Field("dual_clip", None, "dual-clip bound c on negative advantages",
              Range(float, 1, low_open=True, none_ok=True, meaning="None = off"), kind=float),
        Field("loss_agg", "seq-mean-token-mean", "how token losses become the batch loss",
              OneOf(registry="LOSS_AGGREGATIONS")),
        Field("entropy_coef", 0.0, "entropy bonus weight", Range(float)),
        Field("num_iterations", 1, "μ (GRPO's notation, Shao et al. 2024): passes over each "
              "rollout batch against a fixed π_old; with μ·M > 1 the ratio moves off 1 after "
              "the first update, so clipping can fire", COUNT),
        Field("num_mini_batches", 1, "M: optimizer updates per pass, each on a disjoint 1/M of "
              "the batch's rows (PPO mini-batches); the learning-rate schedule advances per "
              "update, warmup_steps / total_steps stay in RL steps (scaled by μ·M)", COUNT),
        Field("num_micro_batches", 0, "gradient accumulation inside each update (memory, not "
              "maths); 0 = chosen at start-up for the machine (reasoning_rl/step_layout.py): on "
              "TPU / GPU the fewest whose step fits the device's memory, on a CPU micro-batches "
              "of at most ~1k positions", int_range(0, meaning="0 = chosen for the machine")),
        Field("logprob_chunk", 128, "time steps projected to the vocabulary at once", COUNT),
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
        Field("packed_row_factor", 0, "k: packed rows are k × (max_prefill_length + "
              "max_new_tokens) long (R / k per micro-batch): long sequences waste less of a "
              "row, attention costs k times more per token. 0 = chosen at start-up "
              "(reasoning_rl/step_layout.py): 2 with shared prompts, else 1",
              int_range(0, meaning="0 = chosen at start-up")),
        Field("shared_prompts", None, "packed rows lay out a prompt once for the completions "
              "of it they hold, each completion attending to that one copy (rl/packing.py): "
              "the same loss and gradients, fewer positions (a mixture of experts' auxiliary "
              "losses average over the positions computed). Needs the reference attention "
              "(every CPU run; model.attention_kernel='reference' elsewhere). None = chosen at "
              "start-up (reasoning_rl/step_layout.py)", kind=bool, typed_none=True),
        Field("loss_type", "ppo", "ppo: PPO's clipped token ratio (Schulman et al. 2017) | "
              "gspo / gspo-token: GSPO's length-normalised sequence ratio (Zheng et al. 2025) | "
              "cispo: clipped stop-gradient IS weight on a REINFORCE term (MiniMax-M1)",
              OneOf(registry="LOSS_TYPES")),
        Field("is_correction", "none", "correction for the sampler's log-probs differing from "
              "the trainer's (kernels, precision, staleness), weight w = π_old/μ per token: none "
              "| token-truncate | token-mask | sequence-truncate | sequence-mask with threshold "
              "is_threshold (TIS, Yao et al. 2025; IMPALA, Espeholt et al. 2018) | icepop (w "
              "inside [icepop_low, icepop_high], else 0: Ring-1T's IcePop); asynchronous rollouts "
              "always correct (none then means token-truncate); docs/off_policy.md",
              OneOf(registry="IS_CORRECTIONS")),
        Field("is_threshold", 2.0, "C of the importance correction", POSITIVE),
        Field("is_threshold_low", 0.0, "floor of the truncated weight: token-truncate and "
              "sequence-truncate clip it to [is_threshold_low, is_threshold] (NeMo-RL's TIS "
              "lower bound); below is_threshold", Range(float, 0, meaning="0 = no floor")),
        Field("icepop_low", 0.5, "IcePop's α: a token whose π_old/μ is below it gets no "
              "gradient (Ring-1T, arXiv:2510.18855); below icepop_high", NON_NEGATIVE),
        Field("icepop_high", 5.0, "IcePop's β: a token whose π_old/μ is above it gets no "
              "gradient", POSITIVE),
        Field("rejection", "none", "reject whole sequences too far off-policy (their policy "
              "gradient is 0; composes with is_correction, as verl's rollout_rs with its "
              "rollout_is): none | seq-geo-mean (exp(mean_t log π_old/μ) outside "
              "[rejection_geo_low, rejection_geo_high]) | seq-mean-k3 (mean_t of π_old/μ − 1 − "
              "log π_old/μ above rejection_k3_threshold); docs/off_policy.md",
              OneOf(registry="OFF_POLICY_REJECTIONS")),
        Field("rejection_geo_low", 0.999, "seq-geo-mean: lower bound of the geometric-mean "
              "ratio", Range(float, 0, 1, low_open=True)),
        Field("rejection_geo_high", 1.001, "seq-geo-mean: upper bound of the geometric-mean "
              "ratio", Range(float, 1)),
        Field("rejection_k3_threshold", 0.01, "seq-mean-k3: largest mean k3 (≈ KL(μ‖π_old) per "
              "token) a kept sequence may have", POSITIVE),
        Field("truncated_ratio", True, "the ratio of the distribution the sampler draws from "
              "(docs/off_policy.md): π_θ and π_old after the rollout's temperature / top_k / "
              "top_p / min_p, renormalised — exact for the policy actually sampled; False: the "
              "full-softmax ratio, biased when the rollout warps. Applied only when the rollout "
              "does (packed rows carry each position's settings)"),
        Field("vf_coef", 0.5, "ppo: value-loss weight (Schulman et al. 2017)", NON_NEGATIVE),
        Field("value_clip", 0.2, "ppo: value clip ε_v", POSITIVE),
        Field("gamma", 1.0, "ppo: discount γ (GAE, Schulman et al. 2016)", FRACTION),
        Field("gae_lambda", 0.95, "ppo: GAE λ", FRACTION),
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
        Field("learning_rate", 1e-3, "peak learning rate", NON_NEGATIVE),
        Field("warmup_steps", 0, "linear warm-up, in RL steps", int_range(0)),
        Field("final_lr_fraction", 0.1, "the cosine decays to this fraction of the peak",
              FRACTION),
        Field("weight_decay", 0.0, "decoupled weight decay", NON_NEGATIVE),
        Field("max_grad_norm", 1.0, "global gradient-norm clip (inf = off)",
              Range(float, 0, low_open=True, infinite_ok=True)),
        Field("b1", 0.9, "first-moment decay (Kingma & Ba 2015)",
              Range(float, 0, 1, high_open=True)),
        Field("b2", 0.999, "second-moment decay", Range(float, 0, 1, high_open=True)),
        Field("eps", 1e-8, "AdamW's denominator epsilon", POSITIVE),
    )),
    Section("dynamic_sampling", "DAPO dynamic sampling: sample extra prompts, drop groups whose "
            "rewards are all equal, refill.", (
        Field("enabled", False, "turn it on"),
        Field("max_rounds", 3, "sampling rounds per step before training on what is there "
              "(nothing: no update)",
              COUNT),
    )),
    Section("sft", "SFT stages (DeepSeek-AI 2025, §2.3): loss on completion tokens only.", (
        Field("data_path", "", 'JSONL rows {"prompt"|"question": …, "completion"|"response": …}'),
        Field("batch_size", 16, "rows per step; the data is walked in a seeded order, epoch by "
              "epoch", COUNT),
    )),
    Section("rejection", "Rejection-sampling SFT (stage = rejection_sft).", (
        Field("num_prompts", 64, "training prompts sampled from (data.train)", COUNT),
        Field("num_samples", 8, "samples per prompt", COUNT),
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
        Field("max_staleness", 1, "policy versions a trained batch may lag", int_range(0)),
    )),
    Section("partial_rollouts", "Partial rollouts (reasoning_rl/loop/partial_rollouts.py, "
            "docs/off_policy.md): a step trains on the first rollout.num_prompts groups to "
            "complete out of more in flight; samples still running continue under the next "
            "weights, each token keeping the version that drew it, corrected per token "
            "(algo.is_correction). Single process, single-turn, synchronous rollouts.", (
        Field("enabled", False, "on: long completions no longer hold up a step", kind=bool),
        Field("groups_in_flight", 0, "prompts in flight at once (more than rollout.num_prompts, "
              "or no round can end before all of them do)",
              int_range(0, meaning="0 = 2 x rollout.num_prompts")),
        Field("max_lag", 2, "policy versions a trained token may lag the weights training on "
              "it; a sample holding an older token restarts from its first token", int_range(0)),
    )),
    Section("mesh", "Devices: one list split into trainer and sampler slices, each its own "
            "(data, fsdp, tensor) mesh.", (
        Field("num_trainer_devices", 0, "devices of the trainer slice",
              int_range(0, meaning="0 = every device does both")),
        Field("trainer", (1, -1, 1), "trainer mesh (data, fsdp, tensor), or (data, fsdp, "
              "expert, tensor) to split a mixture of experts' experts (and the batch) over an "
              "expert axis (docs/moe.md); -1 = the rest"),
        Field("sampler", (1, 1, -1), "sampler mesh (data, fsdp, tensor); -1 = the rest"),
        Field("num_slices", 0, "TPU Multislice slices; N > 1 on devices without slices "
              "simulates N; on several slices mesh.trainer is one slice's mesh and the slices "
              "multiply its data axis", int_range(0, meaning="0 = the devices' own slices")),
    )),
    Section("target", "The slice the dry run plans for.", (
        Field("tpu", "cpu", "v4 | v5e | v5p | v6e | v7x | cpu"),
        Field("num_devices", 0, "JAX devices of one slice, one per chip (v7x: two)",
              int_range(0, meaning="0 = this machine's")),
        Field("num_slices", 1, "slices joined over the data-center network "
              "(launch/gcp/commands.py --num_slices)", COUNT),
    )),
    Section("resume", "A rerun on a workdir resumes it.", (
        Field("allow_changes", (), "fields that may differ from the run's first start "
              "(WORKDIR/run_config.json), e.g. (\"total_steps\",) — the schedule then stretches "
              "to the new total — or (\"eval.*\",); display and storage fields (logging.*, "
              "checkpoint cadence, verifier.num_workers) and the step's layout (algo.packing, "
              "algo.num_micro_batches) may always change"),
    )),
    Section("checkpoint", "Orbax checkpoints under WORKDIR/checkpoints.", (
        Field("every_steps", 5, "save cadence, in steps", COUNT),
        Field("every_minutes", 0.0, "also save at the first step that ends this long after the "
              "last save started, unless a save is still in flight (time-based, as MaxText and "
              "Tunix offer; a resume from any step is exact)", Range(float, 0, meaning="0 = off")),
        Field("keep", 2, "newest checkpoints kept", COUNT),
        Field("async_save", True, "write in the background while training goes on"),
        Field("stop_deadline_s", 25.0, "after SIGTERM / SIGINT the run finishes its step, saves "
              "and exits (143 / 130); still running this long after the signal (a step or a "
              "save too long for the notice, a store that stopped answering) it exits at once "
              "with the same code, resuming later from the previous checkpoint; keep it under "
              "the platform's grace (GKE and Spot TPU: 30 s)", POSITIVE),
    )),
    Section("storage", "Local paths and gs:// (docs/storage.md).", (
        Field("timeout_s", 120.0, "deadline of one storage call, its retries included (a "
              "transfer of B bytes gets B / 10 MiB/s more); past it the run exits 4 naming the "
              "call and the checkpoint a rerun resumes from", POSITIVE),
    )),
    Section("eval", "Held-out evaluation (data.eval).", (
        Field("every_steps", 0, "cadence in steps",
              int_range(0, meaning="0 = only before and after training")),
        Field("num_examples", 16, "held-out prompts", COUNT),
        Field("max_new_tokens", 0, "completion budget",
              int_range(0, meaning="0 = rollout.max_new_tokens")),
        Field("num_samples", 1, "samples per prompt; > 1 adds pass@k and maj@k (Chen et al. "
              "2021)", COUNT),
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
              int_range(0, meaning="0 = never")),
        Field("rollout_experts", True, "mixture-of-experts models: each rollout record keeps "
              "the experts the sampler routed its prompt and completion tokens to (`experts`: "
              "[tokens, sparse layers, k] as base64 bytes, docs/moe.md); ~1 byte per token, "
              "layer and k: turn off for long completions of large models"),
        Field("tensorboard", True, "write WORKDIR/tensorboard/"),
        Field("progress_bar", True, "one live progress line on the terminal"),
        Field("peak_flops_per_device", 4e11, "peak FLOP/s of one device, the denominator of "
              "throughput/rl_mfu", POSITIVE),
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
              int_range(0, meaning="0 = off")),
        Field("heldout_drop_evals", 0, "held-out accuracy fell at each of the last K "
              "evaluations while train reward rose", int_range(0, meaning="0 = off")),
        Field("max_length_growth", math.inf, "mean held-out length grew (relatively) this much "
              "more than accuracy over the last length_growth_evals evaluations",
              Range(float, 0, low_open=True, infinite_ok=True, meaning="inf = off")),
        Field("length_growth_evals", 2, "window of the length-growth guard", COUNT),
        Field("max_routing_collapse", 0.95, "mixture-of-experts models: a step whose busiest "
              "expert (in any sparse layer, over the step's tokens) took this share of the most "
              "it could take (max/mean tokens per expert divided by E/k; 1 = every token sent "
              "to the same k experts) stops the run", Range(float, 0, 1, low_open=True,
                                                            meaning="1 = off")),
    )),
)

# The rewards a fresh config scores with (a dict of named parts, each checked by its kind's Group).
DEFAULT_REWARDS = {"correct": {"weight": 1.0, "verifier": "math", "extract": "answer"}}


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
