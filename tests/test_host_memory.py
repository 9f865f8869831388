"""keep_freed_memory: a freed large block is reused without new page faults, even from a thread."""

import platform
import subprocess
import sys
import textwrap

import pytest

from reasoning_rl import host_memory

# Allocates, touches and frees 256 MiB three times from a non-main thread (as XLA's workers do)
# and prints the minor page faults of each round.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys, threading
    if sys.argv[1] == "keep":
      from reasoning_rl.host_memory import keep_freed_memory
      assert keep_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    size = 256 << 20
    faults = []
    def rounds():
      for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        libc.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
    print(*faults)
""")

glibc_only = pytest.mark.skipif(not host_memory.runs_on_glibc(), reason="needs glibc")


def _faults_per_round(mode: str) -> list[int]:
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       check=True, timeout=120)
  return [int(n) for n in out.stdout.split()]


@glibc_only
def test_freed_block_is_reused_without_page_faults():
  first, *later = _faults_per_round("keep")
  assert first >= 100  # the first touch faults the block in (4 KiB or 2 MiB pages)
  assert max(later) < 20, later


@glibc_only
def test_default_allocator_faults_every_round():
  # The control: without the setting each round maps, faults in and unmaps a fresh block.
  faults = _faults_per_round("system")
  assert min(faults) >= 100, faults


def test_not_glibc_leaves_the_allocator_alone(monkeypatch):
  monkeypatch.setattr(host_memory, "_applied", False)
  monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
  assert host_memory.keep_freed_memory() is False


def test_agent_runs_do_not_keep_freed_memory_unless_asked():
  from tests.support.configs import debug_config

  plain = debug_config()
  assert plain.keep_freed_host_memory is None and host_memory.wanted(plain)
  agent = debug_config()
  agent.agent.entry = "tests.support.agents:completion_agent"
  assert not host_memory.wanted(agent)  # its heap grows with every prefill it compiles
  for asked in (True, False):
    agent.keep_freed_host_memory = asked
    plain.keep_freed_host_memory = asked
    assert host_memory.wanted(agent) is asked and host_memory.wanted(plain) is asked
