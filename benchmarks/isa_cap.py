"""Run a benchmark as on a CPU without AVX-512: XLA:CPU and YNNPACK capped at AVX2, torch too.

Why: the step's standing against torch differs by machine mostly through the matmul libraries.
On an AMD EPYC with AVX-512, YNNPACK (XLA:CPU's matmuls) runs AVX-512 kernels while torch's
MKL runs its AVX2 ones on AMD, so our matmuls are ~2x torch's there; on an AVX2-only CPU, or on
an Intel CPU where MKL uses AVX-512 too, the two are at parity and the rest of the step decides.
A capped run on the development machine shows that parity case where no such machine is at
hand. It limits instruction sets only: caches, memory bandwidth and clocks stay this machine's,
so a capped figure is not an AVX2 machine's figure (benchmarks/RESULTS.md compares the two).

How, on each side:
- XLA's own generated code: `--xla_cpu_max_isa=AVX2` in XLA_FLAGS (read when the CPU client
  starts).
- YNNPACK: it reads the CPU's features once, through cpuinfo, into the function-local static of
  `ynn::get_supported_arch_flags()`, and picks kernels from it. There is no setting for it, so
  before the first computation this presets that static and its initialisation guard (their
  addresses come from jaxlib's symbol table) to the AVX2 feature set; a process that already ran
  a computation is refused, and the value is checked again when the benchmark ends.
- torch: ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2 (read
  when torch loads).

Processes a benchmark starts (generate_cli's `launch/generate.py`) are not capped: use it with
benchmarks that measure in their own process (profile_decode, rl_step, packing, train_step).

Usage: python -m benchmarks.isa_cap MODULE [ARGS...]
  e.g. python -m benchmarks.isa_cap benchmarks.profile_decode --transformers
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import runpy
import sys

import numpy as np

# ynnpack/base/arch.h's x86 bits: sse2, ssse3, sse41, avx, f16c, avx2, fma3 (AVX-512 from 1 << 7).
AVX2_FEATURES = (1 << 7) - 1
FLAGS_SYMBOL = b"_ZZN3ynn24get_supported_arch_flagsEvE5flags"
GUARD_SYMBOL = b"_ZGVZN3ynn24get_supported_arch_flagsEvE5flags"
TORCH_ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                     "ONEDNN_MAX_CPU_ISA": "AVX2"}
LIBRARY = "libjax_common.so"

_SYMBOL = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("section", "<u2"),
                    ("value", "<u8"), ("size", "<u8")])
_SECTION = np.dtype([("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"),
                     ("offset", "<u8"), ("size", "<u8"), ("link", "<u4"), ("info", "<u4"),
                     ("addralign", "<u8"), ("entsize", "<u8")])
_SYMTAB = 2


def symbol_offsets(path: pathlib.Path, names: list[bytes]) -> dict[bytes, int]:
  """Each name's value (its offset from the load base) in a 64-bit ELF's static symbol table."""
  with open(path, "rb") as elf:
    def read(offset, size):
      elf.seek(offset)
      return elf.read(size)

    header = read(0, 64)
    if header[:5] != b"\x7fELF\x02":
      raise SystemExit(f"{path} is not a 64-bit ELF file")
    section_offset = int.from_bytes(header[0x28:0x30], "little")
    count = int.from_bytes(header[0x3c:0x3e], "little")
    sections = np.frombuffer(read(section_offset, count * _SECTION.itemsize), _SECTION)
    symtabs = np.flatnonzero(sections["type"] == _SYMTAB)
    if not len(symtabs):
      raise SystemExit(f"{path} has no static symbol table (stripped): cannot find YNNPACK's "
                       "feature flags")
    table = sections[symtabs[0]]
    strings = sections[table["link"]]
    symbols = np.frombuffer(read(int(table["offset"]), int(table["size"])), _SYMBOL)
    text = read(int(strings["offset"]), int(strings["size"]))
  found = {}
  for name in names:
    at = text.find(b"\0" + name + b"\0")
    match = np.flatnonzero(symbols["name"] == at + 1) if at >= 0 else []
    if not len(match):
      raise SystemExit(f"{name.decode()} is not in {path}'s symbol table: this jaxlib's "
                       "YNNPACK keeps its features elsewhere; the cap cannot be applied")
    found[name] = int(symbols[match[0]]["value"])
  return found


def _loaded_library() -> tuple[pathlib.Path, int]:
  """(path, load base) of jaxlib's shared library in this process."""
  for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
    fields = line.split()
    if len(fields) >= 6 and fields[5].endswith(LIBRARY) and int(fields[2], 16) == 0:
      return pathlib.Path(fields[5]), int(fields[0].split("-")[0], 16)
  raise SystemExit(f"{LIBRARY} is not loaded: import jax before capping")


@functools.cache
def _ynnpack_state() -> tuple[ctypes.c_uint64, ctypes.c_uint8]:
  """YNNPACK's cached feature bits and their initialisation guard, in this process's memory (the
  symbol table, ~100 MB, read once)."""
  path, base = _loaded_library()
  at = symbol_offsets(path, [FLAGS_SYMBOL, GUARD_SYMBOL])
  return (ctypes.c_uint64.from_address(base + at[FLAGS_SYMBOL]),
          ctypes.c_uint8.from_address(base + at[GUARD_SYMBOL]))


def ynnpack_features() -> tuple[int, bool]:
  """(the feature bits YNNPACK chose its kernels by, whether it has chosen yet)."""
  flags, guard = _ynnpack_state()
  return flags.value, guard.value != 0


def cap_at_avx2() -> None:
  """Caps this process (module docstring). Call before importing jax's backend or torch."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX2").strip()
  os.environ.update(TORCH_ENVIRONMENT)
  # Importing jax maps jaxlib's library; no computation runs, so YNNPACK has chosen nothing yet.
  import jax  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

  flags, guard = _ynnpack_state()
  if guard.value:
    raise SystemExit("YNNPACK has already chosen its kernels in this process: cap before the "
                     "first computation")
  flags.value = AVX2_FEATURES
  guard.value = 1


def main() -> None:
  if len(sys.argv) < 2:
    raise SystemExit(__doc__.rsplit("Usage:", 1)[1])
  cap_at_avx2()
  module, sys.argv = sys.argv[1], sys.argv[1:]
  runpy.run_module(module, run_name="__main__", alter_sys=True)
  flags, chosen = ynnpack_features()
  if (flags, chosen) != (AVX2_FEATURES, True):
    raise SystemExit(f"the cap did not hold: YNNPACK's features are {flags:#x}")
  print(f"isa_cap: XLA:CPU and YNNPACK ran capped at AVX2 (features {flags:#x})")


if __name__ == "__main__":
  main()
