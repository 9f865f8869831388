"""The project's one FLOP model: forward passes, the RL training step, and generation.

Trainer telemetry (`throughput/rl_mfu`), the dry-run planner and the benchmarks all count FLOPs
here, so their numbers agree.

Convention. A FLOP is one multiply or one add; a matmul of [a, b] by [b, c] costs 2·a·b·c.
Only matmuls are counted (norms, RoPE, softmax and activations are a few per cent on real models;
tests/test_flops.py bounds the gap against XLA's own count). A forward over a token costs
- 2·W for the decoder body, W = `matmul_weights(config)` the weights of every layer's q, k, v, o,
  gate, up and down projections (Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
  §2.1: a forward costs 2 FLOPs per weight per token; the embedding lookup is not a matmul); in a
  mixture of experts' sparse layer, the k experts a token goes to and the router (the active
  parameters), not all E experts;
- 2·D·V for the output projection, counted only for tokens that are projected to the vocabulary
  (the training step projects completion positions only, a prefill its last position only);
- 4·L·H·Dh per key the token's query is scored against: QKᵀ and the probability-weighted sum of V,
  2·H·Dh each per layer (Chowdhery et al. 2022, "PaLM", appendix B: 6N + 12·L·H·Q·T per trained
  token, whose forward third is this term with T keys). `context_length` is the number of keys
  scored, as the code executes it: the full masked [T, T] matrix of a training row, the attended
  cache slots of a decode step. Sliding-window and causal masks do not reduce it, because the
  reference kernel (`reasoning_rl.kernels.reference`, the CPU's) computes every score before
  masking; the flash kernels of TPU / GPU skip fully masked blocks, so there it is an upper bound.

A backward pass costs twice its forward (Kaplan et al. 2020, §2.1), so an update costs three
forwards. `StepFlops.training` counts model FLOPs — what the algorithm needs, the numerator of
MFU (PaLM appendix B); `StepFlops.recomputation` adds what the step also executes to save memory
(the log-prob chunks' logits are recomputed in every backward but the first chunk's,
`rl.logprobs`; with `remat`, the blocks' forward too), which the planner's time estimate
includes.
"""

from __future__ import annotations

import dataclasses

from reasoning_rl.models.config import ModelConfig


def matmul_weights(config: ModelConfig) -> int:
  """Weights one token multiplies through in the decoder body (all layers, no embedding, output
  projection, norms or biases; a sparse layer's k chosen experts and its router)."""
  c = config
  attention = c.hidden_size * c.head_dim * 2 * (c.num_heads + c.num_kv_heads)  # q, o; k, v
  if c.mla is not None:  # latent attention's projections (its norms are no matmul)
    m = c.mla
    query = (c.hidden_size * c.num_heads * m.qk_head_dim if m.q_lora_rank is None
             else m.q_lora_rank * (c.hidden_size + c.num_heads * m.qk_head_dim))
    attention = (query + c.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim)
                 + m.kv_lora_rank * c.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
                 + c.num_heads * m.v_head_dim * c.hidden_size)
  return c.num_layers * attention + sum(mlp_weights(c, layer) for layer in range(c.num_layers))


def mlp_weights(config: ModelConfig, layer: int) -> int:
  """Weights one token multiplies through in layer `layer`'s MLP: gate, up and down, of the dense
  MLP or of each of the k experts it is routed to (+ the router)."""
  c = config
  if not c.layer_is_sparse(layer):
    return 3 * c.hidden_size * c.intermediate_size
  moe = c.moe
  return (moe.experts_per_token * 3 * c.hidden_size * moe.intermediate_size
          + c.hidden_size * moe.num_experts)


def down_projection_weights(config: ModelConfig, layer: int) -> int:
  """Weights one token multiplies through in layer `layer`'s down projection(s)."""
  if config.layer_is_sparse(layer):
    return config.moe.experts_per_token * config.hidden_size * config.moe.intermediate_size
  return config.hidden_size * config.intermediate_size


def attention_flops_per_key(config: ModelConfig) -> int:
  """FLOPs of one query-key pair over all layers: scores plus the weighted sum of values (latent
  attention: scores over qk_nope + qk_rope dimensions, values of v_head_dim, as the training
  forward rebuilds them)."""
  if config.mla is not None:
    m = config.mla
    return 2 * config.num_layers * config.num_heads * (m.qk_head_dim + m.v_head_dim)
  return 4 * config.num_layers * config.num_heads * config.head_dim


def output_projection_flops(config: ModelConfig, projected_tokens: float) -> float:
  """FLOPs of projecting `projected_tokens` hidden states to the vocabulary."""
  return 2.0 * config.hidden_size * config.vocab_size * projected_tokens


def forward_flops(config: ModelConfig, num_tokens: float, context_length: float = 0, *,
                  projected_tokens: float | None = None) -> float:
  """Forward FLOPs of `num_tokens` tokens, each scored against `context_length` keys.

  projected_tokens: how many of them are projected to the vocabulary (default: all of them).
  A full forward over B rows of S tokens is `forward_flops(c, B * S, S)`.
  """
  projected = num_tokens if projected_tokens is None else projected_tokens
  return (2.0 * matmul_weights(config) * num_tokens
          + output_projection_flops(config, projected)
          + float(attention_flops_per_key(config)) * num_tokens * context_length)


@dataclasses.dataclass(frozen=True)
class TrainingPasses:
  """Which passes one RL training step runs over its batch.

  epochs: μ; each epoch runs every row forward and backward once (its M mini-batches partition
    the rows).
  reference_forward: one forward of the frozen reference (β > 0).
  old_logprob_forward: one forward recomputing π_old before the first update.
  remat: each update also recomputes every block's forward in the backward pass.
  head_recomputed: the share of the projected positions whose logits the backward pass
    recomputes (`head_recomputed_share`).
  """

  epochs: int = 1
  reference_forward: bool = False
  old_logprob_forward: bool = False
  remat: bool = False
  head_recomputed: float = 1.0

  @classmethod
  def of_step(cls, step_config, completion_length: int | None = None) -> "TrainingPasses":
    """The passes `rl.step.TrainStep` runs for a `rl.step_config.StepConfig`: π_old is
    recomputed when a batch gets more than one update (μ·M > 1) or with PPO, never for SFT
    (`StepConfig.needs_old_logprobs`)."""
    c = step_config
    return cls(epochs=c.num_iterations, reference_forward=c.beta > 0,
               old_logprob_forward=c.algorithm != "sft"
               and (c.updates_per_step > 1 or c.algorithm == "ppo"),
               # save_matmuls rebuilds no projection: no matmul FLOPs recomputed
               remat=c.remat in (True, "full"),
               head_recomputed=head_recomputed_share(c.logprob_chunk, completion_length))


def head_recomputed_share(chunk: int, completion_length: int | None) -> float:
  """Share of the projected positions whose logits `rl.logprobs.head_logprobs` recomputes in the
  backward pass: every chunk's but the first's. Padded rows cut each row's T completion positions
  into ceil(T / chunk) chunks. A packed micro-batch gathers its head positions from chunk 0 on,
  into chunks of rows × min(chunk, T) positions, so the same share is its estimate. Unknown T: 1."""
  if not completion_length:
    return 1.0
  chunks = -(-completion_length // min(chunk, completion_length))
  return (chunks - 1) / chunks


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """FLOPs of one RL step: sampling (prefill + decode) and training (module docstring)."""

  prefill: float
  decode: float
  training: float
  recomputation: float = 0.0

  @property
  def generation(self) -> float:
    return self.prefill + self.decode

  @property
  def total(self) -> float:
    """Model FLOPs of the step (generation + training): the numerator of RL MFU."""
    return self.generation + self.training

  @property
  def executed(self) -> float:
    """`total` plus the recomputation the step runs to save memory."""
    return self.total + self.recomputation


def training_flops(config: ModelConfig, *, trained_tokens: float, trained_context: float,
                   completion_tokens: float, passes: TrainingPasses) -> tuple[float, float]:
  """(model FLOPs, recomputed FLOPs) of the training step.

  trained_tokens: tokens of every row (prompt + completion) run through the body.
  trained_context: keys each of them is scored against (the row width P + T as the step runs it).
  completion_tokens: tokens projected to the vocabulary (the completion positions).
  """
  one_forward = forward_flops(config, trained_tokens, trained_context,
                              projected_tokens=completion_tokens)
  forwards = 3 * passes.epochs + int(passes.reference_forward) + int(passes.old_logprob_forward)
  logits = output_projection_flops(config, completion_tokens)
  recomputed_per_update = logits * passes.head_recomputed
  if passes.remat:
    # Every block's forward again, except each MLP's down projection: the backward pass needs a
    # matmul's inputs, not the output of the block's last one, so JAX never recomputes it.
    down = 2.0 * sum(down_projection_weights(config, layer) for layer in range(config.num_layers))
    recomputed_per_update += one_forward - logits - down * trained_tokens
  return forwards * one_forward, passes.epochs * recomputed_per_update


def rl_step_flops(config: ModelConfig, *, prompts: int, prompt_tokens: float,
                  prompt_context: float, generated_tokens: float, decode_context: float,
                  trained_tokens: float, trained_context: float, completion_tokens: float,
                  passes: TrainingPasses) -> StepFlops:
  """FLOPs of sampling a batch and training on it.

  Sampling: each of `prompts` prefills runs its prompt tokens (`prompt_tokens` in all, each scored
  against `prompt_context` keys) and projects its last position; every one of the
  `generated_tokens` then takes one decode forward scored against `decode_context` cache slots.
  Training: `training_flops` with the remaining arguments.
  """
  prefill = forward_flops(config, prompt_tokens, prompt_context, projected_tokens=prompts)
  decode = forward_flops(config, generated_tokens, decode_context)
  training, recomputation = training_flops(
      config, trained_tokens=trained_tokens, trained_context=trained_context,
      completion_tokens=completion_tokens, passes=passes)
  return StepFlops(prefill=prefill, decode=decode, training=training, recomputation=recomputation)
