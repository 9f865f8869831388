"""Multi-process runs on this machine: weight-sync speed across processes and step time vs the
number of processes sharing one global mesh.

Usage: python -m benchmarks.multihost [--steps 5] [--sync_hidden 1024] [--sync_layers 8]
       [--overlap | --buckets | --channels]

- sync: a random Qwen2-shaped model (hidden --sync_hidden, --sync_layers layers) trained with
  debug_cpu's task, (a) in one process with 2 devices split trainer | sampler (the sync is a
  device-to-device copy inside the process) and (b) in 2 processes of 2 devices, process 0 training
  and process 1 sampling (the sync crosses processes: `reasoning_rl.multihost.param_sync`).
  Seconds per GiB = median `time/sync_s` of steps 2.. / parameter GiB.
- step: debug_cpu colocated on 8 devices in total, as 1 process × 8, 2 × 4 and 4 × 2 devices:
  median `time/step_s` of steps 2.. (step 1 compiles).
- buckets (`--buckets`, only this): 4 processes × 2 devices, 0-1 train, 2-3 sample, debug_cpu's
  model and the --sync_hidden one, with the weight sync's leaves packed into buckets (the
  default) and with one bucket per leaf (`REASONING_RL_SYNC_BUCKET_BYTES=0`: the transfers of
  one device_put per leaf shard, as before the buckets): median `time/sync_s` of steps 2.. and
  the transfers per sync (process 0's log line "weight sync: ...").
- overlap (`--overlap`, only this): the same split run (debug_cpu's model and the --sync_hidden
  one) with `async_rollouts.enabled=False` (sample, then train) and with the split default (batch
  s + 1 sampled while step s trains, one policy version behind): median `time/step_s`, its train
  / sample parts and the policy lag of the trained batches.
- channels (`--channels`, only this; `--revert COMMIT`, `--large`): bytes and seconds per step
  through the coordination store and the bulk files of a 4-process split run, before and after
  the rollouts moved to files (`benchmarks/multihost_channels.py`).
Every process is a real `launch/train.py` (gloo collectives, the coordination service on
127.0.0.1); they share this machine's cores, so more processes also means more contention.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile

from tests import multihost_runs as runs


def _median(rows, key):
  return statistics.median(r[key] for r in rows[1:]) if len(rows) > 1 else float("nan")


def _run(workdir, overrides, *, processes: int, devices_per_process: int):
  if processes == 1:
    result = runs.run_single(workdir, overrides, devices=devices_per_process)
    if result.returncode:
      sys.exit(f"run failed:\n{result.stderr[-3000:]}")
  else:
    runs.DEVICES_PER_PROCESS = devices_per_process
    codes = runs.wait_all(runs.start_processes(workdir, overrides, num_processes=processes))
    if any(codes):
      sys.exit(f"run failed with exit codes {codes}; logs beside {workdir}")
  return runs.metrics_rows(workdir)


def _num_params(workdir) -> int:
  """Parameter count of the run's model (WORKDIR/model/config.json)."""
  from reasoning_rl.models.config import ModelConfig  # pylint: disable=import-outside-toplevel

  return ModelConfig.from_hf_config(
      json.loads((pathlib.Path(workdir) / "model" / "config.json").read_text())).num_params()


def _transfers(workdir) -> str:
  """The transfer count and MB of a sync, from process 0's "weight sync: ..." log line."""
  text = (pathlib.Path(workdir) / "logs" / "train.log").read_text(errors="replace")
  found = re.search(r"weight sync: .*?(\d+) transfers and ([\d.]+) MB", text)
  return f"{found.group(1)} ({found.group(2)} MB)" if found else "?"


def _buckets(common, big, tmp) -> None:
  from reasoning_rl.multihost import param_sync  # pylint: disable=import-outside-toplevel

  print("| model | weight sync | transfers per sync (MB) | time/sync_s (median) | time/step_s |")
  print("|---|---|---|---|---|")
  for model, model_overrides in (("debug_cpu", []), ("random --sync_hidden", big)):
    for name, bucket_bytes in (("one bucket per leaf", "0"), ("buckets", None)):
      if bucket_bytes is None:
        os.environ.pop(param_sync.BUCKET_BYTES_ENV, None)
      else:
        os.environ[param_sync.BUCKET_BYTES_ENV] = bucket_bytes
      workdir = f"{tmp}/buckets_{len(model_overrides)}_{bucket_bytes}/run"
      rows = _run(workdir, common + model_overrides + ["--config.mesh.num_trainer_devices=4"],
                  processes=4, devices_per_process=2)
      print(f"| {model} | {name} | {_transfers(workdir)} | {_median(rows, 'time/sync_s'):.3f} | "
            f"{_median(rows, 'time/step_s'):.2f} |", flush=True)
  os.environ.pop(param_sync.BUCKET_BYTES_ENV, None)


def _overlap(common, big, tmp) -> None:
  """Split devices, synchronous rollouts vs sampled one step ahead (the default there)."""
  print("| split run, 4 processes x 2 devices | rollouts | time/step_s (median) | time/train_s | "
        "time/sample_s | time/sample_ahead_s | policy_lag |")
  print("|---|---|---|---|---|---|---|")
  for model, model_overrides in (("debug_cpu", []), ("random --sync_hidden", big)):
    for name, flag in (("synchronous", ["--config.async_rollouts.enabled=False"]),
                       ("one step ahead (default)", [])):
      workdir = f"{tmp}/overlap_{len(model_overrides)}_{len(flag)}/run"
      split = ["--config.mesh.num_trainer_devices=4"]
      rows = _run(workdir, common + model_overrides + flag + split, processes=4,
                  devices_per_process=2)
      lags = sorted({r["policy_lag"] for r in rows})
      print(f"| {model} | {name} | {_median(rows, 'time/step_s'):.2f} | "
            f"{_median(rows, 'time/train_s'):.2f} | {_median(rows, 'time/sample_s'):.2f} | "
            f"{_median(rows, 'time/sample_ahead_s'):.2f} | {lags} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--sync_hidden", type=int, default=1024)
  parser.add_argument("--sync_layers", type=int, default=8)
  parser.add_argument("--overlap", action="store_true",
                      help="only split runs with synchronous vs one-step-ahead rollouts")
  parser.add_argument("--buckets", action="store_true",
                      help="only the weight sync with and without buckets")
  parser.add_argument("--channels", action="store_true",
                      help="only the bytes and seconds per step through each host channel")
  parser.add_argument("--revert", default=None,
                      help="--channels: the commit whose reasoning_rl/ changes 'before' reverts")
  parser.add_argument("--large", action="store_true", help="--channels: larger rollouts too")
  args = parser.parse_args()
  if args.channels:
    from benchmarks import multihost_channels  # pylint: disable=import-outside-toplevel

    multihost_channels.main(steps=args.steps, revert=args.revert, large=args.large)
    return
  common = [f"--config.total_steps={args.steps}", "--config.eval.num_examples=4",
            "--config.checkpoint.every_steps=1000", "--config.logging.tensorboard=False"]
  h = args.sync_hidden
  big = [f"--config.model.random.hidden_size={h}", f"--config.model.random.intermediate_size={2 * h}",
         f"--config.model.random.num_layers={args.sync_layers}", "--config.model.random.num_heads=8",
         "--config.model.random.num_kv_heads=8", f"--config.model.random.head_dim={h // 8}"]
  if args.overlap:
    tmp = tempfile.mkdtemp(prefix="multihost_bench_")
    print(f"workdirs and logs under {tmp}")
    _overlap(common, big, tmp)
    return
  if args.buckets:
    tmp = tempfile.mkdtemp(prefix="multihost_bench_")
    print(f"workdirs and logs under {tmp}")
    _buckets(common, big, tmp)
    return
  print("| run | parameters | time/sync_s (median) | s per GiB | time/step_s |")
  print("|---|---|---|---|---|")
  tmp = tempfile.mkdtemp(prefix="multihost_bench_")
  print(f"workdirs and logs under {tmp}")
  for name, processes in (("1 process, split 1 | 1 device", 1),
                          ("4 processes × 2 devices, 0-1 train, 2-3 sample", 4)):
    overrides = common + big + ["--config.mesh.num_trainer_devices=" +
                                ("1" if processes == 1 else "4")]
    rows = _run(f"{tmp}/sync{processes}/run", overrides, processes=processes,
                devices_per_process=2)
    params = _num_params(f"{tmp}/sync{processes}/run")
    gib = params * 4 / 2**30
    sync = _median(rows, "time/sync_s")
    print(f"| {name} | {params / 1e6:.0f}M ({gib:.2f} GiB f32) | {sync:.3f} | {sync / gib:.3f} | "
          f"{_median(rows, 'time/step_s'):.2f} |")
  print()
  print("| debug_cpu, colocated, 8 devices as | time/step_s (median) | time/sample_s | time/train_s |")
  print("|---|---|---|---|")
  for processes in (1, 2, 4):
    rows = _run(f"{tmp}/step{processes}/run", common, processes=processes,
                devices_per_process=8 // processes)
    print(f"| {processes} × {8 // processes} | {_median(rows, 'time/step_s'):.3f} | "
          f"{_median(rows, 'time/sample_s'):.3f} | {_median(rows, 'time/train_s'):.3f} |")


if __name__ == "__main__":
  main()
