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
`GCS_READ_TIMEOUT_S`: how long a connection may stay silent, not how long a transfer may take),
and tensorstore's HTTP client the same through its TENSORSTORE_CURL_* variables (unless set
already). gcsfs sets none by default, and aiohttp then waits forever for a server that stopped
answering: a run against a stalled store (the emulator once its unread log pipe filled, a
half-open connection to GCS) hung in `fsspec.asyn.sync` with every thread that touched storage,
SIGTERM's save included. With them a dead request fails and is retried on a new connection. On
top of that, the gcsfs class registered for gs:// runs each request, its retries included,
under `deadlines.within` (`storage.timeout_s`): past it the run stops with `StorageTimeout`
(exit 4), and so does every later storage call, at once (reasoning_rl/deadlines.py).

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
import re
import tempfile
import threading
import time
import urllib.parse
import uuid
from typing import Any, Union

from reasoning_rl import deadlines
from reasoning_rl.errors import CheckpointError, StorageTimeout

log = logging.getLogger("reasoning_rl")

REMOTE_PREFIXES = ("gs://",)
SYNC_INTERVAL_S = 5.0
CACHE_ENV = "REASONING_RL_CACHE"
GCS_CONNECT_TIMEOUT_S = 30.0  # opening a connection to the store
GCS_READ_TIMEOUT_S = 30.0  # a connection that sends nothing for this long is given up (retried)
CHECKSUM_KINDS = ("md5", "crc32c")  # what GCS lists per object, in the order they are compared

AnyPath = Union[pathlib.Path, Any]  # pathlib.Path or etils.epath.Path
_configured: str | None = None  # the emulator address clients were pointed at
_lock = threading.Lock()


def is_remote(value: Any) -> bool:
  """True for object-storage URLs (`gs://…`)."""
  return str(value).startswith(REMOTE_PREFIXES)


def configure_emulator() -> None:
  """Prepares every storage client before the first remote path is used (idempotent): request
  timeouts and deadlines for gcsfs, stall detection for tensorstore (module docstring,
  "Requests"), and with `STORAGE_EMULATOR_HOST` set, every client pointed at the emulator (one
  that moved to another address, as between tests, is picked up)."""
  global _configured
  import fsspec  # pylint: disable=import-outside-toplevel
  for protocol in ("gs", "gcs"):  # epath asks fsspec for "gcs", this module for "gs"
    fsspec.config.conf.setdefault(protocol, {}).setdefault("requests_timeout", _request_timeout())
  for name, value in (("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", int(GCS_READ_TIMEOUT_S)),
                      ("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", 1),
                      ("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", int(GCS_CONNECT_TIMEOUT_S))):
    os.environ.setdefault(name, str(value))
  url = os.environ.get("STORAGE_EMULATOR_HOST") or None
  if url and not url.startswith(("http://", "https://")):
    url = "http://" + url
  if url == _configured and _registered is not None:
    return
  previous, _configured = _configured, url
  if url:
    for name, value in (("TENSORSTORE_GCS_HTTP_URL", url),
                        ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator"),
                        ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")):
      if previous is None or name != "TENSORSTORE_GCS_HTTP_URL":
        os.environ.setdefault(name, value)
      else:
        os.environ[name] = value
    for protocol in ("gs", "gcs"):
      fsspec.config.conf.setdefault(protocol, {}).setdefault("token", "anon")
  _register_client(emulator=bool(url))
  if previous is not None:
    fsspec.filesystem("gs").clear_instance_cache()  # clients bound to the old address


_registered: type | None = None  # the gcsfs class registered for gs:// and gcs://


def _register_client(*, emulator: bool) -> None:
  """Registers a gcsfs class whose every request runs under `deadlines.within`.

  Its base: for the emulator, gcsfs's plain JSON-API class, named explicitly (gcsfs picks its
  default class when first imported, and whoever imported it before this ran got the
  gRPC-probing one, whose every first access to a bucket waited out retries against the
  emulator); for GCS, gcsfs's default class."""
  global _registered
  import fsspec  # pylint: disable=import-outside-toplevel
  import gcsfs  # pylint: disable=import-outside-toplevel
  import gcsfs.core  # pylint: disable=import-outside-toplevel
  base = gcsfs.core.GCSFileSystem if emulator else gcsfs.GCSFileSystem
  if _registered is not None and _registered.__mro__[1] is base:
    return
  _registered = _deadline_client(base)
  for protocol in ("gs", "gcs"):
    fsspec.register_implementation(protocol, _registered, clobber=True)
  from etils.epath import backend  # pylint: disable=import-outside-toplevel
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


def _deadline_client(base: type) -> type:
  class DeadlineGCSFileSystem(base):
    """gcsfs with a deadline on each request, all its retries included (deadlines.within)."""

    async def _call(self, method, path, *args, **kwargs):
      data = kwargs.get("data")
      nbytes = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
      return await deadlines.within(super()._call(method, path, *args, **kwargs),
                                    what=f"a {method} request", where=_request_target(path, args,
                                                                                     kwargs),
                                    nbytes=nbytes)

  return DeadlineGCSFileSystem


_URL_TARGET = re.compile(r"/b/([^/?]+)(?:/o(?:/([^?]+)|\?name=([^&]+)))?")


def _request_target(path: str, args: tuple, kwargs: dict) -> str:
  """gs://bucket/object of a gcsfs request, as far as its arguments tell (an upload's URL
  names the bucket and, for a resumable one, the object)."""
  names = [str(a) for a in args[:2]]
  if not names:
    found = _URL_TARGET.search(str(path))
    if found is None:
      return str(path)
    names = [urllib.parse.unquote(part) for part in found.groups() if part]
  if len(names) == 1 and (kwargs.get("name") or kwargs.get("prefix")):
    names.append(str(kwargs.get("name") or kwargs["prefix"]))
  return "gs://" + "/".join(names)


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


def _forget_listings(key: str | None = None) -> None:
  """Drops gcsfs's cached listings of `key` (all if None) in every client of this process:
  etils.epath keeps its own client beside this module's, and a listing either cached may
  predate objects another process (or tensorstore) wrote since."""
  for client in list(getattr(_registered, "_cache", {}).values()):
    client.invalidate_cache(key)


def _fs_and_key(remote: Any) -> tuple[Any, str]:
  """(gcsfs filesystem, "bucket/key") of a gs:// path."""
  configure_emulator()
  import fsspec  # pylint: disable=import-outside-toplevel
  text = str(remote)
  return fsspec.filesystem("gs"), text[len("gs://"):]


def read_bytes_fresh(target: AnyPath) -> bytes:
  """`target`'s bytes as stored now. On gs:// one GET of the object, past every cached listing:
  reading through a path first looks the object up in the cached listing of its directory, which
  may predate the object (seen once in the suite: a manifest a fresh listing had just shown
  was reported missing)."""
  target = path(target)
  if not is_remote(target):
    return target.read_bytes()
  fs, key = _fs_and_key(target)
  _forget_listings(key)
  return fs.cat_file(key)


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
  _forget_listings(key)


def move(source: AnyPath, target: AnyPath) -> None:
  """Renames a file or directory (a copy then delete on GCS, which has no rename)."""
  source, target = path(source), path(target)
  if is_remote(source):
    fs, key = _fs_and_key(source)
    _, target_key = _fs_and_key(target)
    fs.mv(key, target_key, recursive=True)
    _forget_listings()
  else:
    os.rename(source, target)


def list_files(directory: AnyPath) -> list[AnyPath]:
  """Every file below `directory`, sorted."""
  directory = path(directory)
  if is_remote(directory):
    fs, key = _fs_and_key(directory)
    _forget_listings(key)
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
  import google_crc32c  # pylint: disable=import-outside-toplevel  # a requirement (setup.cfg)

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
    _forget_listings(key)  # listings cached by gcsfs may predate a rewrite
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
  _forget_listings(key)  # a cached listing may predate a rewrite
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
      except StorageTimeout:  # the store stopped answering: the run ends (deadlines.py)
        stage.failed_forced_sync = True
        raise
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
  if deadlines.stalled() or any(stage.failed_forced_sync for stage in _stages.values()):
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
  import fsspec.exceptions  # pylint: disable=import-outside-toplevel
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
    limit = deadlines.deadline_for(int(info["size"]))
    try:
      fs.get_file(source, str(partial), timeout=limit)  # fsspec cancels it at the deadline
    except fsspec.exceptions.FSTimeoutError:
      partial.unlink(missing_ok=True)
      raise deadlines.timed_out("a download", f"gs://{source}", limit) from None
    os.replace(partial, local)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(info.get("crc32c")))
  return target

