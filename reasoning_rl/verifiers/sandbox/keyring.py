"""The caller's kernel keys, for the red teams: plant a key a sandboxed program must not reach,
and check afterwards that it is still there, unrevoked, and that nothing was planted beside it.

A "user" key in the caller's session keyring is what a credential helper (Kerberos, ecryptfs,
a cloud SDK's keyring backend) would leave there. Linux only; `plant` returns None where the
kernel or a host filter refuses keys (then there is nothing a program could reach either).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform

from reasoning_rl.verifiers.sandbox.linux import _KEY_SYSCALLS

_KEYCTL_REVOKE, _KEYCTL_UNLINK, _KEYCTL_SEARCH, _KEYCTL_READ = 3, 9, 10, 11
SESSION_KEYRING, USER_KEYRING, USER_SESSION_KEYRING = -3, -4, -5
_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass(frozen=True)
class PlantedKey:
  """A key in the caller's session keyring: its id, description and payload."""

  serial: int
  description: str
  payload: str


def _numbers() -> dict[str, int] | None:
  entry = _KEY_SYSCALLS.get(platform.machine())
  return entry[1] if entry else None


def _keyctl(*args) -> int:
  numbers = _numbers()
  if numbers is None:
    return -1
  return _libc.syscall(ctypes.c_long(numbers["keyctl"]), *(
      ctypes.c_long(a) if isinstance(a, int) else a for a in args))


def plant(description: str, payload: str) -> PlantedKey | None:
  """Adds a "user" key to this process's session keyring; None where keys are unavailable."""
  numbers = _numbers()
  if numbers is None:
    return None
  data = payload.encode()
  serial = _libc.syscall(ctypes.c_long(numbers["add_key"]), b"user", description.encode(), data,
                         ctypes.c_long(len(data)), ctypes.c_long(SESSION_KEYRING))
  return PlantedKey(serial, description, payload) if serial > 0 else None


def find(description: str) -> tuple[int, int] | None:
  """(key id, keyring) of a "user" key with this description in the caller's session, user or
  user-session keyring, or None."""
  for ring in (SESSION_KEYRING, USER_KEYRING, USER_SESSION_KEYRING):
    serial = _keyctl(_KEYCTL_SEARCH, ring, b"user", description.encode(), 0)
    if serial > 0:
      return serial, ring
  return None


def read(serial: int) -> str | None:
  """The payload of key `serial`, or None when it cannot be read (revoked, gone)."""
  buffer = ctypes.create_string_buffer(4096)
  size = _keyctl(_KEYCTL_READ, serial, buffer, 4096)
  return buffer.raw[:size].decode(errors="replace") if size >= 0 else None


def remove(serial: int, ring: int = SESSION_KEYRING) -> None:
  """Unlinks key `serial` from `ring` (revoked keys included)."""
  _keyctl(_KEYCTL_UNLINK, serial, ring)


def damage(key: PlantedKey | None, planted_description: str) -> str | None:
  """What a program did to the caller's keys: its key revoked or changed, or a key with
  `planted_description` now in the caller's keyrings; None when nothing."""
  if key is not None and read(key.serial) != key.payload:
    why = os.strerror(ctypes.get_errno())
    return f"the caller's key {key.description!r} was revoked or changed ({why})"
  planted = False
  for _ in range(8):  # one per keyring it may have reached, and then some
    found = find(planted_description)
    if found is None:
      break
    planted = True
    remove(*found)
  if planted:
    return f"a key {planted_description!r} was planted in the caller's keyrings"
  return None
