"""LoRA and QLoRA on the policy, through qwix.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685)
trains, for a frozen projection W, two small matrices A (fan-in × r) and B (r × fan-out) and uses
W + (α / r) · A B. B starts at zero, so the adapted model computes exactly what the base computes
until the first update. QLoRA (Dettmers et al. 2023, arXiv:2305.14314) stores the frozen base
quantized (here int8 or NF4, weight-only) and trains the same adapters on top.

qwix adds the adapters by intercepting the matmuls (`jnp.einsum`) that one method of the model
makes. `Transformer.run_blocks` is that method: both the full forward (training, scoring) and
the sampler's cached decode run their blocks through it, so both see the adapters. qwix creates
each adapter as an `nnx.LoRAParam` next to the weight it adapts (`q_proj_lora_a`,
`q_proj_lora_b`, …), which gives the split this module is about:

- adapters: every `LoRAParam` — what the optimizer updates, what checkpoints hold and what the
  sampler receives after each step;
- base: everything else — frozen; with β > 0 also the KL reference (the same model with zero
  adapters), so no second copy of the weights exists.

Targets are modules, matched by `target_modules` (a regex, full match) against module paths such
as `layers/3/attn` (q, k, v, o projections) and `layers/3/mlp` (gate, up, down): qwix adapts every
projection of a matched module. Adapters are replicated over the mesh (rank-r matrices are small
next to the weights they adapt). A scanned model (`model.scan_layers`) is adapted in the loop
layout, so target names are the same, and its adapters are stacked with the layers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from safetensors.numpy import save_file

from reasoning_rl.config_schema import field as field_of
from reasoning_rl.config_schema import sourced
from reasoning_rl.errors import ConfigError
from reasoning_rl.models.checkpoints import hf_tensor_name
from reasoning_rl.models.transformer import stack_layers, unstack_layers
# The adapted state and its merge into the base live with the model (save_hf writes merged
# weights) and are part of this module's interface as well.
from reasoning_rl.models.lora_merge import (  # noqa: F401  pylint: disable=unused-import
    adapted_projections, is_adapted, join, merge_into_base, merged_delta, merged_model,
    plain_graphdef, split_adapters)

QUANTIZATIONS = field_of("lora.base_quantization").check.values  # ("", "int8", "nf4")
SAMPLER_WEIGHTS = field_of("lora.sampler_weights").check.values  # ("adapters", "merged")
PROJECTIONS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "mlp": ("gate_proj", "up_proj", "down_proj")}


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """`config.lora` as a typed view (same names and defaults, reasoning_rl/config_schema.py): rank
  0 = off (full fine-tuning).

  alpha: the adapters' scale is alpha / rank (as PEFT's `lora_alpha`).
  target_modules: regex over module paths (`layers/<i>/attn`, `layers/<i>/mlp`).
  base_quantization: "" (base in model.dtype), "int8" or "nf4" (QLoRA, weight-only).
  quantization_tile: block size along the contracting axis for NF4 scales (0 = one scale per
    output channel; int8 always uses per-channel scales).
  sampler_weights: what the sampler receives after a step — "adapters" (it decodes with base +
    adapters) or "merged" (W + α/r · A B, a plain model).
  """

  rank: int = sourced("lora.rank")
  alpha: float = sourced("lora.alpha")
  target_modules: str = sourced("lora.target_modules")
  base_quantization: str = sourced("lora.base_quantization")
  quantization_tile: int = sourced("lora.quantization_tile")
  sampler_weights: str = sourced("lora.sampler_weights")

  @classmethod
  def from_config(cls, config) -> LoraSettings:
    section = config.get("lora") if hasattr(config, "get") else None
    if section is None:
      return cls()
    return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls) if f.name in section})

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def validate(self) -> None:
    """ConfigError naming the first bad `config.lora` field."""
    if self.base_quantization not in QUANTIZATIONS:
      raise ConfigError(f"config.lora.base_quantization={self.base_quantization!r}: use '' "
                        "(no quantization), 'int8' or 'nf4'")
    if self.sampler_weights not in SAMPLER_WEIGHTS:
      raise ConfigError(f"config.lora.sampler_weights={self.sampler_weights!r}: use 'adapters' "
                        "or 'merged'")
    try:
      re.compile(self.target_modules)
    except re.error as error:
      raise ConfigError(f"config.lora.target_modules={self.target_modules!r}: not a regex "
                        f"({error})") from None
    if not self.enabled and self.base_quantization:
      raise ConfigError(f"config.lora.base_quantization={self.base_quantization!r} quantizes "
                        "the frozen base of LoRA training: set config.lora.rank > 0 as well")
    if self.base_quantization and self.sampler_weights == "merged":
      raise ConfigError("config.lora.sampler_weights='merged' with a quantized base would "
                        "dequantize the whole model for the sampler every step: use 'adapters'")


def _provider(settings: LoraSettings):
  quantization = {}
  if settings.base_quantization:
    quantization["weight_qtype"] = settings.base_quantization
    if settings.base_quantization == "nf4" and settings.quantization_tile:
      quantization["tile_size"] = settings.quantization_tile
  return qwix.LoraProvider(module_path=settings.target_modules, rank=settings.rank,
                           alpha=settings.alpha, **quantization)


def apply_lora(model, settings: LoraSettings, *, seed: int = 0):
  """The model with adapters (and, for QLoRA, a quantized base); `model` itself is unchanged.

  A is initialised by qwix (He-uniform), B at zero. Raises ConfigError when `target_modules`
  matches no module. A scanned model (`scan_layers`) is adapted in the loop layout, where
  `target_modules` names layers, and stacked again: every layer must then be adapted alike.
  """
  settings.validate()
  if model.scan_layers:
    adapted = apply_lora(unstack_layers(model), settings, seed=seed)
    try:
      return stack_layers(adapted)
    except ValueError:
      raise ConfigError(f"config.lora.target_modules={settings.target_modules!r} adapts some "
                        "layers and not others, which a scanned stack (config.model.scan_layers) "
                        r"cannot hold: adapt every layer alike (e.g. layers/\d+/attn)") from None
  config = model.config
  _refuse_latent_attention(config, settings)
  if settings.base_quantization == "nf4" and settings.quantization_tile:
    _check_tiles(config, settings.quantization_tile)
  example = jnp.zeros((1, 1, config.hidden_size), model.dtype)
  positions = jnp.zeros((1, 1), jnp.int32)
  adapted = qwix.apply_lora_to_model(model, _provider(settings), example, positions, positions,
                                     methods=("run_blocks",), rngs=nnx.Rngs(seed))
  adapters = nnx.state(adapted, nnx.LoRAParam)
  if not jax.tree.leaves(adapters):
    paths = sorted({f"layers/{i}/{m}" for i in range(config.num_layers) for m in PROJECTIONS})
    raise ConfigError(f"config.lora.target_modules={settings.target_modules!r} matches no "
                      f"module; module paths look like {paths[:2]}")
  # Adapters are replicated: the base's axis names (which qwix copies onto them) do not fit
  # their shapes, and a rank-r matrix is small.
  # Float32 whatever the base's dtype: adapters are the trained (master) weights, and bfloat16
  # would round small updates away (reasoning_rl/precision.py); the train step and the sampler
  # cast them to the compute dtype where they are used.
  for _, node in nnx.iter_graph(adapted):
    if isinstance(node, nnx.LoRAParam):
      node.set_metadata("logical_axes", (None,) * node.ndim)
      node.set_value(node[...].astype(jnp.float32))
  adapted.lora_settings = settings  # static: merging and export read the scale from it
  return adapted


def _refuse_latent_attention(config, settings: LoraSettings) -> None:
  """qwix adds an adapter where the forward multiplies by the whole kernel; latent attention's
  cached decoding (models/mla.py, the absorbed form) multiplies by slices of kv_b_proj, which no
  adapter reaches, so the sampler would decode another model than the one trained."""
  if config.mla is None:
    return
  if any(re.fullmatch(settings.target_modules, f"layers/{i}/attn")
         for i in range(config.num_layers)):
    raise ConfigError(
        f"config.lora.target_modules={settings.target_modules!r} adapts the latent attention "
        f"of this {config.model_type} model, which LoRA does not support (its cached decoding "
        r"folds kv_b_proj into queries and outputs): target the MLPs, e.g. layers/\d+/mlp")


def _check_tiles(config, tile: int) -> None:
  """NF4 scales are per block of `tile` along each projection's last contracting axis."""
  contracting = {"hidden_size": config.hidden_size, "head_dim": config.head_dim,
                 "intermediate_size": config.intermediate_size}
  for name, size in contracting.items():
    if size % tile:
      raise ConfigError(f"config.lora.quantization_tile={tile} must divide every contracting "
                        f"axis of the model; {name}={size} is not a multiple (try a divisor of "
                        f"{np.gcd.reduce(list(contracting.values()))}, or 0 = per channel)")


# ------------------------------------------------------------------------------- state split


def zero_adapters(adapters):
  """Adapters that change nothing: the base model, for the KL reference."""
  return jax.tree.map(jnp.zeros_like, adapters)


def num_bytes(tree) -> int:
  """Bytes of every array in a tree (what a weight sync moves)."""
  return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree)))


# ------------------------------------------------------------------------------- base identity


def _bits(value: jax.Array) -> jax.Array:
  """The value's bit pattern as uint32 (floats bitcast at their own width, integers converted)."""
  if jnp.issubdtype(value.dtype, jnp.floating):
    width = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[value.dtype.itemsize]
    value = jax.lax.bitcast_convert_type(value, width)
  return value.astype(jnp.uint32)


def base_fingerprint(base) -> str:
  """A short hash identifying the frozen base a set of adapters belongs to.

  Built from every leaf's path, shape, dtype and two sums of its bit patterns (plain, and weighted
  by position) in wrapping uint32 arithmetic: exact, so the same weights give the same hash on any
  mesh and in any summation order, at the cost of one pass over the weights on device.
  """
  leaves = jax.tree_util.tree_leaves_with_path(base)

  @jax.jit
  def sums(values):
    out = []
    for value in values:
      bits = _bits(value).reshape(-1)
      weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
      out.append((jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)))
    return out

  totals = jax.device_get(sums([leaf for _, leaf in leaves]))
  digest = hashlib.sha256()
  for (path, leaf), (plain, weighted) in zip(leaves, totals):
    digest.update(f"{jax.tree_util.keystr(path)}|{leaf.shape}|{leaf.dtype}|"
                  f"{int(plain)}|{int(weighted)};".encode())
  return digest.hexdigest()[:16]


def base_mismatch(expected: str | None, actual: str | None, *, checkpoint) -> str | None:
  """The error line when a checkpoint's adapters were trained on another base (None if not)."""
  if expected == actual:
    return None
  if expected is None or actual is None:
    trained = "full fine-tuning" if expected is None else "LoRA adapters"
    now = "LoRA (config.lora.rank > 0)" if expected is None else "full fine-tuning"
    return (f"{checkpoint}: holds a {trained} checkpoint, but this run is configured for {now}: "
            "use the run's own config.lora, or start a new workdir")
  return (f"{checkpoint}: its LoRA adapters were trained on a base model with fingerprint "
          f"{expected}, but this run's base (config.model.path, config.lora.base_quantization) "
          f"has fingerprint {actual}: resume with the base it was trained on, or start a new "
          "workdir")


# ------------------------------------------------------------------------------- PEFT export


def save_peft(model, directory: str | os.PathLike, *,
              base_model_name_or_path: str = "") -> pathlib.Path:
  """Writes the adapters as a PEFT LoRA adapter: adapter_model.safetensors + adapter_config.json.

  `peft.PeftModel.from_pretrained(base, directory)` on the transformers model of the same base
  computes our logits. PEFT's lora_A.weight is [r, fan-in] and lora_B.weight [fan-out, r], with
  fan-in / fan-out flattened as the HF weight flattens them (heads, then head_dim), which is the
  order of our axes; its scale is lora_alpha / r, as ours.
  """
  model = unstack_layers(model)  # PEFT names layers one by one
  settings = model.lora_settings
  adapters, _ = split_adapters(nnx.state(model))
  tensors, targets = {}, []
  rank = settings.rank
  for (module, projection), (a, b) in adapted_projections(adapters).items():
    # the HF module of the adapted weight (its tensor name without ".weight"), under PEFT's prefix
    name = "base_model.model." + hf_tensor_name(
        (*module, projection), model.config)[0].removesuffix(".weight")
    a = np.asarray(jax.device_get(a), np.float32)
    b = np.asarray(jax.device_get(b), np.float32)
    tensors[name + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)
    tensors[name + ".lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T)
    targets.append(name[len("base_model.model."):])
  # A regex matching exactly the adapted modules (PEFT full-matches it against module names):
  # target_modules may select some layers' attention and others' MLP, which a name list can't say.
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": settings.alpha,
      "lora_dropout": 0.0, "bias": "none",
      "target_modules": "|".join(re.escape(t) for t in sorted(targets)),
      "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False,
      "base_model_name_or_path": base_model_name_or_path, "inference_mode": True,
  }
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
  (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
  return directory
