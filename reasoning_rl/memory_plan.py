"""Per-device memory of a run laid out on a target: the model the run itself uses at start-up.

`memory_plan(config, model_config, target={"tpu": "v5p", "num_devices": 32})` lays the run out as
it will run (`reasoning_rl.multihost.topology`): the trainer mesh over the first
`mesh.num_trainer_devices` devices, and the sampler as replicas, each the devices of one sampler
process (one host of the slice; one replica of every sampler device when the slice is one host)
with its own `mesh.sampler` mesh and an engine that holds all `rollout.max_concurrent_decodes`
slots. Meshes are `jax.sharding.AbstractMesh`es (no devices needed, so it runs on any laptop);
every real parameter shape of `abstract_model(model_config)` is sharded with the project's
partition rules (`reasoning_rl.sharding.logical_to_spec`), and each device's bytes are added up:

  trainer: master weights in `model.weight_dtype`, AdamW moments (2 × the trainable weights, in
           their dtype, as `optax.adamw` keeps them), the micro-batch's gradients (weight dtype)
           and, with micro-batches, their float32 accumulator, the frozen reference (β > 0; in
           the compute dtype, reasoning_rl/precision.py),
           activations of one micro-batch kept for the backward pass, the chunked log-prob
           buffers, and for the weight sync the copy cast to the compute dtype `model.dtype`
           (several processes: laid out as a replica wants it, the "send mesh" of
           `multihost.param_sync`; one process: in the trainer's layout, if the dtypes differ);
  sampler (one device of one replica): its weights in the compute dtype (with
           `rollout.weight_quantization` its projections at one byte per element plus a scale
           per output channel, `quantized_plan`; the KV cache stays in the compute dtype), the
           KV cache of every slot its engine holds, the next-token logits of the decode state, one decode step's
           temporaries, and the new weights received during a sync (held beside the old ones
           until the engine swaps them).

Items belong to a phase: "held" for the whole run, or "train step", "decode", "weight sync",
which never overlap in time on a device; a slice's peak is what is held plus its largest phase.
With `mesh.num_trainer_devices = 0` both roles share every device, so one "shared" slice holds
the sum (the sampler's weight copy among it: `sharding.reshard` never aliases the trainer's
donated buffers). A slice fits when its peak stays under (1 − headroom) of the chip's HBM.

With LoRA (`config.lora.rank > 0`) the adapters (float32) are the trainable parameters: AdamW
moments and gradients cover them alone, the frozen base is held in the compute dtype, there is no
reference copy (the base is the reference),
the base's adapted projections count at their quantized size under QLoRA (int8: 1 byte, NF4:
half a byte + a float32 scale per quantization_tile elements), the sampler holds the base plus
the adapters (or the merged weights) and receives the adapters (or the merged weights), and a
checkpoint holds adapters + moments.

At start-up a run asks this model one question (`resolve_layout`): which packing and how many
micro-batches fit this machine, for the fields the config leaves open (`step_layout`). The dry run
(`reasoning_rl/planning.py`) adds throughput, preemption and advice on top and prints the table.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import AbstractMesh

from reasoning_rl import kernels, step_layout, storage
from reasoning_rl.config import batch_rows, sampler_cache_length
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.gguf_io import gguf_model_config, open_gguf
from reasoning_rl.models.upcycle import upcycled_config
from reasoning_rl.param_plan import (ModelShapes, Precision, layer_weight_bytes,
                                     param_bytes_per_device, shard_size, split_ways, with_itemsize)
from reasoning_rl.run_settings import random_model_config, step_config
from reasoning_rl.sharding import (MESH_AXES, mesh_axes_of,
                                   multi_slice_mesh_shape, resolve_mesh_shape,
                                   slice_device_counts, slices_spanned)
from reasoning_rl.tpu_chips import CPU_MACHINE, GIB, TPU_CHIPS, ChipSpec, devices_per_host


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
  truncation_buffers: with `algo.truncated_ratio` and a warping rollout, float32 [rows, chunk,
    whole vocabulary] buffers the rebuild of the sampler's kept set adds (its top-k over the
    vocabulary and the renormalised log-probs); measured with XLA's analysis of the compiled step:
    4.1–4.5 of them, 3.6 with the vocabulary split over tensor = 2 (the top-k sees it whole).
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
  dynamic_sampling_dropped: with dynamic sampling, the share of a round's groups whose rewards
    are all equal (dropped and refilled by the next round): a guess, which a run measures as
    groups/all_pass_frac + groups/all_fail_frac.
  """

  headroom: float = 0.10
  activation_values_per_hidden: float = 8
  activation_values_per_intermediate: float = 4
  attention_values_per_score: float = 4
  logprob_buffers: float = 2.5
  truncation_buffers: float = 4.5
  gathered_layers: float = 5
  train_mfu: float = 0.40
  prefill_mfu: float = 0.40
  decode_mfu: float = 0.20
  decode_bandwidth_utilisation: float = 0.50
  checkpoint_bytes_per_s_per_device: float = 0.5 * GIB
  preemption_notice_s: float = 30.0
  dynamic_sampling_dropped: float = 0.5


PHASES = ("train step", "decode", "weight sync")  # transient phases; never at once on a device


@dataclasses.dataclass(frozen=True)
class Item:
  """One thing a device holds: bytes per device, and "held" or the transient phase it lives in."""

  name: str
  bytes: int
  phase: str = "held"


def _base_name(name: str) -> str:
  """An item's name without its role prefix ("trainer: ") and its detail in parentheses."""
  name = name.split(": ", 1)[1] if name.startswith(("trainer: ", "sampler: ")) else name
  return name.split(" (", 1)[0]


@dataclasses.dataclass(frozen=True)
class SliceMemory:
  """What one device of a slice holds, item by item (bytes). For the sampler: one device of one
  replica (every replica holds the same)."""

  name: str  # "trainer", "sampler" or "shared"
  mesh: AbstractMesh  # the trainer mesh, or one sampler replica's mesh
  items: tuple[Item, ...]
  capacity: float
  headroom: float
  num_replicas: int = 1

  @property
  def num_devices(self) -> int:
    return self.mesh.size * (self.num_replicas if self.name == "sampler" else 1)

  @property
  def held(self) -> int:
    return sum(i.bytes for i in self.items if i.phase == "held")

  def phase_bytes(self, phase: str) -> int:
    return sum(i.bytes for i in self.items if i.phase == phase)

  @property
  def peak_phase(self) -> str | None:
    phases = [p for p in PHASES if any(i.phase == p for i in self.items)]
    return max(phases, key=self.phase_bytes) if phases else None

  @property
  def total(self) -> int:
    """The peak: what is held all along plus the largest transient phase."""
    return self.held + (self.phase_bytes(self.peak_phase) if self.peak_phase else 0)

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
    """Bytes of the items called `name`, with or without the role prefix and the detail in
    parentheses ("KV cache" finds "sampler: KV cache (512 slots)")."""
    def names(full):
      bare = full.split(": ", 1)[1] if full.startswith(("trainer: ", "sampler: ")) else full
      return (full, bare, _base_name(full))

    return sum(i.bytes for i in self.items if name in names(i.name))

  def by_name(self) -> dict[str, int]:
    return {i.name: i.bytes for i in self.items}


# --------------------------------------------------------------------------- meshes


def _chip(target) -> tuple[ChipSpec, int]:
  """The chip and device count of `target`; `target["devices_per_host"]`, when given, overrides
  the chip's devices per host (e.g. a CPU target laid out as several processes)."""
  tpu, num_devices = target.get("tpu"), target["num_devices"]
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ConfigError(f"target.num_devices={num_devices!r}: must be an integer >= 1")
  if "chip" in target:  # a measured device (`step_layout.this_machine`)
    chip = target["chip"]
  elif tpu == "cpu":
    m = CPU_MACHINE
    chip = ChipSpec(m.name, m.hbm_bytes / num_devices, m.peak_flops / num_devices,
                    m.hbm_bandwidth / num_devices, backend=m.backend)
  elif tpu in TPU_CHIPS:
    chip = TPU_CHIPS[tpu]
  else:
    raise ConfigError(f"target.tpu={tpu!r}: use one of {sorted(TPU_CHIPS) + ['cpu']}")
  # the launchers' hosts (VMs) for a known slice type (tpu_chips.ACCELERATORS), else the chip's
  per_host = target.get("devices_per_host", 0) or (
      devices_per_host(tpu, num_devices) if tpu in TPU_CHIPS else chip.devices_per_host)
  if not isinstance(per_host, int) or per_host < 0:
    raise ConfigError(f"target.devices_per_host={per_host!r}: must be an integer >= 1")
  return dataclasses.replace(chip, devices_per_host=per_host), num_devices


def abstract_mesh(shape: Sequence[int], num_devices: int, *, field: str) -> AbstractMesh:
  """A (data, fsdp, tensor) AbstractMesh of `num_devices`, or (data, fsdp, expert, tensor) for
  four sizes (`sharding.mesh_axes_of`); one size may be -1 (the rest)."""
  return AbstractMesh(resolve_mesh_shape(shape, num_devices, field=field), mesh_axes_of(shape))


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a run uses the target's devices (as `multihost.topology` assigns them): the trainer
  mesh, and `num_replicas` sampler replicas, each on its own `replica` mesh."""

  trainer: AbstractMesh
  replica: AbstractMesh
  num_replicas: int
  num_processes: int
  shared: bool  # mesh.num_trainer_devices = 0: every device trains and samples
  num_slices: int = 1  # of the target
  trainer_slices: int = 1  # slices the trainer mesh spans (stacked along its data axis)

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1


def plan_layout(config, num_devices: int, devices_per_host: int = 0, num_slices: int = 1
                ) -> Layout:
  """The layout of `num_devices` on hosts of `devices_per_host` (0: one host), in `num_slices`
  equal slices. One process: one replica over every sampler device. Several: one replica per
  sampler process, on its devices; a split must fall between hosts and leave the trainer at least
  two, and on several slices take part of one slice or whole slices, whose meshes stack along
  `data` (the rules `multihost.topology.make_topology` enforces)."""
  field = "config.mesh.num_trainer_devices"
  n = config.mesh.num_trainer_devices
  trainer_count, sampler_count = slice_device_counts(n, num_devices, field=field)
  per_host = devices_per_host or num_devices
  if num_devices % per_host:
    raise ConfigError(f"target.num_devices={num_devices}: not a whole number of hosts of "
                      f"{per_host} devices")
  processes = num_devices // per_host
  if processes == 1:
    replicas, replica_size = 1, sampler_count
  elif n == 0:
    replicas, replica_size = processes, per_host
  else:
    if n % per_host:
      raise ConfigError(
          f"{field}={n}: splits the devices of a host between the trainer and the sampler; with "
          f"several processes the split must fall between hosts: use a multiple of the "
          f"{per_host} devices per host (or 0 to colocate)")
    if n // per_host < 2:
      raise ConfigError(
          f"{field}={n}: the trainer slice lies on one host of {processes}; its checkpoints need "
          f"it to span at least two (use {2 * per_host} or more) or colocate (0)")
    replicas, replica_size = sampler_count // per_host, per_host
  if num_devices % (num_slices * per_host):
    raise ConfigError(f"target.num_slices={num_slices}: {num_devices} devices on hosts of "
                      f"{per_host} do not form {num_slices} equal slices of whole hosts")
  trainer_slices = slices_spanned(trainer_count, num_devices, num_slices, field=field)
  trainer = AbstractMesh(multi_slice_mesh_shape(config.mesh.trainer, trainer_count,
                                                trainer_slices, field="config.mesh.trainer"),
                         mesh_axes_of(tuple(config.mesh.trainer)))
  return Layout(trainer=trainer,
                replica=abstract_mesh(config.mesh.sampler, replica_size,
                                      field="config.mesh.sampler"),
                num_replicas=replicas, num_processes=processes, shared=n == 0,
                num_slices=num_slices, trainer_slices=trainer_slices)


def attention_kernel(config, m: ModelConfig, backend: str) -> str:
  """The training attention kernel the run takes on `backend` (`reasoning_rl.kernels`)."""
  window = m.sliding_window if "sliding_attention" in (m.layer_types or ()) else None
  return kernels.choose_training_kernel(config.model.attention_kernel,
                                        backend=backend, softcap=m.attn_logit_softcap,
                                        window=window, sinks=m.attention_sinks)


def attention_bytes_per_token(config, m: ModelConfig, heads: int, seq: int, a: Assumptions,
                              backend: str) -> float:
  """Per token and layer, the training attention's own activations beyond the hidden-width ones:
  the reference holds float32 scores and probabilities over all `seq` keys (O(T²) per row); a
  flash kernel (`reasoning_rl.kernels` on TPU / GPU) only one float32 log-sum-exp per head."""
  if attention_kernel(config, m, backend) == "reference":
    return a.attention_values_per_score * heads * seq * 4
  return heads * 4


def trainer_items(config, m: ModelConfig, mesh: AbstractMesh, a: Assumptions,
                  num_micro_batches: int, shapes: ModelShapes,
                  sync: Sequence[Item] = (), backend: str = "tpu") -> list[Item]:
  """Per-device bytes of the trainer (see the module docstring and `Assumptions`): held weights
  and moments, the train step's transients, and the weight sync's items (`sync_items`).
  `backend` ("tpu", "gpu", "cpu") decides the attention kernel, hence its memory."""
  r, b = config.rollout, Precision.of(config).compute.itemsize
  weights = Precision.of(config).weights
  seq = r.max_prefill_length + r.max_new_tokens
  rows = batch_rows(config) // num_micro_batches
  rows_per_device = -(-rows // split_ways(mesh, "batch", rows))
  heads = m.num_heads // split_ways(mesh, "kv_heads", m.num_kv_heads)
  intermediate = mlp_width_per_token(m) // split_ways(mesh, "mlp", mlp_width_per_token(m))
  per_layer = seq * ((a.activation_values_per_hidden * m.hidden_size
                      + a.activation_values_per_intermediate * intermediate) * b
                     + attention_bytes_per_token(config, m, heads, seq, a, backend))
  if config.algo.remat == "full":
    # Only each block's input is kept; one block's activations are rebuilt at a time.
    per_row = m.num_layers * seq * m.hidden_size * b + per_layer
  else:
    per_row = m.num_layers * per_layer
  chunk = min(config.algo.logprob_chunk, r.max_new_tokens)
  vocab = m.vocab_size // split_ways(mesh, "vocab", m.vocab_size)
  compute = Precision.of(config).compute.name
  adapters = shapes.adapters
  trainable_shapes = adapters or shapes.master
  trainable = param_bytes_per_device(trainable_shapes, mesh)
  if adapters:  # the frozen base is never updated: held in the compute dtype
    items = [Item(f"frozen base ({compute}) + adapters (float32)",
                  param_bytes_per_device(shapes.compute, mesh) + trainable)]
  else:
    items = [Item(f"master weights ({weights.name})", trainable)]
  dtype = "float32" if adapters else weights.name
  items.append(Item(f"AdamW moments (m, v; {dtype})", 2 * trainable))
  if config.beta > 0 and not adapters:  # with LoRA the base is the reference
    # frozen, it only feeds forward passes: held in the compute dtype
    items.append(Item(f"reference weights ({compute})",
                      param_bytes_per_device(shapes.compute, mesh)))
  items.append(Item(f"gradients ({dtype}, one micro-batch)", trainable, "train step"))
  if num_micro_batches > 1:
    accumulator = param_bytes_per_device(with_itemsize(trainable_shapes, 4), mesh)
    items.append(Item("gradient accumulator (float32)", accumulator, "train step"))
  if mesh.shape["fsdp"] > 1:
    items.append(Item("gathered layer weights (fsdp)", int(
        a.gathered_layers * layer_weight_bytes(shapes.compute if adapters else shapes.master,
                                                mesh, m.num_layers)),
        "train step"))
  items += [Item(f"activations (1 micro-batch; {attention_kernel(config, m, backend)} attention)",
                 int(rows_per_device * per_row), "train step"),
            Item("log-prob chunk buffers",
                 int(a.logprob_buffers * rows_per_device * chunk * vocab * 4), "train step")]
  if step_config(config).truncated_ratio:
    items.append(Item("truncation rebuild buffers (algo.truncated_ratio)", int(
        a.truncation_buffers * rows_per_device * chunk * m.vocab_size * 4), "train step"))
  return items + list(sync)


def mlp_width_per_token(m: ModelConfig) -> int:
  """The MLP hidden width one token's activations span, the widest over layers: the dense MLP's,
  or k experts' of a sparse layer (each token's k rows of the grouped matmuls)."""
  widths = [m.moe.experts_per_token * m.moe.intermediate_size if m.layer_is_sparse(layer)
            else m.intermediate_size for layer in range(m.num_layers)]
  return max(widths)


def kv_cache_bytes(config, m: ModelConfig, mesh: AbstractMesh, slots: int) -> int:
  """Per device: K and V [slots, kv_heads, length, head_dim] per layer in the compute dtype
  (latent attention: its latent and shared RoPE key, `ModelConfig.kv_cache_layout`), sharded as
  the engine shards them, + the int32 positions [slots, length]."""
  length, b = sampler_cache_length(config), Precision.of(config).compute.itemsize
  kv = sum(shard_size(("batch", "kv_heads", "length", "head_dim"),
                      (slots, heads, length, width), mesh)
           for heads, width in m.kv_cache_layout())
  positions = shard_size(("batch", "length"), (slots, length), mesh)
  return m.num_layers * kv * b + 4 * positions


def kv_pool_pages(config, slots: int) -> int:
  """Pages in the paged cache's pool: `rollout.kv_pages`, or every slot's whole length."""
  r = config.rollout
  return r.kv_pages or slots * -(-sampler_cache_length(config) // r.kv_page_size)


def kv_pool_bytes(config, m: ModelConfig, mesh: AbstractMesh, slots: int,
                  backend: str = "tpu") -> tuple[int, int]:
  """Per device, the paged cache of `rollout.kv_page_size` (sampler/paged.py): (its pool of
  `rollout.kv_pages` pages — K and V [kv_heads, pages, page, head_dim] per layer, kv_heads
  sharded as the engine shards them, pages replicated — and the int32 positions [pages, page];
  the contiguous rows one decode layer gathers them into, [slots, kv_heads, length, head_dim]
  of K and V, none where the TPU kernel reads every layer's pages in place:
  `rollout.kv_page_kernel` on `backend`, a model without sliding-window layers or attention
  sinks). Latent attention's pool and rows hold its latent and shared RoPE key instead of K and
  V (`ModelConfig.kv_cache_layout`)."""
  r, precision = config.rollout, Precision.of(config)
  b = precision.compute.itemsize
  length = sampler_cache_length(config)
  pages = kv_pool_pages(config, slots)
  layout = m.kv_cache_layout()
  pool = sum(shard_size(("kv_heads", None, None, "head_dim"),
                        (heads, pages, r.kv_page_size, width), mesh) for heads, width in layout)
  layer_rows = sum(shard_size(("batch", "kv_heads", "length", "head_dim"),
                              (slots, heads, length, width), mesh) for heads, width in layout)
  kernel = kernels.paged.choose_paged_kernel(r.kv_page_kernel, backend=backend,
                                             dtype=precision.compute, head_dim=m.head_dim,
                                             latent_attention=m.mla is not None)
  if kernel == "pallas_tpu" and "sliding_attention" not in m.layer_types and not m.attention_sinks:
    layer_rows = 0  # every layer read in place (`kernels.paged.runs_kernel`), none gathered
  return m.num_layers * pool * b + 4 * pages * r.kv_page_size, layer_rows * b


def sampler_items(config, m: ModelConfig, mesh: AbstractMesh, weights: int, slots: int,
                  receive_bytes: int = 0, engine_copy_bytes: int = 0,
                  backend: str = "tpu") -> list[Item]:
  """Per-device bytes of one sampler replica on `mesh`: its weights (compute dtype), the KV cache
  of all `slots` and the decode state's next-token logits [slots, vocab] (float32), one decode
  step's temporaries (new logits, attention scores and probabilities over the cache), and the
  weights received during a sync: with several processes the weight sync's unpacked arrays and
  then `Engine.update_params`' own copy of them (`sharding.reshard` never aliases), both beside
  the weights in use until the swap. `backend` decides a paged cache's decode kernel."""
  b = Precision.of(config).compute
  quantization = config.rollout.weight_quantization
  # quantized: the projections in int8 / fp8, the rest in the compute dtype
  held = b.name if quantization == "none" else f"{quantization}/{b.name}"
  length = sampler_cache_length(config)
  slots_per_device = slots // split_ways(mesh, "batch", slots)
  heads = m.num_heads // split_ways(mesh, "kv_heads", m.num_kv_heads)
  temporaries = slots_per_device * (m.vocab_size * 4 + heads * length * (4 + b.itemsize))
  r = config.rollout
  if r.kv_page_size:
    pool, layer_rows = kv_pool_bytes(config, m, mesh, slots, backend)
    pages = kv_pool_pages(config, slots)
    cache = Item(f"KV cache ({pages} pages x {r.kv_page_size} tokens, paged)", pool)
    temporaries += layer_rows
  else:
    cache = Item(f"KV cache ({slots} slots x {length} tokens)",
                 kv_cache_bytes(config, m, mesh, slots))
  items = [Item(f"weights ({held})", weights), cache,
           Item("next-token logits (float32)", slots_per_device * m.vocab_size * 4),
           Item("decode temporaries", temporaries, "decode")]
  if receive_bytes:
    items.append(Item(f"weights received ({held})", receive_bytes, "weight sync"))
  if engine_copy_bytes:
    items.append(Item(f"engine's copy of them ({held})", engine_copy_bytes, "weight sync"))
  return items


def _total(items: Sequence[Item]) -> int:
  return SliceMemory("", AbstractMesh((1, 1, 1), MESH_AXES), tuple(items), 0, 0).total


def items_fit(items, chip: ChipSpec, a: Assumptions) -> bool:
  return _total(items) <= chip.hbm_bytes * (1 - a.headroom)


def shared_items(train: Sequence[Item], sample: Sequence[Item]) -> list[Item]:
  """Both roles on the same devices: every item, prefixed with its role."""
  return ([Item(f"trainer: {i.name}", i.bytes, i.phase) for i in train]
          + [Item(f"sampler: {i.name}", i.bytes, i.phase) for i in sample])


def sync_items(layout: Layout, shapes: ModelShapes, precision: Precision) -> list[Item]:
  """What a weight sync adds on each trainer device. Several processes: the send program
  (`multihost.param_sync`) casts to the compute dtype, lays the weights out as a replica wants
  them and packs them into buckets, one replica device's shards per trainer device; the packing
  holds the laid-out shards and the buckets at once. Not counted: the reshard's own temporaries.
  Measured on XLA:CPU when one jit constrained the cast leaves to the send layout and packed them,
  XLA's SPMD partitioner replicated each matrix first ("involuntary full rematerialization"):
  temporaries of 0.97-1.0 x the whole model in float32 (0.5-2 x by layout), which at r1zero's size
  would be 28 GiB per trainer device; param_sync reshards in a jit of its own to avoid that.
  One process: the trainer hands its own arrays over, cast in its own layout when the sampler's
  dtype differs. LoRA adapters are replicated: sent as they are."""
  what = "adapters" if shapes.sends_adapters else "weights"
  if layout.multi_process:
    dtype = "float32" if shapes.sends_adapters else shapes.sampler_dtype(precision)
    items = [Item(f"{what} to send ({dtype}, replica layout)",
                  shapes.sent(layout.replica), "weight sync")]
    items.append(Item(f"{what} laid out to send, before packing", shapes.sent(layout.replica),
                      "weight sync"))
    return items
  if shapes.quantization != "none":  # quantized on the trainer's devices, then handed over
    return [Item(f"{what} quantized for the sampler ({shapes.sampler_dtype(precision)})",
                 param_bytes_per_device(shapes.sampler, layout.trainer), "weight sync")]
  if shapes.sends_adapters or precision.compute == precision.weights:
    return []
  return [Item(f"{what} cast for the sampler ({precision.compute.name})",
               param_bytes_per_device(shapes.compute, layout.trainer), "weight sync")]


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """A run's per-device memory on a target: the slices (`SliceMemory`) and what they were made
  of, which the dry run's throughput and advice reuse.

  config: the config as planned: with the step layout a run on the target would choose written
    into a copy when the config leaves it open (`chosen` says what was chosen and why).
  train / sample: the trainer's and the sampler's items, before a shared slice prefixes them.
  sampler_kwargs: `sampler_items`' sizing arguments other than the slot count.
  """

  config: Any
  chip: ChipSpec
  num_devices: int  # of every slice together
  num_slices: int
  layout: Layout
  precision: Precision
  shapes: ModelShapes
  train: tuple[Item, ...]
  sample: tuple[Item, ...]
  sampler_kwargs: Mapping[str, Any]
  slices: tuple[SliceMemory, ...]
  chosen: tuple[str, ...] = ()

  @property
  def fits(self) -> bool:
    return all(s.fits for s in self.slices)


def memory_plan(config, model_config: ModelConfig, *, target: Mapping,
                assumptions: Assumptions | None = None) -> MemoryPlan:
  """Memory per device of each slice of `target` (`planning.plan` documents `target`).

  Raises ConfigError for an unknown chip, a mesh that does not match the device count, or a split
  that does not fall between hosts."""
  a = assumptions or Assumptions()
  chip, slice_devices = _chip(target)
  num_slices = target.get("num_slices", 1)
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ConfigError(f"target.num_slices={num_slices!r}: must be an integer >= 1")
  num_devices = num_slices * slice_devices
  layout = plan_layout(config, num_devices, chip.devices_per_host, num_slices)
  chosen = ()
  if step_layout.is_open(config):  # as a run on the target would choose them
    config = copy.deepcopy(config)
    chosen = tuple(resolve_layout(config, model_config=model_config, machine=(
        step_layout.Machine(backend=chip.backend, device_bytes=chip.hbm_bytes,
                            num_devices=num_devices, devices_per_host=chip.devices_per_host,
                            num_slices=num_slices))))
  precision = Precision.of(config)
  shapes = ModelShapes.of(config, model_config)
  sync = sync_items(layout, shapes, precision)
  train = trainer_items(config, model_config, layout.trainer, a, config.algo.num_micro_batches,
                        shapes, sync, chip.backend)
  received = shapes.sent(layout.replica)
  sampler_kwargs = dict(weights=shapes.sampler_weights(layout.replica), receive_bytes=received,
                        engine_copy_bytes=received if layout.multi_process else 0,
                        backend=chip.backend)
  sample = sampler_items(config, model_config, layout.replica,
                         slots=config.rollout.max_concurrent_decodes, **sampler_kwargs)
  make = lambda name, mesh, items, replicas=1: SliceMemory(  # noqa: E731
      name, mesh, tuple(items), chip.hbm_bytes, a.headroom, replicas)
  if layout.shared:
    slices = (make("shared", layout.trainer, shared_items(train, sample)),)
  else:
    slices = (make("trainer", layout.trainer, train),
              make("sampler", layout.replica, sample, layout.num_replicas))
  return MemoryPlan(config=config, chip=chip, num_devices=num_devices, num_slices=num_slices,
                    layout=layout, precision=precision, shapes=shapes, train=tuple(train),
                    sample=tuple(sample), sampler_kwargs=sampler_kwargs, slices=slices,
                    chosen=chosen)


def resolve_layout(config, *, machine: step_layout.Machine | None = None,
                   model_config: ModelConfig | None = None) -> list[str]:
  """`step_layout.resolve` with this planner's memory verdicts: writes the packing and
  micro-batch count the config leaves open into it, for `machine` (this process's unless
  given), and returns the lines saying what was chosen and why. `model_config`: the policy's
  architecture, read as the dry run reads it unless given."""
  if config.algo.shared_prompts:  # asked for: refused on a flash kernel before anything runs
    machine = machine or step_layout.this_machine()
    step_layout.require_reference_attention(config, machine.backend)
  if not step_layout.is_open(config):
    return []
  machine = machine or step_layout.this_machine()
  needs_model = config.algo.num_micro_batches == 0 and config.stage == "rl"
  if model_config is None and needs_model:
    try:
      model_config = dry_run_model_config(config)
    except ConfigError as error:
      raise ConfigError(f"{error}; or set config.algo.num_micro_batches (0 chooses it from "
                        "the model's memory plan)") from None
  chip = ChipSpec(f"this {machine.backend}", machine.device_bytes, 1.0, 1.0,
                  devices_per_host=machine.devices_per_host, backend=machine.backend)
  target = {"chip": chip, "num_devices": machine.num_devices // machine.num_slices,
            "num_slices": machine.num_slices}

  def fits(trial) -> bool:
    return memory_plan(trial, model_config, target=target).fits

  trainer_mesh = plan_layout(config, machine.num_devices, machine.devices_per_host,
                             machine.num_slices).trainer

  def batch_split(rows: int) -> int:
    return split_ways(trainer_mesh, "batch", rows)

  return step_layout.resolve(config, machine=machine, fits=fits, batch_split=batch_split)


def dry_run_model_config(config) -> ModelConfig:
  """The architecture to plan with: model.path's config.json (or GGUF metadata) when readable on
  this machine, else `model.hf_config_for_planning` (a config.json dict in the config file); a
  random model (no model.path) is planned from `model.random`; upcycled into experts when
  `model.upcycle` says so (as the run builds it)."""
  model_config = _loaded_model_config(config)
  upcycle = config.model.upcycle
  if upcycle.num_experts:
    model_config = upcycled_config(model_config, num_experts=upcycle.num_experts,
                                   experts_per_token=upcycle.experts_per_token)
  return model_config


def _loaded_model_config(config) -> ModelConfig:
  """`dry_run_model_config` before upcycling."""
  if not config.model.path:
    return random_model_config(config)[0]

  path = storage.path(config.model.path)
  for directory in (path, path / "model"):  # a Hugging Face directory, or a run's workdir
    if (directory / "config.json").exists():
      return ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()),
                                        source=str(directory / "config.json"))
  if path.suffix == ".gguf" and not storage.is_remote(path) and path.exists():
    return gguf_model_config(open_gguf(path), path)
  fallback = config.model.get("hf_config_for_planning")
  if fallback is None:
    raise ConfigError(
        f"config.model.path={config.model.path!r}: not readable here and the config has no "
        "model.hf_config_for_planning (the config.json dict of the target model) to plan with")
  return ModelConfig.from_hf_config(dict(fallback), source="config.model.hf_config_for_planning")
