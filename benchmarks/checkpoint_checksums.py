"""Checkpoint manifests: what writing and checking CHECKSUMS.json costs, before and after issue 26.

Usage: python -m benchmarks.checkpoint_checksums [--mib 512]

Saves one checkpoint of `--mib` MiB of random float32 weights (incompressible, like trained
weights) to a local directory and to a gs:// bucket on a fake-gcs-server emulator started here,
then times, on each:
- before: SHA-256 of every file read back (what write_checksums and verify_checksums did);
- after: `write_checksums` / `verify_checksums` as they are now (local: CRC32C of every file;
  gs://: Cloud Storage's own MD5 / CRC32C from one listing, no object read).
Prints one table of seconds. The emulator runs on the same machine: its "before" figure is a
lower bound for the download from a real bucket (42 GiB at r1zero scale, per save and again
per restore), while "after" on gs:// is one listing request whatever the checkpoint's size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time

import jax
import jax.numpy as jnp


def _sha256_all(step_dir) -> int:
  """The former manifest: every file read and hashed with SHA-256; returns bytes read."""
  from reasoning_rl import storage

  total = 0
  for file in storage.list_files(step_dir):
    digest = hashlib.sha256()
    with file.open("rb") as handle:
      for block in iter(lambda: handle.read(1 << 22), b""):
        digest.update(block)
        total += len(block)
  return total


def _timed(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--mib", type=int, default=512)
  args = parser.parse_args()
  from tests import gcs_emulator

  with tempfile.TemporaryDirectory() as scratch:
    server = gcs_emulator.start(scratch)
    server.create_bucket("bench")
    os.environ["STORAGE_EMULATOR_HOST"] = server.url
    from reasoning_rl import checkpoint_manifest, checkpointing

    state = {"w": jax.random.normal(jax.random.key(0), (args.mib << 18,), jnp.float32)}
    rows = []
    try:
      for where in (os.path.join(scratch, "ckpt"), "gs://bench/ckpt"):
        with checkpointing.Checkpointer(where) as ckpt:
          ckpt.save(1, state, {}, force=True)
        step_dir = f"{where}/1"
        rows.append((where.split(":")[0] if "://" in where else "local",
                     _timed(lambda: _sha256_all(step_dir)),
                     _timed(lambda: checkpoint_manifest.write_checksums(step_dir)),
                     _timed(lambda: checkpoint_manifest.verify_checksums(step_dir))))
    finally:
      server.stop()
  print(f"checkpoint of {args.mib} MiB; seconds")
  print(f"{'storage':8s} {'before (SHA-256 read back)':>28s} {'after: write':>13s} "
        f"{'after: verify':>14s}")
  for name, before, write, verify in rows:
    print(f"{name:8s} {before:28.2f} {write:13.2f} {verify:14.2f}")


if __name__ == "__main__":
  main()
