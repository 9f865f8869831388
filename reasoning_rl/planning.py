"""The `--config.dry_run=True` planner: per-device memory and RL-step throughput of a target slice.

`plan(config, model_config, target={"tpu": "v5p", "num_devices": 32})` lays the run out as it
will run (`reasoning_rl.multihost.topology`): the trainer mesh over the first
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
  sampler (one device of one replica): its weights in the compute dtype, the KV cache of every
           slot its engine holds, the next-token logits of the decode state, one decode step's
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

Throughput is a roofline estimate with stated efficiencies (`Assumptions`): FLOPs come from the
project's one FLOP model, `reasoning_rl.flops` (the same count as the trainer's
`throughput/rl_mfu`), with completions assumed to reach max_new_tokens; training time counts the
recomputation the step executes as well; each replica prefills and decodes its share of the
prompts (every R-th, `loop.rollouts`), a decode step bound by max(HBM bytes read / bandwidth,
FLOPs / peak) on the replica's devices. Host-side verification and the weight sync's transfer
time are not counted.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import textwrap
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh

from reasoning_rl import flops as flops_lib
from reasoning_rl import kernels, step_layout, storage
from reasoning_rl.config import sampler_cache_length
from reasoning_rl.run_settings import random_model_config, rollouts_ahead, step_config
from reasoning_rl.errors import ConfigError
from reasoning_rl.lora import PROJECTIONS, LoraSettings
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.gguf_io import gguf_model_config, open_gguf
from reasoning_rl.models.transformer import abstract_model
from reasoning_rl.models.upcycle import upcycled_config
from reasoning_rl.sharding import (MESH_AXES, batch_devices, count_slices, logical_to_spec,
                                   mesh_axes_of,
                                   multi_slice_mesh_shape, resolve_mesh_shape,
                                   slice_device_counts, slices_spanned)
from reasoning_rl.tpu_chips import (CPU_MACHINE, GIB, TPU_CHIPS, ChipSpec, devices_per_host,
                                    slice_name)


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


@dataclasses.dataclass(frozen=True)
class Throughput:
  """FLOPs and estimated seconds of one RL step (sampling P·G completions + the training step).
  Sampling seconds are one replica's: replicas decode their shares of the prompts in parallel."""

  flops: flops_lib.StepFlops
  num_replicas: int
  rows_per_replica: int  # completions one replica decodes per step
  live_slots: int  # slots a replica's decode step runs (its slots, or fewer rows)
  prefill_s: float
  decode_steps: int  # per replica
  decode_step_s: float
  sample_s: float
  train_s: float
  step_s_sync: float
  step_s_async: float | None  # None when both roles share the devices
  overlapped: bool = False  # the config samples ahead (async_rollouts): step_s_async applies
  # Several slices: the gradient all-reduces over the data axis that cross the data-center
  # network (one per micro-batch), bytes each trainer device sends and receives per step, and
  # their seconds (counted in train_s: the step waits for them).
  dcn_reductions: int = 0
  dcn_bytes_per_device: float = 0.0
  dcn_s: float = 0.0
  # Expert parallelism: bytes one trainer device receives per step over ICI exchanging tokens
  # along the `expert` axis, and their seconds (in train_s): `expert_exchange_traffic`.
  expert_bytes_per_device: float = 0.0
  expert_s: float = 0.0
  # Dynamic sampling: rounds a step samples (`sampling_rounds`) and the first one's seconds;
  # sample_s counts them all. One round without dynamic sampling.
  rounds: int = 1
  first_round_s: float = 0.0

  @property
  def steps_per_hour(self) -> float:
    return 3600.0 / self.step_s_sync

  @property
  def step_s(self) -> float:
    """The step of this config: overlapped when it samples ahead, else synchronous."""
    return self.step_s_async if self.overlapped else self.step_s_sync


@dataclasses.dataclass(frozen=True)
class Preemption:
  """How long a run takes to stop on SIGTERM / SIGINT. The loop acts on a stop request between
  decode calls (`rollout.steps_per_call` decode steps each) and after the train step (one
  compiled program, micro-batches included), then saves the train state; the grace needed is the
  longer of the two waits plus the save."""

  decode_call_s: float
  train_s: float
  checkpoint_bytes_per_device: int  # trainable weights + AdamW moments (the reference is not saved)
  save_s: float
  # the scheduled saves: checkpoint.every_steps and checkpoint.every_minutes (0: none), and the
  # step they are counted in
  every_steps: int = 0
  every_minutes: float = 0.0
  step_s: float = 0.0

  @property
  def grace_s(self) -> float:
    return max(self.decode_call_s, self.train_s) + self.save_s

  @property
  def checkpoint_interval_s(self) -> float:
    """Longest time between two scheduled saves: every_steps steps, or every_minutes rounded up
    to the step it ends in, whichever comes first (inf: no scheduled save)."""
    bounds = [self.every_steps * self.step_s] if self.every_steps else []
    if self.every_minutes:
      bounds.append(self.every_minutes * 60 + self.step_s)
    return min(bounds) if bounds else math.inf

  @property
  def lost_s(self) -> float:
    """Work a preemption loses when its save does not fit the notice: since the last scheduled
    save, with the step under way."""
    return self.checkpoint_interval_s + self.step_s


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
  target_name: str = ""  # of one slice
  num_processes: int = 1
  num_slices: int = 1
  step_layout: tuple[str, ...] = ()  # what the config left open, as chosen for the target

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

  def binding(self) -> str:
    """Which limit binds: a slice's HBM when one does not fit (the most over), else time, with
    the role that sets the step's length and each slice's share of its usable memory."""
    if not self.fits:
      worst = max(self.slices, key=lambda s: s.over_bytes / s.usable)
      return f"{worst.name} HBM ({worst.total / worst.usable:.0%} of usable)"
    t = self.throughput
    shares = ", ".join(f"{s.name} {s.total / s.usable:.0%}" for s in self.slices)
    side = "sampling" if t.sample_s >= t.train_s else "training"
    if t.overlapped:
      waits = "the trainer" if side == "sampling" else "the sampler"
      how = (f"{side} sets the overlapped step ({max(t.sample_s, t.train_s):.1f} s; {waits} "
             f"waits {abs(t.sample_s - t.train_s):.1f} s a step)")
    else:
      how = (f"the synchronous step is sampling {t.sample_s:.1f} s + training {t.train_s:.1f} s "
             f"({side} the larger)")
    return f"time: {how}; memory in use: {shares} of usable"

  def table(self) -> str:
    c, a, t = self.chip, self.assumptions, self.throughput
    hosts = (f" on {self.num_processes} hosts of {self.num_devices // self.num_processes}"
             if self.num_processes > 1 else "")
    name = f" = {self.target_name}" if self.target_name else ""
    if self.num_slices > 1:
      name = f" = {self.num_slices} slices" + (f" of {self.target_name}" if name else "")
    lines = [f"Dry-run plan: {self.model_summary}",
             f"Target: {self.num_devices} x {c.name}{name}{hosts} ({c.hbm_bytes / GIB:.1f} GiB "
             f"HBM, {c.peak_flops / 1e12:.1f} TFLOP/s, {c.hbm_bandwidth / 1e9:.0f} GB/s per "
             "device)"]
    lines += [f"Chosen for this target: {line}" for line in self.step_layout]
    for s in self.slices:
      shape = " ".join(f"{k}={v}" for k, v in s.mesh.shape.items())
      plural = "s" if s.num_devices > 1 else ""
      if s.name == "sampler":
        heading = (f"sampler slice: {s.num_devices} device{plural} = {s.num_replicas} "
                   f"replica(s) of {s.mesh.size}, each its own engine with every slot; a "
                   f"replica's mesh {shape}")
      else:
        heading = f"{s.name} slice: {s.num_devices} device{plural}, mesh {shape}"
      lines += ["", heading, f"  {'per device':<50}{'phase':<13}{'GiB':>9}"]
      lines += [f"  {i.name:<50}{i.phase:<13}{i.bytes / GIB:>9.3f}" for i in s.items]
      peak = f"held + {s.peak_phase}" if s.peak_phase else "held"
      lines.append(f"  {'peak (' + peak + ')':<63}{s.total / GIB:>9.3f}   of {s.usable / GIB:.2f}"
                   f" usable ({a.headroom:.0%} headroom) -> "
                   + ("fits" if s.fits else f"OVER by {s.over_bytes / GIB:.2f} GiB"))
    bandwidth = a.decode_bandwidth_utilisation
    lines += ["", f"Throughput per RL step (train MFU {a.train_mfu:.0%}, prefill MFU "
              f"{a.prefill_mfu:.0%}, decode bound by max(bytes / ({bandwidth:.0%} of HBM "
              f"bandwidth), FLOPs / {a.decode_mfu:.0%} of peak)):",
              f"  sampling   {t.flops.generation / 1e12:12.1f} TFLOP   per replica "
              f"({t.num_replicas} in parallel): {t.rows_per_replica} completions, "
              f"{t.live_slots} slots live; prefill {t.prefill_s:.2f} s + {t.decode_steps} decode "
              f"steps x {t.decode_step_s * 1e3:.2f} ms = {t.first_round_s:.1f} s",
              *self._rounds_lines(),
              f"  training   {t.flops.training / 1e12:12.1f} TFLOP   {t.train_s:.1f} s (+ "
              f"{t.flops.recomputation / 1e12:.1f} TFLOP recomputed)",
              *self._dcn_lines(), *self._expert_lines(),
              f"  step (sync: sample, then train) {t.step_s_sync:.1f} s -> "
              f"{t.steps_per_hour:.1f} steps/hour" + ("" if t.overlapped else "   <- this config")]
    if t.step_s_async is not None:
      lines.append(f"  step (overlapped: async rollouts, slices work at once) "
                   f"{t.step_s_async:.1f} s -> {3600 / t.step_s_async:.1f} steps/hour"
                   + ("   <- this config" if t.overlapped else ""))
    else:
      lines.append("  step (overlapped): none, both roles share the devices")
    lines += ["  (completions assumed to reach max_new_tokens; verification and weight sync time "
              "not counted)", ""] + self._preemption_lines() + [
                  "", f"Binding limit: {self.binding()}", f"Verdict: {self.verdict()}"]
    return "\n".join(lines)

  def _rounds_lines(self) -> list[str]:
    t, a = self.throughput, self.assumptions
    if t.rounds == 1:
      return []
    return [f"             dynamic sampling: {t.rounds} rounds a step (each refills the "
            f"{a.dynamic_sampling_dropped:.0%} of groups assumed dropped) = {t.sample_s:.1f} s"]

  def _dcn_lines(self) -> list[str]:
    t, c = self.throughput, self.chip
    if not t.dcn_reductions:
      return []
    source = "" if c.dcn_documented else ", assumed: the chip's page gives none"
    return [f"             of which {t.dcn_s:.2f} s: {t.dcn_reductions} gradient all-reduce(s) "
            f"across slices over DCN, {t.dcn_bytes_per_device / GIB:.2f} GiB per device at "
            f"{c.dcn_bandwidth * 8 / 1e9:.0f} Gb/s per chip{source}"]

  def _expert_lines(self) -> list[str]:
    t = self.throughput
    if not t.expert_bytes_per_device:
      return []
    time = (f"{t.expert_s:.2f} s" if t.expert_s
            else "seconds not estimated (no published ICI figure for this chip)")
    return [f"             of which {time}: tokens exchanged along the expert axis (all-gather + "
            f"reduce-scatter per sparse layer and pass), {t.expert_bytes_per_device / GIB:.2f} "
            "GiB received per device over ICI"]

  def _preemption_lines(self) -> list[str]:
    p, a = self.preemption, self.assumptions
    notice = a.preemption_notice_s
    lines = ["Preemption (SIGTERM / SIGINT: acted on between decode calls and after the train "
             "step):",
             f"  longest decode call      {p.decode_call_s:8.2f} s",
             f"  train step               {p.train_s:8.2f} s   (one compiled program: not "
             "interrupted)",
             f"  checkpoint save          {p.save_s:8.2f} s   "
             f"({p.checkpoint_bytes_per_device / GIB:.2f} GiB per trainer device at an assumed "
             f"{a.checkpoint_bytes_per_s_per_device / GIB:.2f} GiB/s) against a notice of "
             f"{notice:.0f} s (Spot)",
             f"  grace needed           ~ {p.grace_s:8.2f} s",
             f"  scheduled saves          {self._cadence()}"]
    if p.grace_s > notice:
      lost = ("everything since the run's start" if math.isinf(p.lost_s)
              else f"up to {p.lost_s / 60:.1f} min of work")
      lines += textwrap.wrap(
          f"warning: more than the {notice:.0f} s a Spot / preemptible TPU VM (or a GKE pod, by "
          "default) gets: a notice that lands mid-step is cut off before the save, and the "
          f"rerun resumes from the last scheduled checkpoint: {lost} per such preemption (set "
          "checkpoint.every_minutes to bound it in time, or shorten the step)", width=98,
          initial_indent="  ", subsequent_indent="  ")
    return lines

  def _cadence(self) -> str:
    p = self.preemption
    given = [f"every {p.every_steps} steps" if p.every_steps else "",
             f"every {p.every_minutes:g} min" if p.every_minutes else ""]
    if math.isinf(p.checkpoint_interval_s):
      return "none"
    return (f"{' or '.join(g for g in given if g)}: at most {p.checkpoint_interval_s / 60:.1f} "
            "min apart")


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
  QLoRA settings (`lora.base_quantization`) the adapted projections at their quantized size.
  Remembered per (architecture, dtype, LoRA settings): tracing a 7B model takes seconds."""
  key = (repr(model_config), str(np.dtype(dtype)), repr(lora))
  if key not in _SHAPES:
    _SHAPES[key] = _parameter_shapes(model_config, dtype, lora)
  return list(_SHAPES[key])


_SHAPES: dict[tuple, list] = {}


def _parameter_shapes(model_config: ModelConfig, dtype, lora) -> list[tuple[tuple, tuple, float]]:
  from flax import nnx  # local: the planner's other parts need no flax

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


  path = tuple(map(str, path))
  return (len(path) == 4 and path[0] == "layers" and path[3] in PROJECTIONS.get(path[2], ())
          and re.fullmatch(lora.target_modules, "/".join(path[:3])) is not None)


def adapter_shapes(model_config: ModelConfig, lora, dtype) -> list[tuple[tuple, tuple, float]]:
  """(axes, shape, bytes per element) of every LoRA adapter (replicated, so axes are None):
  A [fan-in, r] and B [r, fan-out] per adapted projection (`reasoning_rl.lora`)."""
  if lora is None or not lora.enabled:
    return []
  import re  # pylint: disable=import-outside-toplevel


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


@dataclasses.dataclass(frozen=True)
class Precision:
  """The dtypes of a run: `compute` (model.dtype: activations, the KV cache, the sampler's
  weights and what the trainer sends them) and `weights` (model.weight_dtype: the trainer's
  master weights and AdamW moments). Gradients are accumulated in float32; LoRA adapters are
  float32."""

  compute: np.dtype
  weights: np.dtype

  @classmethod
  def of(cls, config) -> "Precision":
    return cls(np.dtype(config.model.dtype),
               np.dtype(config.model.get("weight_dtype", "float32")))


@dataclasses.dataclass(frozen=True)
class ModelShapes:
  """(logical axes, shape, bytes per element) of what each role holds."""

  master: list  # every base parameter in the weight dtype (QLoRA: adapted projections quantized)
  compute: list  # the same in the compute dtype: the sampler's copy and what it is sent
  adapters: list  # LoRA adapters (float32); [] without LoRA
  sends_adapters: bool  # LoRA with lora.sampler_weights = "adapters": the sync sends them alone

  @classmethod
  def of(cls, config, model_config: ModelConfig) -> "ModelShapes":

    lora = LoraSettings.from_config(config)
    precision = Precision.of(config)
    master = parameter_shapes(model_config, precision.weights, lora)
    # the same tensors in the compute dtype (quantized ones keep their size)
    compute = [(axes, shape, precision.compute.itemsize
                if itemsize == precision.weights.itemsize else itemsize)
               for axes, shape, itemsize in master]
    return cls(master=master, compute=compute,
               adapters=adapter_shapes(model_config, lora, "float32"),
               sends_adapters=lora.enabled and lora.sampler_weights == "adapters")

  def sampler_weights(self, mesh: AbstractMesh) -> int:
    """Bytes per device of the sampler's weights on `mesh`: base + adapters, or merged."""
    extra = param_bytes_per_device(self.adapters, mesh) if self.sends_adapters else 0
    return param_bytes_per_device(self.compute, mesh) + extra

  def sent(self, mesh: AbstractMesh) -> int:
    """Bytes per device, laid out as `mesh` wants them, of what a weight sync sends."""
    if self.sends_adapters:
      return param_bytes_per_device(self.adapters, mesh)
    return param_bytes_per_device(self.compute, mesh)


def _with_itemsize(shapes, itemsize: float) -> list:
  return [(axes, shape, itemsize) for axes, shape, _ in shapes]


def attention_kernel(config, m: ModelConfig, backend: str) -> str:
  """The training attention kernel the run takes on `backend` (`reasoning_rl.kernels`)."""
  window = m.sliding_window if "sliding_attention" in (m.layer_types or ()) else None
  return kernels.choose_training_kernel(config.model.get("attention_kernel", "auto"),
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
  rows = (r.num_prompts * r.num_samples) // num_micro_batches
  rows_per_device = -(-rows // _split(mesh, "batch", rows))
  heads = m.num_heads // _split(mesh, "kv_heads", m.num_kv_heads)
  intermediate = mlp_width_per_token(m) // _split(mesh, "mlp", mlp_width_per_token(m))
  per_layer = seq * ((a.activation_values_per_hidden * m.hidden_size
                      + a.activation_values_per_intermediate * intermediate) * b
                     + attention_bytes_per_token(config, m, heads, seq, a, backend))
  if config.algo.remat == "full":
    # Only each block's input is kept; one block's activations are rebuilt at a time.
    per_row = m.num_layers * seq * m.hidden_size * b + per_layer
  else:
    per_row = m.num_layers * per_layer
  chunk = min(config.algo.logprob_chunk, r.max_new_tokens)
  vocab = m.vocab_size // _split(mesh, "vocab", m.vocab_size)
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
    accumulator = param_bytes_per_device(_with_itemsize(trainable_shapes, 4), mesh)
    items.append(Item("gradient accumulator (float32)", accumulator, "train step"))
  if mesh.shape["fsdp"] > 1:
    items.append(Item("gathered layer weights (fsdp)", int(
        a.gathered_layers * _layer_weight_bytes(shapes.compute if adapters else shapes.master,
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


def expert_exchange_traffic(config, m: ModelConfig, layout: Layout, chip: ChipSpec
                            ) -> tuple[float, float]:
  """(bytes each trainer device receives, seconds) of one step's token exchange between the
  devices of an `expert` mesh axis (`reasoning_rl.models.moe`, expert parallelism): per sparse
  layer and forward, an all-gather of the group's tokens and a reduce-scatter of the partial
  outputs, (e − 1) · tokens per device · D values each; a backward pass makes both again. Over
  ICI, at half the chip's bidirectional bandwidth (`ICI_BYTES_PER_S`, per direction); 0 without
  an expert axis or a MoE model."""
  ways = layout.trainer.shape.get("expert", 1) if "expert" in layout.trainer.axis_names else 1
  if m.moe is None or ways == 1:
    return 0.0, 0.0
  r = config.rollout
  rows = r.num_prompts * r.num_samples
  tokens_per_device = rows * (r.max_prefill_length + r.max_new_tokens) / batch_devices(
      layout.trainer)
  passes = flops_lib.TrainingPasses.of_step(step_config(config))
  forwards = (2 * passes.epochs + int(passes.reference_forward)
              + int(passes.old_logprob_forward))  # a backward exchanges as much as a forward
  per_forward = 2 * (ways - 1) * tokens_per_device * m.hidden_size * Precision.of(
      config).compute.itemsize
  received = m.moe.num_sparse_layers * forwards * per_forward
  tpu = next((name for name, spec in TPU_CHIPS.items() if spec.name == chip.name), None)
  bandwidth = ICI_BYTES_PER_S.get(tpu, 0.0)
  return received, received / bandwidth if bandwidth else 0.0


# Inter-chip interconnect per direction, bytes/s (half the bidirectional figure of the Cloud TPU
# documentation's chip tables, read 2026-11-28: v5e 1600 Gb/s, v5p 1200 GB/s, v6e 3200 Gb/s);
# chips without a published figure plan no exchange time.
ICI_BYTES_PER_S = {"v5e": 100e9, "v5p": 600e9, "v6e": 200e9}


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
  kernel = kernels.paged.choose_paged_kernel(r.get("kv_page_kernel", "auto"), backend=backend,
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
  length = sampler_cache_length(config)
  slots_per_device = slots // _split(mesh, "batch", slots)
  heads = m.num_heads // _split(mesh, "kv_heads", m.num_kv_heads)
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
  items = [Item(f"weights ({b.name})", weights), cache,
           Item("next-token logits (float32)", slots_per_device * m.vocab_size * 4),
           Item("decode temporaries", temporaries, "decode")]
  if receive_bytes:
    items.append(Item(f"weights received ({b.name})", receive_bytes, "weight sync"))
  if engine_copy_bytes:
    items.append(Item(f"engine's copy of them ({b.name})", engine_copy_bytes, "weight sync"))
  return items


# --------------------------------------------------------------------------- throughput


def step_flops(config, m: ModelConfig) -> flops_lib.StepFlops:
  """FLOPs of one RL step at the config's padded shapes (`reasoning_rl.flops`): P prompts of
  max_prefill_length tokens prefilled once each, P·G completions of max_new_tokens tokens decoded
  against the whole cache of S = prompt + completion slots, and P·G training rows of S tokens
  with the completion positions projected, through the passes the configured step runs."""

  r = config.rollout
  rows, prompt, new = r.num_prompts * r.num_samples, r.max_prefill_length, r.max_new_tokens
  return flops_lib.rl_step_flops(
      m, prompts=r.num_prompts, prompt_tokens=r.num_prompts * prompt, prompt_context=prompt,
      generated_tokens=rows * new, decode_context=prompt + new,
      trained_tokens=rows * (prompt + new), trained_context=prompt + new,
      completion_tokens=rows * new,
      passes=flops_lib.TrainingPasses.of_step(step_config(config)))


def dcn_gradient_traffic(config, layout: Layout, gradient_bytes: float, chip: ChipSpec
                         ) -> tuple[int, float, float]:
  """(all-reduces, bytes per device, seconds) of one step's gradient reductions across the
  trainer's slices, over the data-center network.

  Only the data axis crosses slices (`reasoning_rl.sharding`), so each trainer device all-reduces
  its gradient shard (`gradient_bytes`) with its k − 1 peers in the other slices; a ring
  all-reduce sends and receives 2 (k − 1) / k of the buffer per device (Patarasuk & Yuan 2009,
  "Bandwidth optimal all-reduce algorithms for clusters of workstations"), at the chip's DCN
  bandwidth. XLA reduces each micro-batch's gradient inside the accumulation loop (seen in the
  compiled step's HLO: the data-axis all-reduces sit in the loop body), so a step makes
  updates × micro-batches of them.
  """

  k = layout.trainer_slices
  if k == 1:
    return 0, 0.0, 0.0
  reductions = step_config(config).updates_per_step * config.algo.num_micro_batches
  per_device = reductions * gradient_bytes * 2 * (k - 1) / k
  return reductions, per_device, per_device / chip.dcn_bandwidth


def sampling_rounds(config, a: Assumptions) -> tuple[int, ...]:
  """Prompts sampled in each round of one step: P once; with dynamic sampling (DAPO, Yu et al.
  2025; `loop.rollouts.sample_batch`) each further round refills the groups the round before
  dropped, `a.dynamic_sampling_dropped` of them (rounded down), for at most
  `dynamic_sampling.max_rounds` rounds: a refill whose groups drop again leads to another, until
  less than one prompt is expected to drop."""
  r, ds = config.rollout, config.dynamic_sampling
  rounds = [r.num_prompts]
  if ds.enabled:
    while len(rounds) < ds.max_rounds:
      refill = math.floor(rounds[-1] * a.dynamic_sampling_dropped + 1e-9)
      if refill < 1:
        break
      rounds.append(refill)
  return tuple(rounds)


def throughput(config, m: ModelConfig, chip: ChipSpec, layout: Layout, sampler_weights: int,
               a: Assumptions, gradient_bytes: float = 0.0) -> Throughput:
  """Roofline times. Each of the R replicas prefills and decodes its share of the prompts
  (ceil(P / R) prompts, every R-th) on its own devices; a decode step reads the replica's weights
  and the live slots' KV cache from HBM once (memory-bound) unless its FLOPs take longer. With
  dynamic sampling every refill round (`sampling_rounds`) is sampled the same way and adds to
  the step. On several slices the training time adds the gradient all-reduces over DCN
  (`dcn_gradient_traffic`; `gradient_bytes`: one trainer device's gradient shard)."""
  r = config.rollout
  step = step_flops(config, m)
  per_token = flops_lib.forward_flops(m, 1, r.max_prefill_length + r.max_new_tokens)
  trainer, replica, replicas = layout.trainer, layout.replica, layout.num_replicas
  reductions, dcn_bytes, dcn_s = dcn_gradient_traffic(config, layout, gradient_bytes, chip)
  exchange_bytes, exchange_s = expert_exchange_traffic(config, m, layout, chip)
  train_s = ((step.training + step.recomputation) / (trainer.size * chip.peak_flops * a.train_mfu)
             + dcn_s + exchange_s)

  def one_round(num_prompts: int) -> tuple[int, int, float, int, float]:
    """(rows per replica, live slots, prefill s, decode steps, decode step s) of one round."""
    prompts = -(-num_prompts // replicas)
    rows = prompts * r.num_samples
    slots = r.max_concurrent_decodes
    live = min(slots, rows)
    prefill_s = (step.prefill * prompts / r.num_prompts
                 / (replica.size * chip.peak_flops * a.prefill_mfu))
    read = sampler_weights + kv_cache_bytes(config, m, replica, live)
    memory_s = read / (chip.hbm_bandwidth * a.decode_bandwidth_utilisation)
    compute_s = live * per_token / (replica.size * chip.peak_flops * a.decode_mfu)
    return rows, live, prefill_s, -(-rows // slots) * r.max_new_tokens, max(memory_s, compute_s)

  rounds = [one_round(prompts) for prompts in sampling_rounds(config, a)]
  rows, live, prefill_s, decode_steps, decode_step_s = rounds[0]
  first_s = prefill_s + decode_steps * decode_step_s
  sample_s = sum(p + n * t for _, _, p, n, t in rounds)
  return Throughput(flops=step, num_replicas=replicas, rows_per_replica=rows, live_slots=live,
                    prefill_s=prefill_s, decode_steps=decode_steps, decode_step_s=decode_step_s,
                    sample_s=sample_s, train_s=train_s, step_s_sync=sample_s + train_s,
                    step_s_async=None if layout.shared else max(sample_s, train_s),
                    overlapped=rollouts_ahead(config) and not layout.shared,
                    dcn_reductions=reductions, dcn_bytes_per_device=dcn_bytes, dcn_s=dcn_s,
                    expert_bytes_per_device=exchange_bytes, expert_s=exchange_s,
                    rounds=len(rounds), first_round_s=first_s)


# --------------------------------------------------------------------------- the plan


def _total(items: Sequence[Item]) -> int:
  return SliceMemory("", AbstractMesh((1, 1, 1), MESH_AXES), tuple(items), 0, 0).total


def _fits(items, chip: ChipSpec, a: Assumptions) -> bool:
  return _total(items) <= chip.hbm_bytes * (1 - a.headroom)


def _shared_items(train: Sequence[Item], sample: Sequence[Item]) -> list[Item]:
  """Both roles on the same devices: every item, prefixed with its role."""
  return ([Item(f"trainer: {i.name}", i.bytes, i.phase) for i in train]
          + [Item(f"sampler: {i.name}", i.bytes, i.phase) for i in sample])


def _trainer_fix(config, m, chip, a, trainer, shapes, sync, sample) -> str | None:
  """The first (mesh, micro-batches) that fits: more micro-batches on the configured mesh, then a
  tensor axis (it splits attention heads, the MLP and the vocabulary) with as many as needed.
  `sample`: the sampler's items when it shares the devices (else empty)."""
  batch = config.rollout.num_prompts * config.rollout.num_samples
  current = config.algo.num_micro_batches
  n = trainer.size
  tensor_sizes = [t for t in range(1, n + 1) if n % t == 0 and t >= trainer.shape["tensor"]]
  for t in tensor_sizes:
    mesh = trainer if t == trainer.shape["tensor"] else AbstractMesh((1, n // t, t), MESH_AXES)
    for k in [k for k in range(current, batch + 1) if batch % k == 0]:
      items = trainer_items(config, m, mesh, a, k, shapes, sync, chip.backend)
      if _fits(_shared_items(items, sample) if sample else items, chip, a):
        change = [] if mesh is trainer else [f"mesh.trainer=(1, {n // t}, {t})"]
        change += [] if k == current else [f"algo.num_micro_batches={k}"]
        return " with ".join(change)
  return None


def _advice(config, m, chip, a, layout: Layout, shapes: ModelShapes, train_now, sample_now,
            sampler_kwargs) -> tuple[str, ...]:
  """Concrete changes that would make the over-full slice(s) fit."""
  r = config.rollout
  shared = layout.shared
  hints = []
  train_fits = _fits(_shared_items(train_now, sample_now) if shared else train_now, chip, a)
  sync = [i for i in train_now if i.phase == "weight sync"]
  if not train_fits:
    fix = _trainer_fix(config, m, chip, a, layout.trainer, shapes, sync,
                       sample_now if shared else ())
    if fix:
      hints.append(fix)
    else:
      hints.append("more trainer devices, shorter rows (rollout.max_new_tokens, "
                   "rollout.max_prefill_length) or a chip with more HBM: the step keeps every "
                   "layer's activations and attention scores unless algo.remat")
      if config.beta > 0 and not shapes.adapters:
        reference = param_bytes_per_device(shapes.master, layout.trainer)
        hints.append(f"beta=0 drops the reference ({reference / GIB:.2f} GiB per device)")
  sample_fits = _fits(_shared_items(train_now, sample_now) if shared else sample_now, chip, a)
  if not sample_fits and (not shared or train_fits):
    def fits_with(slots):
      items = sampler_items(config, m, layout.replica, slots=slots, **sampler_kwargs)
      return _fits(_shared_items(train_now, items) if shared else items, chip, a)

    fitting = [s for s in range(r.max_concurrent_decodes - 1, 0, -1) if fits_with(s)]
    if fitting:
      hints.append(f"rollout.max_concurrent_decodes={fitting[0]} (or a shorter "
                   "rollout.max_new_tokens): each replica's KV cache holds every slot")
    else:
      hints.append("more devices per sampler replica (a larger tensor or fsdp axis in "
                   "mesh.sampler, on hosts with more chips) or a chip with more HBM")
  return tuple(hints)


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
    dtype = "float32" if shapes.sends_adapters else precision.compute.name
    items = [Item(f"{what} to send ({dtype}, replica layout)",
                  shapes.sent(layout.replica), "weight sync")]
    items.append(Item(f"{what} laid out to send, before packing", shapes.sent(layout.replica),
                      "weight sync"))
    return items
  if shapes.sends_adapters or precision.compute == precision.weights:
    return []
  return [Item(f"{what} cast for the sampler ({precision.compute.name})",
               param_bytes_per_device(shapes.compute, layout.trainer), "weight sync")]


def plan(config, model_config: ModelConfig, *, target: Mapping,
         assumptions: Assumptions | None = None) -> Plan:
  """Memory per device of each slice and the RL-step throughput for `target`.

  Args:
    config: the training ConfigDict (reasoning_rl.config.base_config fields).
    model_config: the policy's architecture.
    target: {"tpu": "v4"|"v5e"|"v5p"|"v6e"|"v7x"|"cpu", "num_devices": int (JAX devices of one
      slice)}, optionally "num_slices" (default 1) and "devices_per_host" (default: the chip's; a
      CPU target is one process unless given).
    assumptions: efficiencies and headroom; `Assumptions()` by default.

  Raises ConfigError for an unknown chip, a mesh that does not match the device count, or a split
  that does not fall between hosts.
  """
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
  r = config.rollout
  sync = sync_items(layout, shapes, precision)
  train = trainer_items(config, model_config, layout.trainer, a, config.algo.num_micro_batches,
                        shapes, sync, chip.backend)
  sampler_weights = shapes.sampler_weights(layout.replica)
  received = shapes.sent(layout.replica)
  sampler_kwargs = dict(weights=sampler_weights, receive_bytes=received,
                        engine_copy_bytes=received if layout.multi_process else 0,
                        backend=chip.backend)
  sample = sampler_items(config, model_config, layout.replica, slots=r.max_concurrent_decodes,
                         **sampler_kwargs)
  make = lambda name, mesh, items, replicas=1: SliceMemory(  # noqa: E731
      name, mesh, tuple(items), chip.hbm_bytes, a.headroom, replicas)
  if layout.shared:
    slices = (make("shared", layout.trainer, _shared_items(train, sample)),)
  else:
    slices = (make("trainer", layout.trainer, train),
              make("sampler", layout.replica, sample, layout.num_replicas))
  # trainable weights (LoRA: the adapters only), as the trainer slice holds them: their
  # gradients cross slices, and with the AdamW moments they are what a checkpoint saves
  trainable = param_bytes_per_device(shapes.adapters or shapes.master, layout.trainer)
  speed = throughput(config, model_config, chip, layout, sampler_weights, a,
                     gradient_bytes=trainable)
  weight_name = precision.weights.name
  params = f"{model_config.num_params() / 1e9:.3f} B params"
  if model_config.moe is not None:
    moe = model_config.moe
    params += (f" ({model_config.num_params(active=True) / 1e9:.3f} B active: top-"
               f"{moe.experts_per_token} of {moe.num_experts} experts in "
               f"{moe.num_sparse_layers} sparse layers)")
  summary = (f"{model_config.model_type}, {params}, "
             f"{model_config.num_layers} layers x hidden {model_config.hidden_size}, "
             f"compute {precision.compute.name}, master weights {weight_name}; "
             f"P={r.num_prompts} x G={r.num_samples}, prompt {r.max_prefill_length} + completion "
             f"{r.max_new_tokens} tokens, {r.max_concurrent_decodes} decode slots per replica")
  advice = () if all(s.fits for s in slices) else _advice(
      config, model_config, chip, a, layout, shapes, train, sample, sampler_kwargs)
  saved = 3 * trainable  # trainable weights + AdamW m, v
  preemption = Preemption(
      decode_call_s=min(r.steps_per_call, r.max_new_tokens) * speed.decode_step_s,
      train_s=speed.train_s, checkpoint_bytes_per_device=saved,
      save_s=saved / a.checkpoint_bytes_per_s_per_device,
      every_steps=config.checkpoint.every_steps,
      every_minutes=config.checkpoint.get("every_minutes", 0) or 0, step_s=speed.step_s)
  return Plan(chip=chip, num_devices=num_devices, model_summary=summary, slices=slices,
              throughput=speed, assumptions=a, advice=advice, preemption=preemption,
              target_name=(chip.name if "chip" in target
                           else slice_name(str(target["tpu"]), slice_devices)),
              num_processes=layout.num_processes, num_slices=num_slices, step_layout=chosen)


def resolve_layout(config, *, machine: step_layout.Machine | None = None,
                   model_config: ModelConfig | None = None) -> list[str]:
  """`step_layout.resolve` with this planner's memory verdicts: writes the packing and
  micro-batch count the config leaves open into it, for `machine` (this process's unless
  given), and returns the lines saying what was chosen and why. `model_config`: the policy's
  architecture, read as the dry run reads it unless given."""
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
    return plan(trial, model_config, target=target).fits

  trainer_mesh = plan_layout(config, machine.num_devices, machine.devices_per_host,
                             machine.num_slices).trainer

  def batch_split(rows: int) -> int:
    return _split(trainer_mesh, "batch", rows)

  return step_layout.resolve(config, machine=machine, fits=fits, batch_split=batch_split)


def dry_run_model_config(config) -> ModelConfig:
  """The architecture to plan with: model.path's config.json (or GGUF metadata) when readable on
  this machine, else `model.hf_config_for_planning` (a config.json dict in the config file); a
  random model (no model.path) is planned from `model.random`; upcycled into experts when
  `model.upcycle` says so (as the run builds it)."""
  model_config = _loaded_model_config(config)
  upcycle = config.model.get("upcycle")
  if upcycle is not None and upcycle.num_experts:
    model_config = upcycled_config(model_config, num_experts=upcycle.num_experts,
                                   experts_per_token=upcycle.experts_per_token)
  return model_config


def _loaded_model_config(config) -> ModelConfig:
  """`dry_run_model_config` before upcycling."""
  import json


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


def slices_warning(config, model_config: ModelConfig, result: Plan, target: Mapping,
                   assumptions: Assumptions | None = None) -> str | None:
  """On several slices: a warning when the extra slices buy little speed for their cost, i.e. the
  plan's steps per hour are less than 1 + (N - 1) / 2 times one slice's (each slice beyond the
  first returns under half its cost), with both figures; None when they pay, on one slice, or
  when the config cannot run on one slice (its trainer spans several)."""
  n = result.num_slices
  if n == 1:
    return None
  try:
    one = plan(config, model_config, target={**target, "num_slices": 1}, assumptions=assumptions)
  except ConfigError:
    return None
  speedup = one.throughput.step_s / result.throughput.step_s
  if speedup >= 1 + (n - 1) / 2:
    return None
  t = result.throughput
  side = "sampling" if t.sample_s >= t.train_s else "training"
  return (f"warning: {n} slices cost {n}x one slice and plan {speedup:.2f}x its steps/hour "
          f"({3600 / t.step_s:.1f} vs {3600 / one.throughput.step_s:.1f}): {side} sets the step "
          f"({max(t.sample_s, t.train_s):.1f} s) and the extra slices do not shorten it much; "
          "fewer slices cost less for about the same run")


def print_dry_run(config) -> Plan:
  """`launch/train.py --config.dry_run=True`: prints the plan of `config.target` and returns it."""
  target = dict(config.target)
  if target.get("num_devices", 0) == 0:

    slices = count_slices(jax.devices(), config.mesh.num_slices)
    target = {"tpu": target.get("tpu", "cpu"), "num_devices": jax.device_count() // slices,
              "devices_per_host": jax.local_device_count(), "num_slices": slices}
  model_config = dry_run_model_config(config)
  result = plan(config, model_config, target=target)
  print(result.table())
  warning = slices_warning(config, model_config, result, target)
  if warning:
    print(textwrap.fill(warning, width=98))
  return result
