"""The `--config.dry_run=True` planner: per-device memory and RL-step throughput of a target slice.

`plan(config, model_config, target={"tpu": "v5p", "num_devices": 64})` builds the trainer and
sampler meshes as `jax.sharding.AbstractMesh`es (no devices needed, so it runs on any laptop),
shards every real parameter shape of `abstract_model(model_config)` with the project's partition
rules (`reasoning_rl.sharding.logical_to_spec`), and adds up what each device of each slice holds:

  trainer: params, AdamW moments (2 × params, in the parameter dtype as `optax.adamw` keeps them),
           gradients (2 × with micro-batch accumulation: accumulator + current micro-batch),
           the frozen reference (β > 0), activations of one micro-batch kept for the backward pass
           (no rematerialisation), and the chunked log-prob buffers;
  sampler: a params copy, the KV cache, and the decode step's temporaries.

With LoRA (`config.lora.rank > 0`) the adapters are the trainable parameters: AdamW moments and
gradients cover them alone, there is no reference copy (the base is the reference), the base's
adapted projections count at their quantized size under QLoRA (int8: 1 byte, NF4: half a byte +
a float32 scale per quantization_tile elements), the sampler holds the base plus the adapters (or
the merged weights), and a checkpoint holds adapters + moments.

With `mesh.num_trainer_devices = 0` both roles share every device, so one "shared" slice holds the
sum. A slice fits when its total stays under (1 − headroom) of the chip's HBM.

Throughput is a roofline estimate with stated efficiencies (`Assumptions`): FLOPs come from the
project's one FLOP model, `reasoning_rl.flops` (the same count as the trainer's
`throughput/rl_mfu`), with completions assumed to reach max_new_tokens; training time counts the
recomputation the step executes as well; a decode step is bound by max(HBM bytes read /
bandwidth, FLOPs / peak). Host-side verification and weight sync are not counted.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh

from reasoning_rl import flops as flops_lib
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.sharding import (MESH_AXES, logical_to_spec, resolve_mesh_shape,
                                   slice_device_counts)

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  """Per-device facts: HBM capacity (bytes), peak dense bf16 FLOP/s, HBM bandwidth (bytes/s)."""

  name: str
  hbm_bytes: float
  peak_flops: float
  hbm_bandwidth: float


# Public Cloud TPU documentation, chip specification tables (read 2025):
#   v4:  docs.cloud.google.com/tpu/docs/v4   — 275 TFLOP/s bf16, HBM2 32 GiB, 1200 GB/s
#   v5e: docs.cloud.google.com/tpu/docs/v5e  — 197 TFLOP/s bf16, HBM2 16 GB, 819 GB/s
#   v5p: docs.cloud.google.com/tpu/docs/v5p  — 459 TFLOP/s bf16, HBM2e 95 GB, 2765 GB/s
#   v6e: docs.cloud.google.com/tpu/docs/v6e  — 918 TFLOP/s bf16, 32 GB, 1638 GB/s
# The pages write HBM sizes as "GB"; the runtime reports them in binary units (a v5e shows ~16 GiB),
# so capacities are taken as GiB. One JAX device per chip (v4 / v5p run their two cores as one).
TPU_CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("TPU v4", 32 * GIB, 275e12, 1200e9),
    "v5e": ChipSpec("TPU v5e", 16 * GIB, 197e12, 819e9),
    "v5p": ChipSpec("TPU v5p", 95 * GIB, 459e12, 2765e9),
    "v6e": ChipSpec("TPU v6e", 32 * GIB, 918e12, 1638e9),
}
# "cpu": the development machine (24 GiB RAM, ~400 GFLOP/s f32 matmul, ~60 GB/s),
# shared evenly by `num_devices` simulated devices.
CPU_MACHINE = ChipSpec("CPU (2 cores)", 24 * GIB, 400e9, 60e9)


@dataclasses.dataclass(frozen=True)
class Assumptions:
  """The stated guesses behind the estimate; override any of them through `plan(assumptions=)`.

  headroom: fraction of HBM kept free for XLA temporaries, fragmentation and the runtime.
  Activations, per token and layer, kept for the backward pass of one micro-batch:
  activation_values_per_hidden: hidden-width values (compute dtype): norm inputs and outputs, the
    query / key / value / attention outputs, residuals.
  activation_values_per_intermediate: MLP-width values (compute dtype; the MLP width as split by
    the `tensor` axis): gate, up and their gated product.
  attention_values_per_score: float32 values per (head, query, key): scores, probabilities and
    their gradients.
  logprob_buffers: float32 [rows, chunk, vocab] buffers alive at once in a chunk's backward
    (recomputed logits and their gradient).
  gathered_layers: with the `fsdp` axis > 1, layers' worth of all-gathered (unsharded on fsdp)
    weights alive at once (the layer in use, the next one prefetched, their gradients before the
    reduce-scatter).
  The activation figures were measured, not derived: XLA's own memory analysis of the compiled
  step on CPU for 14 configurations (rows, sequence, widths, vocabulary, layers, β, fsdp / tensor /
  data meshes) fits 8 · hidden + 4 · intermediate values per token and layer, 3.6 float32 values
  per attention score, 2.3 log-prob buffers and 4.7 gathered layers within 7 % (rounded up here;
  tests/test_planning.py holds the planner to 25 % of XLA's figure). Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", §4.1) derive 16 hidden-width
  values for a GPT block with a 4·hidden GELU MLP, about what 8 · hidden + 4 · intermediate gives
  for this SwiGLU block at intermediate = 2–3 · hidden. XLA:TPU fuses more than XLA:CPU, so on TPU
  these are upper-side estimates. With `algo.remat` each layer keeps only its hidden-width input
  and one layer's activations are rebuilt at a time: the analytic figure (XLA:CPU's memory
  analysis shows only ~8 % saved by remat, so that case is not held to it).
  train_mfu: FLOP utilisation of the training step, applied to every FLOP it executes
    (recomputation included).
  prefill_mfu: of the sampler's prefill (compute-bound, like training).
  decode_mfu: compute ceiling of a decode step.
  decode_bandwidth_utilisation: fraction of HBM bandwidth a decode step achieves (decode is bound by
    reading every weight and the whole KV cache once per step).
  checkpoint_bytes_per_s_per_device: how fast a trainer host writes its devices' checkpoint shards
    to the workdir's storage, per device (0.5 GiB/s = 2 GiB/s for a host of 4 chips to GCS).
  preemption_notice_s: the grace a preempted host gets between SIGTERM and SIGKILL (Cloud TPU
    spot / preemptible VMs and GKE's default termination grace period: 30 s).
  """

  headroom: float = 0.10
  activation_values_per_hidden: float = 8
  activation_values_per_intermediate: float = 4
  attention_values_per_score: float = 4
  logprob_buffers: float = 2.5
  gathered_layers: float = 5
  train_mfu: float = 0.40
  prefill_mfu: float = 0.40
  decode_mfu: float = 0.20
  decode_bandwidth_utilisation: float = 0.50
  checkpoint_bytes_per_s_per_device: float = 0.5 * GIB
  preemption_notice_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class SliceMemory:
  """What one device of a slice holds, item by item (bytes)."""

  name: str  # "trainer", "sampler" or "shared"
  mesh: AbstractMesh
  items: tuple[tuple[str, int], ...]
  capacity: float
  headroom: float

  @property
  def num_devices(self) -> int:
    return self.mesh.size

  @property
  def total(self) -> int:
    return sum(b for _, b in self.items)

  @property
  def usable(self) -> float:
    return self.capacity * (1.0 - self.headroom)

  @property
  def fits(self) -> bool:
    return self.total <= self.usable

  @property
  def over_bytes(self) -> float:
    return max(0.0, self.total - self.usable)

  def item(self, name: str) -> int:
    return sum(b for n, b in self.items if n == name or n.endswith(": " + name))


@dataclasses.dataclass(frozen=True)
class Throughput:
  """FLOPs and estimated seconds of one RL step (sampling P·G completions + the training step)."""

  flops: flops_lib.StepFlops
  prefill_s: float
  decode_steps: int
  decode_step_s: float
  sample_s: float
  train_s: float
  step_s_sync: float
  step_s_async: float | None  # None when both roles share the devices

  @property
  def steps_per_hour(self) -> float:
    return 3600.0 / self.step_s_sync


@dataclasses.dataclass(frozen=True)
class Preemption:
  """How long a run takes to stop on SIGTERM / SIGINT. The loop acts on a stop request between
  decode calls (`rollout.steps_per_call` decode steps each) and after the train step (one
  compiled program, micro-batches included), then saves the train state; the grace needed is the
  longer of the two waits plus the save."""

  decode_call_s: float
  train_s: float
  checkpoint_bytes_per_device: int  # params + AdamW moments (the reference is not saved)
  save_s: float

  @property
  def grace_s(self) -> float:
    return max(self.decode_call_s, self.train_s) + self.save_s


@dataclasses.dataclass(frozen=True)
class Plan:
  chip: ChipSpec
  num_devices: int
  model_summary: str
  slices: tuple[SliceMemory, ...]
  throughput: Throughput
  assumptions: Assumptions
  advice: tuple[str, ...]  # one hint per slice that does not fit
  preemption: Preemption

  @property
  def fits(self) -> bool:
    return all(s.fits for s in self.slices)

  def slice(self, name: str) -> SliceMemory:
    return next(s for s in self.slices if s.name == name)

  def verdict(self) -> str:
    if self.fits:
      return "fits"
    worst = max(self.slices, key=lambda s: s.over_bytes)
    return (f"does NOT fit: {worst.over_bytes / GIB:.2f} GiB over on the {worst.name} slice — try "
            + "; ".join(self.advice))

  def table(self) -> str:
    c, a, t = self.chip, self.assumptions, self.throughput
    lines = [f"Dry-run plan: {self.model_summary}",
             f"Target: {self.num_devices} x {c.name} ({c.hbm_bytes / GIB:.1f} GiB HBM, "
             f"{c.peak_flops / 1e12:.1f} TFLOP/s, {c.hbm_bandwidth / 1e9:.0f} GB/s per device)"]
    for s in self.slices:
      shape = " ".join(f"{k}={v}" for k, v in s.mesh.shape.items())
      plural = "s" if s.num_devices > 1 else ""
      lines += ["", f"{s.name} slice: {s.num_devices} device{plural}, mesh {shape}",
                f"  {'per device':<40}{'GiB':>10}"]
      lines += [f"  {name:<40}{b / GIB:>10.3f}" for name, b in s.items]
      lines.append(f"  {'total':<40}{s.total / GIB:>10.3f}   of {s.usable / GIB:.2f} usable "
                   f"({a.headroom:.0%} headroom) -> "
                   + ("fits" if s.fits else f"OVER by {s.over_bytes / GIB:.2f} GiB"))
    bandwidth = a.decode_bandwidth_utilisation
    lines += ["", f"Throughput per RL step (train MFU {a.train_mfu:.0%}, prefill MFU "
              f"{a.prefill_mfu:.0%}, decode bound by max(bytes / ({bandwidth:.0%} of HBM "
              f"bandwidth), FLOPs / {a.decode_mfu:.0%} of peak)):",
              f"  sampling   {t.flops.generation / 1e12:12.1f} TFLOP   prefill {t.prefill_s:.2f} s"
              f" + {t.decode_steps} decode steps x {t.decode_step_s * 1e3:.2f} ms = "
              f"{t.sample_s:.1f} s",
              f"  training   {t.flops.training / 1e12:12.1f} TFLOP   {t.train_s:.1f} s (+ "
              f"{t.flops.recomputation / 1e12:.1f} TFLOP recomputed)",
              f"  step (sync) {t.step_s_sync:.1f} s -> {t.steps_per_hour:.1f} steps/hour"]
    if t.step_s_async is not None:
      lines.append(f"  step (async, slices overlap) {t.step_s_async:.1f} s -> "
                   f"{3600 / t.step_s_async:.1f} steps/hour")
    lines += ["  (completions assumed to reach max_new_tokens; verification and weight sync not "
              "counted)", ""] + self._preemption_lines() + ["", f"Verdict: {self.verdict()}"]
    return "\n".join(lines)

  def _preemption_lines(self) -> list[str]:
    p, a = self.preemption, self.assumptions
    lines = ["Preemption (SIGTERM / SIGINT: acted on between decode calls and after the train step):",
             f"  longest decode call      {p.decode_call_s:8.2f} s",
             f"  train step               {p.train_s:8.2f} s   (one compiled program: not "
             "interrupted)",
             f"  checkpoint save          {p.save_s:8.2f} s   "
             f"({p.checkpoint_bytes_per_device / GIB:.2f} GiB per trainer device at an assumed "
             f"{a.checkpoint_bytes_per_s_per_device / GIB:.2f} GiB/s)",
             f"  grace needed           ~ {p.grace_s:8.2f} s"]
    if p.grace_s > a.preemption_notice_s:
      lines += textwrap.wrap(
          f"more than the {a.preemption_notice_s:.0f} s a spot / preemptible TPU VM (or a GKE "
          "pod, by default) gets: a notice that lands mid-step is cut off before the save, and "
          "the rerun resumes from the last scheduled checkpoint (keep checkpoint.every_steps "
          "small, or shorten the step)", width=98, initial_indent="  ", subsequent_indent="  ")
    return lines


# --------------------------------------------------------------------------- meshes


def _chip(target) -> tuple[ChipSpec, int]:
  tpu, num_devices = target["tpu"], target["num_devices"]
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ConfigError(f"target.num_devices={num_devices!r}: must be an integer >= 1")
  if tpu == "cpu":
    m = CPU_MACHINE
    return ChipSpec(m.name, m.hbm_bytes / num_devices, m.peak_flops / num_devices,
                    m.hbm_bandwidth / num_devices), num_devices
  if tpu not in TPU_CHIPS:
    raise ConfigError(f"target.tpu={tpu!r}: use one of {sorted(TPU_CHIPS) + ['cpu']}")
  return TPU_CHIPS[tpu], num_devices


def abstract_mesh(shape: Sequence[int], num_devices: int, *, field: str) -> AbstractMesh:
  """A (data, fsdp, tensor) AbstractMesh of `num_devices`; one size may be -1 (the rest)."""
  return AbstractMesh(resolve_mesh_shape(shape, num_devices, field=field), MESH_AXES)


def slice_meshes(config, num_devices: int) -> tuple[AbstractMesh, AbstractMesh, bool]:
  """(trainer mesh, sampler mesh, shared) for the config's split of `num_devices`."""
  n = config.mesh.num_trainer_devices
  trainer_count, sampler_count = slice_device_counts(
      n, num_devices, field="config.mesh.num_trainer_devices")
  return (abstract_mesh(config.mesh.trainer, trainer_count, field="config.mesh.trainer"),
          abstract_mesh(config.mesh.sampler, sampler_count, field="config.mesh.sampler"), n == 0)


def shard_size(axes: Sequence[str | None], shape: Sequence[int], mesh: AbstractMesh) -> int:
  """Elements of one device's shard of an array with logical `axes` (dims the rules do not divide
  stay whole)."""
  spec = logical_to_spec(axes, shape, mesh)
  size = 1
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    size *= dim // math.prod(mesh.shape[a] for a in names)
  return size


def parameter_shapes(model_config: ModelConfig, dtype, lora=None) -> list[tuple[tuple, tuple,
                                                                                float]]:
  """(logical axes, shape, bytes per element) of every parameter, from the abstract model; with
  QLoRA settings (`lora.base_quantization`) the adapted projections at their quantized size."""
  from flax import nnx  # local: the planner's other parts need no flax

  from reasoning_rl.models.transformer import abstract_model
  _, state = abstract_model(model_config, dtype=dtype, param_dtype=dtype)
  quantized = _quantized_itemsize(lora)
  shapes = []
  for path, v in nnx.to_flat_state(state):
    itemsize = np.dtype(v.dtype).itemsize
    if quantized and _is_adapted_projection(path, lora):
      itemsize = quantized
    shapes.append((tuple(v.get_metadata()["logical_axes"]), tuple(v.shape), itemsize))
  return shapes


def _quantized_itemsize(lora) -> float | None:
  if lora is None or not lora.enabled or not lora.base_quantization:
    return None
  if lora.base_quantization == "int8":
    return 1.0  # + one float32 scale per output channel, negligible
  return 0.5 + (4 / lora.quantization_tile if lora.quantization_tile else 0.0)


def _is_adapted_projection(path, lora) -> bool:
  import re  # pylint: disable=import-outside-toplevel

  from reasoning_rl.lora import PROJECTIONS  # pylint: disable=import-outside-toplevel

  path = tuple(map(str, path))
  return (len(path) == 4 and path[0] == "layers" and path[3] in PROJECTIONS.get(path[2], ())
          and re.fullmatch(lora.target_modules, "/".join(path[:3])) is not None)


def adapter_shapes(model_config: ModelConfig, lora, dtype) -> list[tuple[tuple, tuple, float]]:
  """(axes, shape, bytes per element) of every LoRA adapter (replicated, so axes are None):
  A [fan-in, r] and B [r, fan-out] per adapted projection (`reasoning_rl.lora`)."""
  if lora is None or not lora.enabled:
    return []
  import re  # pylint: disable=import-outside-toplevel

  from reasoning_rl.lora import PROJECTIONS  # pylint: disable=import-outside-toplevel

  m, r, itemsize = model_config, lora.rank, np.dtype(dtype).itemsize
  d, f, k = m.hidden_size, m.intermediate_size, m.head_dim
  fans = {"q_proj": (d, m.num_heads * k), "k_proj": (d, m.num_kv_heads * k),
          "v_proj": (d, m.num_kv_heads * k), "o_proj": (m.num_heads * k, d),
          "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
  shapes = []
  for layer in range(m.num_layers):
    for module, projections in PROJECTIONS.items():
      if re.fullmatch(lora.target_modules, f"layers/{layer}/{module}"):
        for name in projections:
          fan_in, fan_out = fans[name]
          shapes += [((None, None), (fan_in, r), itemsize), ((None, None), (r, fan_out), itemsize)]
  return shapes


def param_bytes_per_device(shapes: Sequence[tuple[tuple, tuple, float]],
                           mesh: AbstractMesh) -> int:
  """Bytes of one device's shard of every parameter, as the partition rules place it."""
  return int(sum(shard_size(axes, shape, mesh) * itemsize for axes, shape, itemsize in shapes))


# --------------------------------------------------------------------------- memory


def _split(mesh: AbstractMesh, axis: str, size: int) -> int:
  """How many ways a dimension of `size` with logical `axis` is split on `mesh`."""
  return size // shard_size((axis,), (size,), mesh)


def _layer_weight_bytes(shapes: Sequence[tuple[tuple, tuple, int]], mesh: AbstractMesh,
                        num_layers: int) -> int:
  """Bytes of one layer's weights with the `fsdp` axis gathered (tensor sharding kept)."""
  gathered = AbstractMesh(tuple(1 if name == "fsdp" else size for name, size in
                                zip(mesh.axis_names, mesh.axis_sizes)), mesh.axis_names)
  layer_shapes = [s for s in shapes if "vocab" not in s[0]]  # all but embedding / LM head
  return param_bytes_per_device(layer_shapes, gathered) // max(1, num_layers)


def trainer_items(config, m: ModelConfig, mesh: AbstractMesh, params: int, a: Assumptions,
                  num_micro_batches: int, shapes=None, adapters=()) -> list[tuple[str, int]]:
  """Per-device bytes of the training step (see the module docstring and `Assumptions`);
  `params` counts the base and the adapters, `adapters` (LoRA) are the trainable ones."""
  r, b = config.rollout, np.dtype(config.model.dtype).itemsize
  seq = r.max_prefill_length + r.max_new_tokens
  rows = (r.num_prompts * r.num_samples) // num_micro_batches
  rows_per_device = -(-rows // _split(mesh, "batch", rows))
  heads = m.num_heads // _split(mesh, "kv_heads", m.num_kv_heads)
  intermediate = m.intermediate_size // _split(mesh, "mlp", m.intermediate_size)
  per_layer = seq * ((a.activation_values_per_hidden * m.hidden_size
                      + a.activation_values_per_intermediate * intermediate) * b
                     + a.attention_values_per_score * heads * seq * 4)
  if config.algo.get("remat", False):
    # Only each block's input is kept; one block's activations are rebuilt at a time.
    per_row = m.num_layers * seq * m.hidden_size * b + per_layer
  else:
    per_row = m.num_layers * per_layer
  chunk = min(config.algo.logprob_chunk, r.max_new_tokens)
  vocab = m.vocab_size // _split(mesh, "vocab", m.vocab_size)
  trainable = param_bytes_per_device(adapters, mesh) if adapters else params
  items = [("params" + (" (frozen base + adapters)" if adapters else ""), params),
           ("optimizer (AdamW m, v)", 2 * trainable),
           ("gradients" + (" + accumulator" if num_micro_batches > 1 else ""),
            trainable * (2 if num_micro_batches > 1 else 1))]
  if config.beta > 0 and not adapters:  # with LoRA the base is the reference
    items.append(("reference params", params))
  if mesh.shape["fsdp"] > 1 and shapes is not None:
    items.append(("gathered layer weights (fsdp)",
                  int(a.gathered_layers * _layer_weight_bytes(shapes, mesh, m.num_layers))))
  items += [("activations (1 micro-batch)", int(rows_per_device * per_row)),
            ("log-prob chunk buffers",
             int(a.logprob_buffers * rows_per_device * chunk * vocab * 4))]
  return items


def sampler_items(config, m: ModelConfig, mesh: AbstractMesh, params: int,
                  slots: int) -> list[tuple[str, int]]:
  """Per-device bytes of the sampler: params copy, KV cache [slots, K, S, Dh] × 2 × layers (+ its
  int32 positions), and one decode step's logits and attention scores."""
  r, b = config.rollout, np.dtype(config.model.dtype).itemsize
  length = r.max_prefill_length + r.max_new_tokens
  kv = shard_size(("batch", "kv_heads", "length", "head_dim"),
                  (slots, m.num_kv_heads, length, m.head_dim), mesh)
  positions = shard_size(("batch", "length"), (slots, length), mesh)
  slots_per_device = slots // _split(mesh, "batch", slots)
  heads = m.num_heads // _split(mesh, "kv_heads", m.num_kv_heads)
  temporaries = slots_per_device * (2 * m.vocab_size * 4 + heads * length * (4 + b))
  return [("params copy", params), ("KV cache", 2 * m.num_layers * kv * b + 4 * positions),
          ("decode temporaries", temporaries)]


# --------------------------------------------------------------------------- throughput


def step_flops(config, m: ModelConfig) -> flops_lib.StepFlops:
  """FLOPs of one RL step at the config's padded shapes (`reasoning_rl.flops`): P prompts of
  max_prefill_length tokens prefilled once each, P·G completions of max_new_tokens tokens decoded
  against the whole cache of S = prompt + completion slots, and P·G training rows of S tokens
  with the completion positions projected, through the passes the configured step runs."""
  from reasoning_rl.build import step_config  # local: build imports the training stack lazily

  r = config.rollout
  rows, prompt, new = r.num_prompts * r.num_samples, r.max_prefill_length, r.max_new_tokens
  return flops_lib.rl_step_flops(
      m, prompts=r.num_prompts, prompt_tokens=r.num_prompts * prompt, prompt_context=prompt,
      generated_tokens=rows * new, decode_context=prompt + new,
      trained_tokens=rows * (prompt + new), trained_context=prompt + new,
      completion_tokens=rows * new,
      passes=flops_lib.TrainingPasses.of_step(step_config(config)))


def throughput(config, m: ModelConfig, chip: ChipSpec, trainer: AbstractMesh,
               sampler: AbstractMesh, sampler_bytes: int, shared: bool,
               a: Assumptions) -> Throughput:
  """Roofline times: compute at the stated MFU; each decode step reads the sampler's params and KV
  cache from HBM once (memory-bound) unless its FLOPs take longer."""
  r = config.rollout
  step = step_flops(config, m)
  per_token = flops_lib.forward_flops(m, 1, r.max_prefill_length + r.max_new_tokens)
  train_s = (step.training + step.recomputation) / (trainer.size * chip.peak_flops * a.train_mfu)
  prefill_s = step.prefill / (sampler.size * chip.peak_flops * a.prefill_mfu)
  slots = r.max_concurrent_decodes
  decode_steps = -(-(r.num_prompts * r.num_samples) // slots) * r.max_new_tokens
  memory_s = sampler_bytes / (chip.hbm_bandwidth * a.decode_bandwidth_utilisation)
  compute_s = slots * per_token / (sampler.size * chip.peak_flops * a.decode_mfu)
  decode_step_s = max(memory_s, compute_s)
  sample_s = prefill_s + decode_steps * decode_step_s
  return Throughput(flops=step, prefill_s=prefill_s,
                    decode_steps=decode_steps, decode_step_s=decode_step_s, sample_s=sample_s,
                    train_s=train_s, step_s_sync=sample_s + train_s,
                    step_s_async=None if shared else max(sample_s, train_s))


# --------------------------------------------------------------------------- the plan


def _fits(items, chip: ChipSpec, a: Assumptions, extra: int = 0) -> bool:
  return sum(b for _, b in items) + extra <= chip.hbm_bytes * (1 - a.headroom)


def _trainer_fix(config, m, chip, a, trainer, shapes, budget_taken, adapters=()) -> str | None:
  """The first (mesh, micro-batches) that fits: more micro-batches on the configured mesh, then a
  tensor axis (it splits attention heads, the MLP and the vocabulary) with as many as needed."""
  batch = config.rollout.num_prompts * config.rollout.num_samples
  current = config.algo.num_micro_batches
  n = trainer.size
  tensor_sizes = [t for t in range(1, n + 1) if n % t == 0 and t >= trainer.shape["tensor"]]
  for t in tensor_sizes:
    mesh = trainer if t == trainer.shape["tensor"] else AbstractMesh((1, n // t, t), MESH_AXES)
    params = param_bytes_per_device(shapes, mesh) + param_bytes_per_device(adapters, mesh)
    for k in [k for k in range(current, batch + 1) if batch % k == 0]:
      if _fits(trainer_items(config, m, mesh, params, a, k, shapes, adapters), chip, a,
               budget_taken):
        change = [] if mesh is trainer else [f"mesh.trainer=(1, {n // t}, {t})"]
        change += [] if k == current else [f"algo.num_micro_batches={k}"]
        return " with ".join(change)
  return None


def _advice(config, m, chip, a, trainer, sampler, shared, shapes, train_params, sample_params,
            adapters=()):
  """Concrete changes that would make the over-full slice(s) fit."""
  r = config.rollout
  train_now = trainer_items(config, m, trainer, train_params, a, config.algo.num_micro_batches,
                            shapes, adapters)
  sample_now = sampler_items(config, m, sampler, sample_params, r.max_concurrent_decodes)
  # Sharing devices, each role's budget is what the other one leaves.
  sampler_taken = sum(b for _, b in sample_now) if shared else 0
  trainer_taken = sum(b for _, b in train_now) if shared else 0
  hints = []
  if not _fits(train_now, chip, a, sampler_taken):
    fix = _trainer_fix(config, m, chip, a, trainer, shapes, sampler_taken, adapters)
    if fix:
      hints.append(fix)
    else:
      hints.append("more trainer devices, shorter rows (rollout.max_new_tokens, "
                   "rollout.max_prefill_length) or a chip with more HBM: the step keeps every "
                   "layer's activations and attention scores (no rematerialisation)")
      if config.beta > 0 and not adapters:
        hints.append(f"beta=0 drops the reference ({train_params / GIB:.2f} GiB per device)")
  if not _fits(sample_now, chip, a, trainer_taken):
    fitting = [s for s in range(r.max_concurrent_decodes - 1, 0, -1) if _fits(
        sampler_items(config, m, sampler, sample_params, s), chip, a, trainer_taken)]
    if fitting:
      hints.append(f"rollout.max_concurrent_decodes={fitting[0]} (or a shorter "
                   "rollout.max_new_tokens): the KV cache shrinks with both")
    else:
      hints.append("more sampler devices (a larger tensor or fsdp axis in mesh.sampler) or a chip "
                   "with more HBM")
  return tuple(hints)


def plan(config, model_config: ModelConfig, *, target: Mapping,
         assumptions: Assumptions | None = None) -> Plan:
  """Memory per device of each slice and the RL-step throughput for `target`.

  Args:
    config: the training ConfigDict (reasoning_rl.config.base_config fields).
    model_config: the policy's architecture.
    target: {"tpu": "v4"|"v5e"|"v5p"|"v6e"|"cpu", "num_devices": int}.
    assumptions: efficiencies and headroom; `Assumptions()` by default.

  Raises ConfigError for an unknown chip, or a mesh that does not match the device count.
  """
  a = assumptions or Assumptions()
  chip, num_devices = _chip(target)
  trainer, sampler, shared = slice_meshes(config, num_devices)
  from reasoning_rl.lora import LoraSettings  # pylint: disable=import-outside-toplevel

  lora = LoraSettings.from_config(config)
  shapes = parameter_shapes(model_config, np.dtype(config.model.dtype), lora)
  adapters = adapter_shapes(model_config, lora, config.model.dtype)
  train_params = param_bytes_per_device(shapes, trainer) + param_bytes_per_device(adapters, trainer)
  sample_params = param_bytes_per_device(shapes, sampler)
  if lora.enabled and lora.sampler_weights == "adapters":
    sample_params += param_bytes_per_device(adapters, sampler)
  train = trainer_items(config, model_config, trainer, train_params, a,
                        config.algo.num_micro_batches, shapes, adapters)
  sample = sampler_items(config, model_config, sampler, sample_params,
                         config.rollout.max_concurrent_decodes)
  make = lambda name, mesh, items: SliceMemory(name, mesh, tuple(items), chip.hbm_bytes,  # noqa
                                               a.headroom)
  if shared:
    slices = (make("shared", trainer, [(f"trainer: {n}", b) for n, b in train]
                   + [(f"sampler: {n}", b) for n, b in sample]),)
  else:
    slices = (make("trainer", trainer, train), make("sampler", sampler, sample))
  sampler_read = sample_params + dict(sample)["KV cache"]
  speed = throughput(config, model_config, chip, trainer, sampler, sampler_read, shared, a)
  r = config.rollout
  summary = (f"{model_config.model_type}, {model_config.num_params() / 1e9:.3f} B params, "
             f"{model_config.num_layers} layers x hidden {model_config.hidden_size}, "
             f"{config.model.dtype}; P={r.num_prompts} x G={r.num_samples}, prompt "
             f"{r.max_prefill_length} + completion {r.max_new_tokens} tokens")
  advice = () if all(s.fits for s in slices) else _advice(
      config, model_config, chip, a, trainer, sampler, shared, shapes, train_params, sample_params,
      adapters)
  # params + AdamW m, v, as the trainer slice holds them (LoRA: the adapters only)
  saved = 3 * (param_bytes_per_device(adapters, trainer) if adapters else train_params)
  preemption = Preemption(
      decode_call_s=min(r.steps_per_call, r.max_new_tokens) * speed.decode_step_s,
      train_s=speed.train_s, checkpoint_bytes_per_device=saved,
      save_s=saved / a.checkpoint_bytes_per_s_per_device)
  return Plan(chip=chip, num_devices=num_devices, model_summary=summary, slices=slices,
              throughput=speed, assumptions=a, advice=advice, preemption=preemption)


def dry_run_model_config(config) -> ModelConfig:
  """The architecture to plan with: model.path's config.json (or GGUF metadata) when readable on
  this machine, else `model.hf_config_for_planning` (a config.json dict in the config file); a
  random model (no model.path) is planned from `model.random`."""
  import json

  from reasoning_rl import storage

  if not config.model.path:
    from reasoning_rl.build import random_model_config

    return random_model_config(config)[0]

  path = storage.path(config.model.path)
  if (path / "config.json").exists():
    return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()),
                                      source=str(path / "config.json"))
  if path.suffix == ".gguf" and not storage.is_remote(path) and path.exists():
    from reasoning_rl.models.gguf_io import gguf_model_config, open_gguf

    return gguf_model_config(open_gguf(path), path)
  fallback = config.model.get("hf_config_for_planning")
  if fallback is None:
    raise ConfigError(
        f"config.model.path={config.model.path!r}: not readable here and the config has no "
        "model.hf_config_for_planning (the config.json dict of the target model) to plan with")
  return ModelConfig.from_hf_config(dict(fallback), source="config.model.hf_config_for_planning")


def print_dry_run(config) -> Plan:
  """`launch/train.py --config.dry_run=True`: prints the plan of `config.target` and returns it."""
  target = dict(config.target)
  if target.get("num_devices", 0) == 0:
    target = {"tpu": target.get("tpu", "cpu"), "num_devices": jax.device_count()}
  result = plan(config, dry_run_model_config(config), target=target)
  print(result.table())
  return result
