"""A memory cgroup per sandbox run: one limit for every process the program starts, together.

Rlimits bound each process on its own (four processes of 200 MB pass a 256 MB address-space
limit); a cgroup's memory controller bounds their sum. The host side (trusted, outside every
namespace) creates a child cgroup for the run under the caller's own cgroup (v1) or beside it (v2),
writes the limit, and hands the child's `cgroup.procs` path to the supervisor, which opens it
before it leaves the host's file system and moves the program's process in before that process
drops its privileges; every process the program forks is born inside. After the run the host
kills whatever is left in it and removes it.

Where it works: cgroup v1 with a writable memory hierarchy (root, or a container that mounts it
writable, as here); cgroup v2 where the caller may create a cgroup with the memory controller
either below its own cgroup (which then must be the hierarchy's root) or beside it (a delegated
subtree). Elsewhere `find_parent` says why not, and the supervisor falls back to polling the
memory of the sandbox's processes (see `sandbox/__init__.py`).

Stdlib only, no JAX: imported by the code verifier's worker processes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time

_CHILD_PREFIX = "rrl-sandbox-"
_REMOVE_WAIT_S = 2.0


@dataclasses.dataclass(frozen=True)
class MemoryCgroup:
  """The cgroup of one run. `version` is 1 or 2; `directory` the cgroup's directory."""

  version: int
  directory: str

  @property
  def procs_file(self) -> str:
    return os.path.join(self.directory, "cgroup.procs")

  def oom_kills(self) -> int:
    """How many processes the kernel killed for crossing the limit (0 if it does not say)."""
    name = "memory.events" if self.version == 2 else "memory.oom_control"
    try:
      with open(os.path.join(self.directory, name)) as handle:
        for line in handle:
          key, _, value = line.partition(" ")
          if key == "oom_kill":
            return int(value)
    except (OSError, ValueError):
      pass
    return 0

  def remove(self) -> None:
    """Kills every process still in the cgroup, then removes it (waits up to 2 s for them to go;
    leaves it behind, empty of limits' use, if they do not)."""
    end = time.monotonic() + _REMOVE_WAIT_S
    while True:
      for pid in _members(self.procs_file):
        try:
          os.kill(pid, signal.SIGKILL)
        except OSError:
          pass
      try:
        os.rmdir(self.directory)
        return
      except FileNotFoundError:
        return
      except OSError:
        if time.monotonic() >= end:
          return
        time.sleep(0.01)


def _members(procs_file: str) -> list[int]:
  try:
    with open(procs_file) as handle:
      return [int(line) for line in handle if line.strip()]
  except (OSError, ValueError):
    return []


def _mounts() -> list[tuple[str, str, str, set[str]]]:
  """(mount point, root within the hierarchy, fs type, super options) of each cgroup mount."""
  found = []
  try:
    with open("/proc/self/mountinfo") as handle:
      lines = handle.read().splitlines()
  except OSError:
    return found
  for line in lines:
    fields = line.split()
    if "-" not in fields:
      continue
    separator = fields.index("-")
    fstype = fields[separator + 1]
    if fstype in ("cgroup", "cgroup2") and len(fields) > separator + 3:
      found.append((_unescape(fields[4]), _unescape(fields[3]), fstype,
                    set(fields[separator + 3].split(","))))
  return found


def _unescape(field: str) -> str:
  """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
  for code in ("\\040", "\\011", "\\012", "\\134"):
    field = field.replace(code, chr(int(code[1:], 8)))
  return field


def _own_paths() -> tuple[str | None, str | None]:
  """(v2 path, v1 memory path) of this process's cgroups, from /proc/self/cgroup."""
  unified, memory = None, None
  try:
    with open("/proc/self/cgroup") as handle:
      for line in handle:
        number, controllers, path = line.rstrip("\n").split(":", 2)
        if number == "0" and controllers == "":
          unified = path
        elif "memory" in controllers.split(","):
          memory = path
  except (OSError, ValueError):
    pass
  return unified, memory


def _directory(mount_point: str, root: str, path: str) -> str | None:
  """Where the cgroup `path` of a hierarchy appears under a mount of it whose root is `root`."""
  if root != "/" and path != root and not path.startswith(root.rstrip("/") + "/"):
    return None
  relative = path[len(root):] if root != "/" else path
  return os.path.normpath(mount_point + "/" + relative.lstrip("/"))


def _can_create_child(parent: str) -> bool:
  probe = os.path.join(parent, f"{_CHILD_PREFIX}probe-{os.getpid()}")
  try:
    os.mkdir(probe)
  except OSError:
    return False
  try:
    os.rmdir(probe)
  except OSError:
    pass
  return True


def _v2_parent(mount_point: str, root: str, path: str) -> str | None:
  own = _directory(mount_point, root, path)
  if own is None:
    return None
  # Below our own cgroup only if it may hold both us and children with memory control (the root);
  # else beside it, in its parent, which gives our cgroup its memory controller.
  candidates = [own] + ([os.path.dirname(own)] if own != os.path.normpath(mount_point) else [])
  for candidate in candidates:
    try:
      with open(os.path.join(candidate, "cgroup.subtree_control")) as handle:
        controllers = handle.read().split()
    except OSError:
      continue
    if "memory" in controllers and _can_create_child(candidate):
      return candidate
  return None


@functools.lru_cache(maxsize=1)
def find_parent() -> tuple[int, str] | str:
  """(cgroup version, directory to create run cgroups in), or why none can be used (cached)."""
  unified, memory = _own_paths()
  mounts = _mounts()
  for mount_point, root, fstype, options in mounts:
    if fstype == "cgroup" and "memory" in options and memory is not None:
      own = _directory(mount_point, root, memory)
      if own is not None and os.path.isdir(own) and _can_create_child(own):
        return 1, own
  for mount_point, root, fstype, _ in mounts:
    if fstype == "cgroup2" and unified is not None:
      parent = _v2_parent(mount_point, root, unified)
      if parent is not None:
        return 2, parent
  if not mounts:
    return "no cgroup file system is mounted"
  return ("no memory cgroup can be created here (cgroup v1's memory hierarchy and cgroup v2 are "
          "read-only or not delegated to this user)")


def _write(directory: str, name: str, value: str, *, optional: bool = False) -> None:
  try:
    with open(os.path.join(directory, name), "w") as handle:
      handle.write(value)
  except FileNotFoundError:
    if not optional:
      raise


def create(name: str, limit_bytes: int) -> MemoryCgroup:
  """A new cgroup `rrl-sandbox-NAME` whose processes together may use `limit_bytes` of memory
  (swap included where the kernel accounts it). Raises OSError when it cannot be made."""
  found = find_parent()
  if isinstance(found, str):
    raise OSError(0, found)
  version, parent = found
  group = MemoryCgroup(version, os.path.join(parent, _CHILD_PREFIX + name))
  os.mkdir(group.directory)
  try:
    if version == 2:
      _write(group.directory, "memory.max", str(limit_bytes))
      _write(group.directory, "memory.swap.max", "0", optional=True)
      _write(group.directory, "memory.oom.group", "1", optional=True)  # one dies, all die
    else:
      _write(group.directory, "memory.limit_in_bytes", str(limit_bytes))
      # memory + swap; absent when the kernel does not account swap
      _write(group.directory, "memory.memsw.limit_in_bytes", str(limit_bytes), optional=True)
  except OSError:
    group.remove()
    raise
  return group
