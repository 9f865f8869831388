"""Loading a model from a training run's workdir ("a checkpoint of ours"), or from any other path.

`load_model(path)` is the loader of every path a user may name: a training run's workdir or one of
its `checkpoints/<step>` directories is read here, anything else (a Hugging Face directory, a
`.gguf` file) by `reasoning_rl.models.load`. It sits above `models/` and `lora`, since a LoRA run's
policy is its base model (loaded through `load_model` again) with the run's adapters on it.

A run writes `WORKDIR/model/` (config.json + tokenizer files) at start-up and Orbax checkpoints of
its whole train state under `WORKDIR/checkpoints/<step>/`. Loading reads only the policy
parameters out of a checkpoint (Orbax partial restore), placed straight on their shardings.
A LoRA run also writes `WORKDIR/model/lora.json` (its settings, where its base came from and the
base's fingerprint): its checkpoints hold adapters, which are loaded onto that base.

Format versions: a step's own (`checkpoint_layout.CHECKPOINT_FORMAT_VERSION`, its manifest's
`checkpoint_manifest.MANIFEST_VERSION`), lora.json's `format_version`
(`LORA_FILE_FORMAT_VERSION`) and run_config.json's (`workdir.RUN_CONFIG_FORMAT_VERSION`); a file
of another version is refused with one line naming it.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from reasoning_rl import lora
from reasoning_rl import models
from reasoning_rl import precision
from reasoning_rl import sharding as sharding_lib
from reasoning_rl import storage
from reasoning_rl.checkpoint_layout import check_format
from reasoning_rl.checkpoint_leaves import nonfinite_leaves
from reasoning_rl.checkpoint_manifest import CheckpointCorruptError, verify_checksums
from reasoning_rl.errors import CheckpointError, ConfigError
from reasoning_rl.models.config import ModelConfig
from reasoning_rl.models.tokenizers import Tokenizer
from reasoning_rl.models.transformer import (abstract_model, create_model, stack_layers,
                                              unstack_layers)
from reasoning_rl.workdir import FINGERPRINT_FILE, read_json_object, run_config_fields

LORA_FILE = "lora.json"
# model/lora.json: {"format_version", "lora": LoraSettings fields, "fingerprint": the base's,
# "base": {"path", "dtype", "random_seed"}}. Written by trainer.write_model_files; the constant
# lives here, beside its reader, because the trainer imports this module and not the reverse.
LORA_FILE_FORMAT_VERSION = 1


def find_run_checkpoint(path) -> tuple[pathlib.Path, pathlib.Path] | None:
  """(workdir, step directory) if `path` is a run workdir or one of its checkpoint steps."""
  if (path / "model" / "config.json").exists() and (path / "checkpoints").is_dir():
    steps = sorted((int(p.name), p) for p in (path / "checkpoints").iterdir()
                   if p.name.isdigit() and (p / "state").is_dir())
    if not steps:
      raise CheckpointError(f"{path}: the run has no complete checkpoint yet under checkpoints/")
    return path, steps[-1][1]
  if path.name.isdigit() and path.parent.name == "checkpoints":
    workdir = path.parent.parent
    if (workdir / "model" / "config.json").exists() and (path / "state").is_dir():
      return workdir, path
  return None


def load_run_checkpoint(workdir: pathlib.Path, step_dir: pathlib.Path, *, dtype="float32",
                        weight_dtype=None, mesh=None):
  """(model, tokenizer) from a run: architecture and tokenizer from model/, weights from step,
  cast to `weight_dtype` (default: the compute dtype `dtype`) whatever dtype they were saved in
  (a run's float32 master weights load as bfloat16 for a bfloat16 sampler)."""
  try:
    verify_checksums(step_dir)
  except CheckpointCorruptError as error:
    raise CheckpointError(f"{error}; load an earlier checkpoints/<step> of the run (resuming "
                          "training moves this one aside)") from None
  check_format(step_dir)

  config = ModelConfig.from_hf_config(json.loads((workdir / "model" / "config.json").read_text()),
                                      source=str(workdir / "model" / "config.json"))
  if mesh is None:
    mesh = sharding_lib.make_mesh((1, 1, 1), devices=[jax.devices()[0]])
  lora_file = workdir / "model" / LORA_FILE
  scanned = scans_layers(workdir)
  if lora_file.exists():  # the checkpoint holds adapters; the base comes from where the run had it
    model = _load_lora_run(read_lora_file(lora_file), config, workdir, step_dir, scanned=scanned,
                           dtype=dtype, mesh=mesh)  # the base is frozen: no master copy
  else:
    graphdef, abstract = abstract_model(config, dtype=dtype, param_dtype=weight_dtype or dtype,
                                        scan_layers=scanned)
    _restore_params(abstract, workdir, step_dir, mesh)
    model = nnx.merge(graphdef, abstract)
  # returned in the loop layout, as every loader returns a model; callers stack it if they scan
  model = unstack_layers(model)
  # tokenizer libraries read local files: a remote workdir's model/ is fetched (and cached) first
  return model, Tokenizer.from_hf_dir(storage.local_copy(str(workdir / "model")))


def scans_layers(workdir) -> bool:
  """Whether a run's checkpoints hold the scanned block stack (its `model.scan_layers`, read from
  run_config.json; a workdir without one was written in the loop layout)."""
  path = workdir / FINGERPRINT_FILE
  if not path.exists():
    return False
  try:
    record = read_json_object(path)
  except (OSError, ValueError) as error:
    raise CheckpointError(f"{path} is unreadable ({error}); it says in which layout the run's "
                          "checkpoints hold their layers: restore it from a backup") from None
  try:
    fields = run_config_fields(path, record)
  except ConfigError as error:  # another format version: a loader's error is a CheckpointError
    raise CheckpointError(str(error)) from None
  return bool(fields.get("model", {}).get("scan_layers", False))


def read_lora_file(path) -> dict:
  """model/lora.json, checked to be of LORA_FILE_FORMAT_VERSION (CheckpointError otherwise)."""
  try:
    record = read_json_object(path)
  except (OSError, ValueError) as error:
    raise CheckpointError(f"{path} is unreadable ({error}); the run's model/ directory is "
                          "damaged: copy it back from a backup of the run") from None
  # Written before versions were: its fields have been version 1's since lora.json exists, so
  # it reads as version 1.
  version = record.get("format_version", 1)
  if version != LORA_FILE_FORMAT_VERSION:
    raise CheckpointError(
        f"{path}: format_version {version!r}, but this reasoning_rl reads version "
        f"{LORA_FILE_FORMAT_VERSION} only; load the run with the reasoning_rl that wrote it")
  return record


def _restore_params(state, workdir, step_dir, mesh) -> None:
  """Fills every Variable of `state` (abstract or not) with the checkpoint's `params` leaf of the
  same path, placed on its partition-rule sharding (Orbax partial restore)."""
  shardings = dict(nnx.to_flat_state(sharding_lib.param_shardings(state, mesh)))
  flat = list(nnx.to_flat_state(state))
  target: dict = {}
  for path, var in flat:
    node = target
    for key in path[:-1]:
      node = node.setdefault(str(key), {})
    node[str(path[-1])] = {"value": jax.ShapeDtypeStruct(var.shape, var.dtype,
                                                         sharding=shardings[path])}
  target = {"params": target}
  # dtype: Orbax casts while reading, so a checkpoint of float32 master weights fills a bfloat16
  # model (and the reverse) without a full-precision copy in memory
  restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype),
                              target)
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        step_dir / "state", args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                        partial_restore=True))
  except Exception as error:  # Orbax raises many types for missing or mismatched leaves
    raise CheckpointError(f"{step_dir}: cannot read the policy parameters ({error}); was it "
                          "written by this run's model/config.json?") from None
  for path, var in flat:
    node = restored["params"]
    for key in path:
      node = node[str(key)]
    if not isinstance(node["value"], jax.Array):  # partial restore leaves absent leaves abstract
      raise CheckpointError(
          f"{step_dir}: parameter {'/'.join(map(str, path))} is not in the checkpoint; "
          f"{workdir / 'model' / 'config.json'} does not describe the checkpointed model")
    var.set_value(node["value"])
  bad = nonfinite_leaves(restored["params"])
  if bad:
    raise CheckpointError(f"{step_dir}: parameter {bad[0]} holds NaN or inf values; load an "
                          "earlier checkpoints/<step> of the run")


def _load_lora_run(record, config, workdir, step_dir, *, scanned, dtype, mesh):
  """A LoRA run's policy: its base (model.path, or the random model of its seed), the adapters
  of `step_dir` on it, checked against the base fingerprint the run recorded. Returned merged
  (a plain model: W + α/r · A B) unless the base is quantized (QLoRA), then adapted."""
  settings = lora.LoraSettings(**record["lora"])
  base = record["base"]
  if base["path"]:
    model, _ = load_model(base["path"], dtype=dtype, mesh=mesh)
  else:
    model = create_model(config, seed=int(base["random_seed"]), dtype=dtype, param_dtype=dtype)
  # adapted in the run's layout: the fingerprint and the checkpoint's paths are that layout's
  adapted = lora.apply_lora(stack_layers(model) if scanned else model, settings)
  adapters, frozen = lora.split_adapters(nnx.state(adapted))
  problem = lora.base_mismatch(record["fingerprint"], lora.base_fingerprint(frozen),
                               checkpoint=step_dir)
  if problem:
    raise CheckpointError(problem)
  _restore_params(adapters, workdir, step_dir, mesh)
  # float32 in the checkpoint; a QLoRA model returned adapted computes with them in `dtype`
  nnx.update(adapted, precision.cast_floating(adapters, dtype))
  return adapted if settings.base_quantization else lora.merged_model(adapted, settings)


def load_model(path: str | os.PathLike, *, dtype: str = "float32",
               weight_dtype: str | None = None, mesh=None):
  """Loads `(model, tokenizer)` from a training run or from anything `models.load` reads.

  Args:
    path: a training run's workdir (its newest complete checkpoint) or one of its
      `checkpoints/<step>` directories; or a Hugging Face directory or a `.gguf` file
      (`reasoning_rl.models.load`). Local or gs://.
    dtype, weight_dtype, mesh: as for `reasoning_rl.models.load`; a run's weights are cast to
      `weight_dtype` (default: `dtype`) whatever dtype they were saved in.

  Raises:
    CheckpointError: naming the file or tensor at fault and what to do.
  """
  found = find_run_checkpoint(storage.path(path))  # Orbax reads gs:// itself
  if found is None:
    return models.load(path, dtype=dtype, weight_dtype=weight_dtype, mesh=mesh)
  return load_run_checkpoint(*found, dtype=dtype, weight_dtype=weight_dtype, mesh=mesh)
