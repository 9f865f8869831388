"""Thin ctypes wrappers over the Linux calls the sandbox supervisor needs (mount, pivot_root, prctl,
capset, keyctl, seccomp), and the set-up steps built from them: a private root file system, a
privilege drop, a fresh session keyring and a system-call filter.

Stdlib-only: imported by the supervisor before it pivots into the new root.
"""

import ctypes
import os
import platform
import resource
import struct

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_GET_SECCOMP = 21
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# NOROOT(+locked), NO_SETUID_FIXUP(+locked), KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE(+locked): a uid-0
# process that execs gains no capabilities, and cannot undo that.
_SECUREBITS_NO_ROOT_POWERS = 0b1110_1111
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_LAST_CAPABILITY = 63

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
  if result != 0:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


def _bytes(text: str | None) -> bytes | None:
  return None if text is None else os.fsencode(text)


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
  _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags),
                     _bytes(data)), f"mount {source} on {target}")


def umount_detached(target: str) -> None:
  _check(_libc.umount2(_bytes(target), MNT_DETACH), f"umount {target}")


def prctl(option: int, arg: int = 0) -> int:
  return _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                     ctypes.c_ulong(0))


def _preserved_mount_flags(path: str) -> int:
  """Flags of the mount holding `path` that a remount inside a user namespace must keep."""
  flags, st = 0, os.statvfs(path).f_flag
  for st_bit, ms_bit in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
                         (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
                         (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
    if st & st_bit:
      flags |= ms_bit
  return flags


def bind_read_only(source: str, target: str) -> None:
  """Bind-mounts `source` at `target` and makes that view read-only, nosuid and nodev."""
  mount(source, target, None, MS_BIND)
  mount(None, target, None,
        MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _preserved_mount_flags(source))


def bind_device_read_only(source: str, target: str) -> None:
  """Bind-mounts the device node `source` at `target` on a read-only, nosuid, noexec view.

  Reads and writes of the device itself still work (they go to its driver, not to the file
  system); what the read-only view refuses is changing the node: chmod, chown, utimes. Without
  it a sandbox whose uid maps to the host's root (a root caller) owns the host's /dev/null.
  """
  mount(source, target, None, MS_BIND)
  mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC
        | (_preserved_mount_flags(source) & ~MS_NODEV))


def build_private_root(new_root: str, read_only_dirs: list[str], devices: list[str],
                       tmpfs_sizes: dict[str, int]) -> None:
  """Assembles a root file system under `new_root` and pivots into it; the host's is unmounted.

  Must run as the init of fresh user, mount and pid namespaces; also forbids creating nested user
  namespaces (a per-namespace limit, the host's value is untouched). The root is an empty tmpfs holding
  only: read-only binds of `read_only_dirs` (host paths, kept at the same path; symlinks such as
  /lib -> usr/lib are recreated as symlinks), the `devices` nodes, a read-only procfs of the new pid
  namespace, and writable tmpfs mounts (path -> size in bytes). The device nodes are bound
  read-only (`bind_device_read_only`). Afterwards "/" is that root and the
  old one is detached, so no path leads back to the host's files.
  """
  # Per-user-namespace limit: the program may not nest a user namespace, where it would regain
  # capabilities (and with them mount, procfs and sysctl tricks).
  with open("/proc/sys/user/max_user_namespaces", "w") as limit:
    limit.write("0")
  mount(None, "/", None, MS_REC | MS_PRIVATE)
  mount("sandbox-root", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
  # Writable tmpfs first, read-only binds after: a read-only dir below a tmpfs path (a venv under
  # /tmp) is then bound on top of the tmpfs instead of being hidden by it.
  for path, size in tmpfs_sizes.items():
    os.makedirs(new_root + path)
    mount("sandbox-tmp", new_root + path, "tmpfs", MS_NOSUID | MS_NODEV,
          f"mode=0777,size={size},nr_inodes=4096")
  for path in sorted(read_only_dirs, key=len):
    target = new_root + path
    if os.path.lexists(target):  # already visible through a parent bind or symlink
      continue
    if os.path.islink(path):
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.symlink(os.readlink(path), target)
    elif os.path.isdir(path):
      os.makedirs(target)
      bind_read_only(path, target)
  os.makedirs(new_root + "/dev")
  for device in devices:
    with open(new_root + device, "w"):
      pass
    bind_device_read_only(device, new_root + device)
  os.makedirs(new_root + "/proc")
  mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
  os.makedirs(new_root + "/.old_root")
  _check(_libc.pivot_root(_bytes(new_root), _bytes(new_root + "/.old_root")), "pivot_root")
  os.chdir("/")
  umount_detached("/.old_root")
  os.rmdir("/.old_root")


def seal_root() -> None:
  """Makes the (tmpfs) root itself read-only; the writable tmpfs mounts stay writable."""
  mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


class _CapHeader(ctypes.Structure):
  _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
  _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
              ("inheritable", ctypes.c_uint32)]


def drop_all_privileges() -> None:
  """Empties every capability set of the calling process for good (bounding, ambient, effective,
  permitted, inheritable), locks root out of regaining any on exec, and sets no_new_privs.

  Steps that need a capability the caller lacks are skipped: then it had nothing to drop there.
  """
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
  for capability in range(_LAST_CAPABILITY + 1):
    if prctl(PR_CAPBSET_DROP, capability) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
      break
  prctl(PR_SET_SECUREBITS, _SECUREBITS_NO_ROOT_POWERS)
  header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
  data = (_CapData * 2)()
  _libc.capset(ctypes.byref(header), data)
  _check(prctl(PR_SET_NO_NEW_PRIVS, 1), "prctl(PR_SET_NO_NEW_PRIVS)")


def apply_limits(limits: dict[str, int]) -> None:
  """Sets rlimits (hard = soft): cpu_s, address_space_bytes, file_size_bytes, processes, open_files.

  The CPU hard limit sits one second above the soft one so the kernel first sends SIGXCPU, which
  tells "ran out of CPU time" apart from a SIGKILL of any other origin.
  """
  resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
  for name, key in (("address_space_bytes", resource.RLIMIT_AS),
                    ("file_size_bytes", resource.RLIMIT_FSIZE),
                    ("processes", resource.RLIMIT_NPROC), ("open_files", resource.RLIMIT_NOFILE)):
    resource.setrlimit(key, (limits[name], limits[name]))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


# ---------------------------------------------------------------------------------------- keys

# keyctl(2), add_key(2) and request_key(2) by architecture, and the seccomp audit architecture.
_KEY_SYSCALLS = {"x86_64": (0xC000003E, {"add_key": 248, "request_key": 249, "keyctl": 250}),
                 "aarch64": (0xC00000B7, {"add_key": 217, "request_key": 218, "keyctl": 219})}
_KEYCTL_JOIN_SESSION_KEYRING = 1
_X32_SYSCALL_BIT = 0x40000000


def join_fresh_session_keyring() -> bool:
  """Replaces the calling process's session keyring by a new anonymous one, so it (and every
  process it starts) no longer possesses the keys of the caller's session. False when the kernel
  or the host's own filter refuses keyctl (then no process here can reach keys at all)."""
  numbers = _KEY_SYSCALLS.get(platform.machine())
  if numbers is None:
    return False
  return _libc.syscall(ctypes.c_long(numbers[1]["keyctl"]),
                       ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)) >= 0


# ------------------------------------------------------------------------------------ seccomp

# Classic BPF as seccomp runs it: instruction codes, and the filter's return values.
_BPF_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_JUMP_EQUAL = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_JUMP_AT_LEAST = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_BPF_RETURN = 0x06  # BPF_RET | BPF_K
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_MODE_FILTER = 2
_EPERM = 1
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # of struct seccomp_data


class _SockFprog(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _instruction(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
  return struct.pack("=HBBI", code, jump_true, jump_false, k)


def key_syscall_filter(machine: str) -> bytes | None:
  """The seccomp program that refuses keyctl, add_key and request_key with EPERM, and every
  system call made through another architecture's entry point (i386's int 0x80 on x86_64, or
  x32) where their numbers differ; None for a machine it has no numbers for."""
  if machine not in _KEY_SYSCALLS:
    return None
  arch, numbers = _KEY_SYSCALLS[machine]
  checks = sorted(numbers.values())
  # Layout: [load arch, arch?, load nr, (x32?), nr == each..., allow, deny]
  body = [("load", _ARCH_OFFSET), ("arch", arch), ("load", _NR_OFFSET)]
  if machine == "x86_64":
    body.append(("at_least", _X32_SYSCALL_BIT))
  body += [("equal", number) for number in checks]
  allow, deny = len(body), len(body) + 1
  program = []
  for index, (kind, value) in enumerate(body):
    if kind == "load":
      program.append(_instruction(_BPF_LOAD_WORD, value))
    elif kind == "arch":  # another architecture: straight to deny
      program.append(_instruction(_BPF_JUMP_EQUAL, value, 0, deny - index - 1))
    else:
      code = _BPF_JUMP_EQUAL if kind == "equal" else _BPF_JUMP_AT_LEAST
      program.append(_instruction(code, value, deny - index - 1, 0))
  program.append(_instruction(_BPF_RETURN, _SECCOMP_RET_ALLOW))
  program.append(_instruction(_BPF_RETURN, _SECCOMP_RET_ERRNO | _EPERM))
  return b"".join(program)


def seccomp_unavailable() -> str | None:
  """Why `refuse_key_syscalls` cannot work here, or None (asked before forking: an error inside
  the child's pre-exec step reaches the parent without its reason)."""
  if key_syscall_filter(platform.machine()) is None:
    return f"no system-call numbers for kernel keys on {platform.machine()} (x86_64, aarch64 only)"
  if _libc.prctl(PR_GET_SECCOMP, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
                 ctypes.c_ulong(0)) < 0:
    return f"the kernel has no seccomp ({os.strerror(ctypes.get_errno())})"
  return None


def refuse_key_syscalls() -> None:
  """Installs `key_syscall_filter` on the calling process (kept across fork and exec; needs
  no_new_privs first). Raises OSError where the kernel has no seccomp filters or the machine is
  not one the filter knows."""
  program = key_syscall_filter(platform.machine())
  if program is None:
    raise OSError(0, f"no system-call numbers for keys on {platform.machine()}")
  fprog = _SockFprog(len(program) // 8, program)
  _check(_libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog),
                     ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl(PR_SET_SECCOMP)")
