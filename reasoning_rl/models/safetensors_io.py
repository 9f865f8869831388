"""Zero-copy reading of .safetensors files (single or sharded) with clear errors.

The `safetensors` package's numpy reader cannot return bfloat16 tensors, and a framework reader would
stage a whole tensor on one device. Reading the format directly (an 8-byte little-endian header
length, a JSON header of dtype/shape/offsets, then raw little-endian data) through a memory map gives
numpy views for every dtype (bfloat16 via ml_dtypes) and lets a loader hand each device only its
shard. Writing goes through the `safetensors` package.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import struct

import ml_dtypes
import numpy as np

from reasoning_rl.errors import CheckpointError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
  """One .safetensors file, memory-mapped; `tensor(name)` returns a read-only numpy view."""

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    size = self.path.stat().st_size
    with open(self.path, "rb") as f:
      prefix = f.read(8)
      if len(prefix) < 8:
        raise CheckpointError(f"{self.path}: not a safetensors file (shorter than its header); "
                              "re-download or re-save it")
      (header_len,) = struct.unpack("<Q", prefix)
      if 8 + header_len > size:
        raise CheckpointError(f"{self.path}: header claims {header_len} bytes but the file has "
                              f"{size}; the file is truncated, re-download or re-save it")
      try:
        header = json.loads(f.read(header_len))
      except ValueError as e:
        raise CheckpointError(f"{self.path}: unreadable safetensors header ({e})") from None
    self.metadata = header.pop("__metadata__", None) or {}
    self._entries = header
    self._data_start = 8 + header_len
    data_size = size - self._data_start
    for name, entry in header.items():
      end = entry["data_offsets"][1]
      if end > data_size:
        raise CheckpointError(
            f"{self.path}: tensor {name!r} ends at byte {end} of the data section but the file "
            f"holds only {data_size}; the file is truncated, re-download or re-save it")
      if entry["dtype"] not in _DTYPES:
        raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype "
                              f"{entry['dtype']}")
    self._file = open(self.path, "rb")
    self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

  def keys(self):
    return self._entries.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entries[name]["shape"])

  def tensor(self, name: str) -> np.ndarray:
    entry = self._entries[name]
    start, end = entry["data_offsets"]
    dtype = np.dtype(_DTYPES[entry["dtype"]])
    count = (end - start) // dtype.itemsize
    array = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + start)
    return array.reshape(entry["shape"])

  def close(self):
    # Views handed out keep the map alive through their buffer; closing is best effort.
    try:
      if self._map is not None:
        self._map.close()
    except BufferError:
      pass
    self._file.close()


class SafetensorsDirectory:
  """All *.safetensors files of a Hugging Face directory, addressed by tensor name."""

  def __init__(self, directory: str | os.PathLike):
    directory = pathlib.Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
      raise CheckpointError(
          f"{directory}: no *.safetensors files; a Hugging Face checkpoint needs model.safetensors "
          "(or sharded model-0000x-of-0000y.safetensors). Convert .bin weights with "
          "transformers' save_pretrained(safe_serialization=True).")
    self.files = [SafetensorsFile(f) for f in files]
    self._where: dict[str, SafetensorsFile] = {}
    for f in self.files:
      for name in f.keys():
        self._where[name] = f
    index = directory / "model.safetensors.index.json"
    if index.exists():
      expected = json.loads(index.read_text()).get("weight_map", {})
      missing_files = {v for k, v in expected.items() if k not in self._where}
      if missing_files:
        raise CheckpointError(
            f"{index}: lists tensors in {sorted(missing_files)} which are missing or incomplete; "
            "download every shard listed in the index")

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def names(self):
    return self._where.keys()

  def shape(self, name: str):
    return self._where[name].shape(name)

  def path(self, name: str) -> pathlib.Path:
    """The file that holds tensor `name`."""
    return self._where[name].path

  def tensor(self, name: str) -> np.ndarray:
    return self._where[name].tensor(name)

  def close(self):
    for f in self.files:
      f.close()
