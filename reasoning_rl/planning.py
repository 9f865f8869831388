"""The `--config.dry_run=True` planner: per-device memory and RL-step throughput of a target slice.

`plan(config, model_config, target={"tpu": "v5p", "num_devices": 32})` takes the per-device
memory of the run laid out on the target from `reasoning_rl.memory_plan` (the model the run itself
uses at start-up; its docstring says what each slice holds) and adds what only the dry run
reports: the step's throughput, the grace a preemption needs, and, for a slice that does not fit,
concrete changes that would make it fit. `print_dry_run` prints the table.

Throughput is a roofline estimate with stated efficiencies (`Assumptions`): FLOPs come from the
project's one FLOP model, `reasoning_rl.flops` (the same count as the trainer's
`throughput/rl_mfu`), with completions assumed to reach max_new_tokens; training time counts the
recomputation the step executes as well; each replica prefills and decodes its share of the
prompts (every R-th, `loop.rollouts`), a decode step bound by max(HBM bytes read / bandwidth,
FLOPs / peak) on the replica's devices. Host-side verification and the weight sync's transfer
time are not counted.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Mapping

import jax
from jax.sharding import AbstractMesh

from reasoning_rl import flops as flops_lib
from reasoning_rl.config import batch_rows
from reasoning_rl.errors import ConfigError
from reasoning_rl.memory_plan import (Assumptions, Layout, SliceMemory, dry_run_model_config,
                                      items_fit, kv_cache_bytes, memory_plan, sampler_items,
                                      shared_items, trainer_items)
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.param_plan import ModelShapes, Precision, param_bytes_per_device
from reasoning_rl.run_settings import rollouts_ahead, step_config
from reasoning_rl.sharding import MESH_AXES, batch_devices, count_slices
from reasoning_rl.tpu_chips import GIB, TPU_CHIPS, ChipSpec, slice_name


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
  rows = batch_rows(config)
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


# --------------------------------------------------------------------------- throughput


def step_flops(config, m: ModelConfig) -> flops_lib.StepFlops:
  """FLOPs of one RL step at the config's padded shapes (`reasoning_rl.flops`): P prompts of
  max_prefill_length tokens prefilled once each, P·G completions of max_new_tokens tokens decoded
  against the whole cache of S = prompt + completion slots, and P·G training rows of S tokens
  (plus an agent run's `agent.segment_rows`) with the completion positions projected, through
  the passes the configured step runs."""

  r = config.rollout
  rows, prompt, new = r.num_prompts * r.num_samples, r.max_prefill_length, r.max_new_tokens
  return flops_lib.rl_step_flops(
      m, prompts=r.num_prompts, prompt_tokens=r.num_prompts * prompt, prompt_context=prompt,
      generated_tokens=rows * new, decode_context=prompt + new,
      trained_tokens=batch_rows(config) * (prompt + new), trained_context=prompt + new,
      completion_tokens=rows * new,
      passes=flops_lib.TrainingPasses.of_step(step_config(config), new))


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


def _trainer_fix(config, m, chip, a, trainer, shapes, sync, sample) -> str | None:
  """The first (mesh, micro-batches) that fits: more micro-batches on the configured mesh, then a
  tensor axis (it splits attention heads, the MLP and the vocabulary) with as many as needed.
  `sample`: the sampler's items when it shares the devices (else empty)."""
  batch = batch_rows(config)
  current = config.algo.num_micro_batches
  n = trainer.size
  tensor_sizes = [t for t in range(1, n + 1) if n % t == 0 and t >= trainer.shape["tensor"]]
  for t in tensor_sizes:
    mesh = trainer if t == trainer.shape["tensor"] else AbstractMesh((1, n // t, t), MESH_AXES)
    for k in [k for k in range(current, batch + 1) if batch % k == 0]:
      items = trainer_items(config, m, mesh, a, k, shapes, sync, chip.backend)
      if items_fit(shared_items(items, sample) if sample else items, chip, a):
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
  train_fits = items_fit(shared_items(train_now, sample_now) if shared else train_now, chip, a)
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
  sample_fits = items_fit(shared_items(train_now, sample_now) if shared else sample_now, chip, a)
  if not sample_fits and (not shared or train_fits):
    def fits_with(slots):
      items = sampler_items(config, m, layout.replica, slots=slots, **sampler_kwargs)
      return items_fit(shared_items(train_now, items) if shared else items, chip, a)

    fitting = [s for s in range(r.max_concurrent_decodes - 1, 0, -1) if fits_with(s)]
    if fitting:
      hints.append(f"rollout.max_concurrent_decodes={fitting[0]} (or a shorter "
                   "rollout.max_new_tokens): each replica's KV cache holds every slot")
    else:
      hints.append("more devices per sampler replica (a larger tensor or fsdp axis in "
                   "mesh.sampler, on hosts with more chips) or a chip with more HBM")
  return tuple(hints)


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
  memory = memory_plan(config, model_config, target=target, assumptions=a)
  config, chip, layout, shapes = memory.config, memory.chip, memory.layout, memory.shapes
  r = config.rollout
  # trainable weights (LoRA: the adapters only), as the trainer slice holds them: their
  # gradients cross slices, and with the AdamW moments they are what a checkpoint saves
  trainable = param_bytes_per_device(shapes.adapters or shapes.master, layout.trainer)
  speed = throughput(config, model_config, chip, layout, memory.sampler_kwargs["weights"], a,
                     gradient_bytes=trainable)
  params = f"{model_config.num_params() / 1e9:.3f} B params"
  if model_config.moe is not None:
    moe = model_config.moe
    params += (f" ({model_config.num_params(active=True) / 1e9:.3f} B active: top-"
               f"{moe.experts_per_token} of {moe.num_experts} experts in "
               f"{moe.num_sparse_layers} sparse layers)")
  summary = (f"{model_config.model_type}, {params}, "
             f"{model_config.num_layers} layers x hidden {model_config.hidden_size}, "
             f"compute {memory.precision.compute.name}, master weights "
             f"{memory.precision.weights.name}"
             + (f", sampler weights {memory.shapes.sampler_dtype(memory.precision)} (projections "
                f"{memory.shapes.quantization})" if memory.shapes.quantization != "none" else "")
             + "; "
             f"P={r.num_prompts} x G={r.num_samples}, prompt {r.max_prefill_length} + completion "
             f"{r.max_new_tokens} tokens, {r.max_concurrent_decodes} decode slots per replica")
  advice = () if memory.fits else _advice(
      config, model_config, chip, a, layout, shapes, memory.train, memory.sample,
      memory.sampler_kwargs)
  saved = 3 * trainable  # trainable weights + AdamW m, v
  preemption = Preemption(
      decode_call_s=min(r.steps_per_call, r.max_new_tokens) * speed.decode_step_s,
      train_s=speed.train_s, checkpoint_bytes_per_device=saved,
      save_s=saved / a.checkpoint_bytes_per_s_per_device,
      every_steps=config.checkpoint.every_steps,
      every_minutes=config.checkpoint.every_minutes, step_s=speed.step_s)
  slice_devices = memory.num_devices // memory.num_slices
  return Plan(chip=chip, num_devices=memory.num_devices, model_summary=summary,
              slices=memory.slices, throughput=speed, assumptions=a, advice=advice,
              preemption=preemption,
              target_name=(chip.name if "chip" in target
                           else slice_name(str(target["tpu"]), slice_devices)),
              num_processes=layout.num_processes, num_slices=memory.num_slices,
              step_layout=memory.chosen)


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
