"""Paths that may be local or on Google Cloud Storage (`gs://bucket/path`), one way to use both.

Every path a run reads or writes goes through `path()`: a local path stays a `pathlib.Path`, a
`gs://` URL becomes an `etils.epath.Path` (the library Orbax uses; its GCS backend is gcsfs). Both
have the pathlib methods the package uses (`/`, `exists`, `read_text`, `write_bytes`, `iterdir`,
`mkdir`, `unlink`). What object storage lacks is done here:

- `atomic_write(path, data)`: readers see the old or the new content, never a torn file. Locally a
  temporary file is fsync'ed and renamed over the target; a GCS object upload is atomic by itself.
- Appending (metrics.jsonl, TensorBoard event files, the run log): GCS objects cannot be appended
  to in place. A remote workdir's append-only files are written to a local *staging* directory
  (`staged(workdir, name)`) and `sync_staged()` copies the new bytes of each to its object with
  GCS's compose operation (upload the new bytes as a temporary object, compose old + new into the
  target, delete the temporary), so each sync moves only what was added. GCS allows about one
  update per second per object, so syncs are rate-limited (`SYNC_INTERVAL_S`) unless forced; the
  trainer forces one before every checkpoint and at exit, so a checkpoint never contains work
  whose metrics are still only on the local disk.
- `list_files(directory)`: every file below a directory (GCS has no real directories and epath
  refuses recursive globs there).
- `stored_checksums(directory)`: {relative path: size, CRC32C, MD5} of every object below a
  `gs://` directory as Cloud Storage keeps them, from one listing: checkpoint manifests on GCS
  read no object (see "Checksums" below). `file_checksums(directory)`: the same figures computed
  from the bytes, for local directories.
- `local_copy(path)`: a local file or directory with the same content, for readers that need a
  real file (memory-mapped GGUF / safetensors, sentencepiece); downloads go to a cache directory
  and are reused when their size and CRC32C still match.

Checksums: Cloud Storage computes a CRC32C of every object from the bytes it stored (and an MD5
of every object not built by compose) and lists them with the object. Recording those
figures after a save and comparing them at restore tells whether an object was replaced,
truncated or rewritten since, without reading it: for a 42 GiB checkpoint that is one listing
call (a page per 1000 objects) instead of a 42 GiB download per save and another per restore.
Both are kept because the CRC32C of a file that ends with its own CRC32C (tensorstore's OCDBT
files do) is the same constant for every such file; the MD5 still tells two of them apart. A
local filesystem keeps no checksums, so local files are read and hashed (CRC32C, in the same
form as GCS's, so a manifest stays checkable after `gcloud storage cp` of a step either way).

Requests: every gcsfs client gets connect and read timeouts (`GCS_CONNECT_TIMEOUT_S`,
`GCS_READ_TIMEOUT_S`: how long a connection may stay silent, not how long a transfer may take).
gcsfs sets none by default, and aiohttp then waits forever for a server that stopped answering:
a run against a stalled store (the emulator once its unread log pipe filled, a half-open
connection to GCS) hung in `fsspec.asyn.sync` with every thread that touched storage, SIGTERM's
save included. With them a dead request fails, gcsfs retries it (6 tries with backoff), and the
run then stops with the storage-failure exit instead of hanging.

Emulator: with `STORAGE_EMULATOR_HOST=http://HOST:PORT` set (the variable Google's own clients
honour), `configure_emulator()` also points tensorstore (Orbax's array storage) at it and needs no
credentials: gcsfs is told to use anonymous access and its gRPC-only bucket-type probe is turned
off (the emulator speaks JSON/HTTP only). `path()` calls it before the first remote path is used.
"""

from __future__ import annotations

import atexit
import base64
import concurrent.futures
import hashlib
import logging
import os
import pathlib
import tempfile
import threading
import time
import uuid
from typing import Any, Union

from reasoning_rl.errors import CheckpointError

log = logging.getLogger("reasoning_rl")

REMOTE_PREFIXES = ("gs://",)
SYNC_INTERVAL_S = 5.0
CACHE_ENV = "REASONING_RL_CACHE"
GCS_CONNECT_TIMEOUT_S = 30.0  # opening a connection to the store
GCS_READ_TIMEOUT_S = 60.0  # a connection that sends nothing for this long is given up (retried)
CHECKSUM_KINDS = ("md5", "crc32c")  # what GCS lists per object, in the order they are compared

AnyPath = Union[pathlib.Path, Any]  # pathlib.Path or etils.epath.Path
_configured: str | None = None  # the emulator address clients were pointed at
_lock = threading.Lock()


def is_remote(value: Any) -> bool:
  """True for object-storage URLs (`gs://…`)."""
  return str(value).startswith(REMOTE_PREFIXES)


def configure_emulator() -> None:
  """Points every storage client at `STORAGE_EMULATOR_HOST` when it is set (idempotent; an
  emulator that moved to another address, as between tests, is picked up), and gives gcsfs
  clients their request timeouts (module docstring, "Requests")."""
  global _configured
  import fsspec  # pylint: disable=import-outside-toplevel
  for protocol in ("gs", "gcs"):  # epath asks fsspec for "gcs", this module for "gs"
    fsspec.config.conf.setdefault(protocol, {}).setdefault("requests_timeout", _request_timeout())
  url = os.environ.get("STORAGE_EMULATOR_HOST") or None
  if url and not url.startswith(("http://", "https://")):
    url = "http://" + url
  if url == _configured:
    return
  previous, _configured = _configured, url
  if not url:
    return
  for name, value in (("TENSORSTORE_GCS_HTTP_URL", url),
                      ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator"),
                      ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")):
    if previous is None or name != "TENSORSTORE_GCS_HTTP_URL":
      os.environ.setdefault(name, value)
    else:
      os.environ[name] = value
  # gcsfs picks its client class when first imported: whoever imported it before this ran (a
  # library, a test) got the gRPC-probing one, whose every first access to a bucket then
  # waited out retries against the emulator. The plain JSON-API class is named explicitly.
  import gcsfs.core  # pylint: disable=import-outside-toplevel
  for protocol in ("gs", "gcs"):
    fsspec.config.conf.setdefault(protocol, {}).setdefault("token", "anon")
    fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
  if previous is not None:
    fsspec.filesystem("gs").clear_instance_cache()  # clients bound to the old address


def _request_timeout() -> Any:
  """aiohttp's per-request timeouts for gcsfs: no bound on a whole transfer (a large upload may
  take minutes), a bound on connecting and on each wait for bytes from the server."""
  import aiohttp  # pylint: disable=import-outside-toplevel
  return aiohttp.ClientTimeout(total=None, sock_connect=GCS_CONNECT_TIMEOUT_S,
                               sock_read=GCS_READ_TIMEOUT_S)


def path(value: str | os.PathLike[str]) -> AnyPath:
  """`pathlib.Path` for local paths, `etils.epath.Path` for `gs://` URLs."""
  if isinstance(value, pathlib.Path):
    return value
  if is_remote(value):
    configure_emulator()
    from etils import epath  # pylint: disable=import-outside-toplevel
    return epath.Path(str(value))
  return pathlib.Path(value)


def _fs_and_key(remote: Any) -> tuple[Any, str]:
  """(gcsfs filesystem, "bucket/key") of a gs:// path."""
  configure_emulator()
  import fsspec  # pylint: disable=import-outside-toplevel
  text = str(remote)
  return fsspec.filesystem("gs"), text[len("gs://"):]


def atomic_write(target: AnyPath, data: bytes | str) -> None:
  """Replaces `target`'s content with `data` so readers never see a torn file."""
  if isinstance(data, str):
    data = data.encode("utf-8")
  target = path(target)
  if is_remote(target):
    target.write_bytes(data)  # one object upload: atomic on GCS
    return
  tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
  with open(tmp, "wb") as handle:
    handle.write(data)
    handle.flush()
    os.fsync(handle.fileno())
  os.replace(tmp, target)


def append_remote(target: AnyPath, data: bytes) -> None:
  """Appends `data` to a gs:// object (creating it) with GCS compose; see the module docstring."""
  if not data:
    return
  fs, key = _fs_and_key(target)
  if not fs.exists(key):
    fs.pipe_file(key, data)
    return
  piece = f"{key}.append-{uuid.uuid4().hex}"
  fs.pipe_file(piece, data)
  try:
    fs.merge(key, [key, piece])
  finally:
    fs.rm_file(piece)
  fs.invalidate_cache(key)


def move(source: AnyPath, target: AnyPath) -> None:
  """Renames a file or directory (a copy then delete on GCS, which has no rename)."""
  source, target = path(source), path(target)
  if is_remote(source):
    fs, key = _fs_and_key(source)
    _, target_key = _fs_and_key(target)
    fs.mv(key, target_key, recursive=True)
    fs.invalidate_cache()
  else:
    os.rename(source, target)


def list_files(directory: AnyPath) -> list[AnyPath]:
  """Every file below `directory`, sorted."""
  directory = path(directory)
  if is_remote(directory):
    fs, key = _fs_and_key(directory)
    fs.invalidate_cache(key)
    return [path("gs://" + name) for name in sorted(fs.find(key))]
  return sorted(p for p in directory.rglob("*") if p.is_file())


def copy_tree(local_dir: pathlib.Path, target_dir: AnyPath) -> None:
  """Copies every file below a local directory to `target_dir` (local or remote), each atomically."""
  target_dir = path(target_dir)
  for file in sorted(p for p in pathlib.Path(local_dir).rglob("*") if p.is_file()):
    target = target_dir / str(file.relative_to(local_dir))
    if not is_remote(target):
      target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, file.read_bytes())


def size(file: AnyPath) -> int:
  """Bytes in a file (epath's stat has no st_size)."""
  file = path(file)
  return file.stat().length if is_remote(file) else file.stat().st_size


def relative_name(file: AnyPath, directory: AnyPath) -> str:
  return str(file)[len(str(directory).rstrip("/")) + 1:]


def _gcs_form(digest: bytes) -> str:
  return base64.b64encode(digest).decode("ascii")  # how GCS lists md5Hash and crc32c


def _hash_file(file: AnyPath, kinds: tuple[str, ...]) -> dict[str, Any]:
  """{"bytes": size, kind: digest} of one file, read once in 4 MiB blocks."""
  import google_crc32c  # pylint: disable=import-outside-toplevel  # gcsfs depends on it

  hashers = {kind: (google_crc32c.Checksum() if kind == "crc32c" else hashlib.new(kind))
             for kind in kinds}
  total = 0
  try:
    with file.open("rb") as handle:
      for block in iter(lambda: handle.read(1 << 22), b""):
        for hasher in hashers.values():
          hasher.update(block)
        total += len(block)
  except FileNotFoundError:
    raise FileNotFoundError(str(file)) from None
  found: dict[str, Any] = {"bytes": total}
  for kind, hasher in hashers.items():
    found[kind] = hasher.hexdigest() if kind == "sha256" else _gcs_form(hasher.digest())
  return found


def file_checksums(directory: AnyPath, names: list[str] | None = None,
                   kinds: tuple[str, ...] | dict[str, tuple[str, ...]] = ("crc32c",)
                   ) -> dict[str, dict[str, Any]]:
  """{relative name: {"bytes": size, kind: digest}} of the files below `directory` (or `names`
  only), computed from their bytes: a few files at a time in threads (the hashes and the reads
  release the GIL). `kinds` are "crc32c" and "md5" (base64, as GCS lists them) or "sha256"
  (hex, the manifests of earlier versions); a dict gives them per name. A missing file raises
  FileNotFoundError naming it. Reads every byte: on gs:// use `stored_checksums` instead.
  """
  directory = path(directory)
  if names is None:
    names = [relative_name(f, directory) for f in list_files(directory)]
  if is_remote(directory):
    fs, key = _fs_and_key(directory)
    fs.invalidate_cache(key)  # listings cached by gcsfs may predate a rewrite
  per_name = kinds if isinstance(kinds, dict) else dict.fromkeys(names, tuple(kinds))
  with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
    found = list(pool.map(lambda name: _hash_file(directory / name, per_name[name]), names))
  return dict(zip(names, found))


def stored_checksums(directory: AnyPath) -> dict[str, dict[str, Any]] | None:
  """{relative name: {"bytes": size, "crc32c": …, "md5": …}} of every object below a gs://
  directory, as Cloud Storage keeps them, from one listing (a request per 1000 objects; no
  object is read). "md5" is absent for composite objects (GCS keeps none for them). None for a
  local directory: a filesystem keeps no checksums, hash its files with `file_checksums`."""
  directory = path(directory)
  if not is_remote(directory):
    return None
  fs, key = _fs_and_key(directory)
  key = key.rstrip("/")
  fs.invalidate_cache(key)  # a cached listing may predate a rewrite
  found = {}
  for name, info in fs.find(key, detail=True).items():
    entry: dict[str, Any] = {"bytes": int(info["size"])}
    for kind, field in (("md5", "md5Hash"), ("crc32c", "crc32c")):
      if info.get(field):
        entry[kind] = str(info[field])
    found[name[len(key) + 1:]] = entry
  return found


# ------------------------------------------------------------------------------ staging


class _Stage:
  """The local staging directory of one remote workdir, and how far each file was copied."""

  def __init__(self, remote_dir: str):
    self.remote_dir = remote_dir.rstrip("/")
    self.local_dir = pathlib.Path(tempfile.mkdtemp(prefix="reasoning_rl-stage-"))
    self.copied: dict[str, int] = {}  # relative name -> bytes of the local file already remote
    self.last_sync = 0.0
    self.failed_forced_sync = False  # a copy before a checkpoint / at the end raised

  def sync(self) -> None:
    for file in sorted(p for p in self.local_dir.rglob("*") if p.is_file()):
      name = str(file.relative_to(self.local_dir))
      size = file.stat().st_size
      done = self.copied.get(name, 0)
      if size == done:
        continue
      with open(file, "rb") as handle:
        if size < done:  # rewritten shorter locally: replace the object
          path(f"{self.remote_dir}/{name}").write_bytes(handle.read())
        else:
          handle.seek(done)
          append_remote(f"{self.remote_dir}/{name}", handle.read(size - done))
      self.copied[name] = size
    self.last_sync = time.monotonic()
    self.failed_forced_sync = False
    _register_exit_hook()


_stages: dict[str, _Stage] = {}


def staged(workdir: AnyPath, name: str, *, download: bool = False) -> pathlib.Path:
  """The local file to append to for `workdir/name`.

  Local workdirs: the file itself. Remote ones: a file in the workdir's staging directory whose
  new bytes `sync_staged` appends to the object; with `download=True` it starts as a copy of the
  object (for files that are read back and rewritten, like metrics.jsonl on resume), otherwise
  empty (what is written is appended after what the object holds).
  """
  if not is_remote(workdir):
    return pathlib.Path(workdir) / name
  with _lock:
    stage = _stages.get(str(workdir))
    if stage is None:
      stage = _stages[str(workdir)] = _Stage(str(workdir))
    local = stage.local_dir / name
    local.parent.mkdir(parents=True, exist_ok=True)
    if download and name not in stage.copied:
      remote = path(f"{stage.remote_dir}/{name}")
      data = remote.read_bytes() if remote.exists() else b""
      local.write_bytes(data)
      stage.copied[name] = len(data)
    return local


def replace_staged(workdir: AnyPath, name: str, data: bytes) -> None:
  """Replaces the whole content of `workdir/name` (local file and, for remote workdirs, object)."""
  local = staged(workdir, name)
  atomic_write(local, data)
  if is_remote(workdir):
    atomic_write(f"{str(workdir).rstrip('/')}/{name}", data)
    with _lock:
      _stages[str(workdir)].copied[name] = len(data)


def sync_staged(*, force: bool = False) -> None:
  """Copies what was appended to staged files to their remote objects.

  Without `force`, a workdir synced less than `SYNC_INTERVAL_S` ago is skipped (GCS's per-object
  update rate) and a failure is a warning (the bytes go with the next sync); with `force` (before
  a checkpoint, at the end) a failure raises CheckpointError, the run's storage-failure exit.
  """
  with _lock:
    for stage in _stages.values():
      if not force and time.monotonic() - stage.last_sync < SYNC_INTERVAL_S:
        continue
      try:
        stage.sync()
      except Exception as error:  # pylint: disable=broad-except  # gcsfs raises many kinds
        if force:
          stage.failed_forced_sync = True
          raise CheckpointError(f"could not copy metrics / logs to {stage.remote_dir} "
                                f"({type(error).__name__}: {error}); check the bucket and "
                                "rerun to resume from the last checkpoint") from error
        # a routine sync: what was not copied stays staged and goes with the next one
        log.warning("copying metrics / logs to %s failed (%r); retrying with the next sync",
                    stage.remote_dir, error)
        stage.last_sync = time.monotonic()


def _sync_at_exit() -> None:
  """The last copy of metrics / logs, unless a forced copy already failed: the run stops with
  that error, and trying again against a store that does not answer would hold the exit for
  another round of request timeouts and retries (minutes)."""
  if any(stage.failed_forced_sync for stage in _stages.values()):
    log.error("metrics / logs not copied to the workdir at exit (an earlier copy failed); they "
              "are in %s", ", ".join(str(stage.local_dir) for stage in _stages.values()))
    return
  try:
    sync_staged(force=True)
  except Exception as error:  # pylint: disable=broad-except
    log.error("could not copy the last metrics / logs to the workdir: %r", error)


_exit_hook_registered = False


def _register_exit_hook() -> None:
  """Registers the final sync after gcsfs is in use: exit hooks run last-registered first, so
  ours runs while gcsfs's HTTP session is still open."""
  global _exit_hook_registered
  if not _exit_hook_registered:
    _exit_hook_registered = True
    atexit.register(_sync_at_exit)


# ------------------------------------------------------------------------------ local copies


def _cache_root() -> pathlib.Path:
  root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                   "reasoning_rl")
  return pathlib.Path(root) / "gcs"


def local_copy(value: str | os.PathLike[str]) -> pathlib.Path:
  """A local path with the content of `value` (itself if local; a cached download if remote)."""
  if not is_remote(value):
    return pathlib.Path(value)
  fs, key = _fs_and_key(value)
  key = key.rstrip("/")
  target = _cache_root() / key
  names = ([""] if fs.isfile(key)
           else [relative_name(f, "gs://" + key) for f in list_files("gs://" + key)])
  if not names:
    raise FileNotFoundError(f"{value}: no such file or directory")
  for name in names:
    source = f"{key}/{name}" if name else key
    local = target / name if name else target
    info = fs.info(source)
    marker = _cache_root() / ".crc32c" / (f"{key}/{name}" if name else key)
    if (local.is_file() and local.stat().st_size == int(info["size"]) and marker.is_file()
        and marker.read_text() == str(info.get("crc32c"))):
      continue
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(local.name + f".partial{os.getpid()}")
    fs.get_file(source, str(partial))
    os.replace(partial, local)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(info.get("crc32c")))
  return target

