"""Faults a run must survive or refuse clearly: damaged checkpoints, non-finite weights, Ctrl-C,
two trainers on one workdir, a resume with another config, and generate.py's bad input."""

import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from reasoning_rl import checkpoint_manifest, stop_signals
from reasoning_rl.checkpoint_manifest import CHECKSUMS_FILE, CheckpointCorruptError
from reasoning_rl.checkpointing import Checkpointer
from reasoning_rl.run_checkpoint import load_model
from reasoning_rl.config import base_config
from reasoning_rl.errors import CheckpointError, ConfigError, ExitCode
from reasoning_rl.models.checkpoints import load_hf_weights
from reasoning_rl.models.gguf_io import load_gguf_weights
from reasoning_rl.workdir import (FINGERPRINT_FILE, LOCK_FILE, WorkdirLock,
                                  check_or_write_fingerprint, check_output_file_writable,
                                  check_workdir_writable)
from tests.hf_reference import SMALL, write_tiny_model
from tests.support.generation import generate, write_word_tokenizer
from tests.support.loop import _run_workdir


REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ checkpoints


def _state(scale: float):
  return {"params": {"w": jnp.arange(512, dtype=jnp.float32) * scale,
                     "b": jnp.full((4,), scale, jnp.bfloat16)},
          "count": jnp.int32(int(scale)), "rng": jax.random.key(7)}


def _abstract():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(1.0))


def _saved(directory, steps, **states):
  """Checkpoints of `steps` (state scale = step unless `states` gives step_N=state)."""
  with Checkpointer(directory, keep=5) as ckpt:
    for step in steps:
      ckpt.save(step, states.get(f"step_{step}", _state(float(step))), {"step": step}, force=True)
  return pathlib.Path(directory)


def _largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
  return max(files, key=lambda p: p.stat().st_size)


def _flip_bytes(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  for i in range(len(data) // 2, len(data) // 2 + 8):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_checksums_cover_every_file_of_an_async_save(tmp_path):
  directory = _saved(tmp_path, [1, 2])
  for step in (1, 2):
    step_dir = directory / str(step)
    listed = set(json.loads((step_dir / CHECKSUMS_FILE).read_text())["files"])
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
               if p.is_file() and p.name != CHECKSUMS_FILE}
    assert listed == on_disk and any(name.startswith("state/") for name in listed)
    assert checkpoint_manifest.verify_checksums(step_dir)


@pytest.mark.parametrize("damage", [_flip_bytes, _truncate])
def test_damaged_newest_step_is_moved_aside_and_the_previous_restored(tmp_path, caplog, damage):
  directory = _saved(tmp_path, [1, 2])
  damaged = _largest_data_file(directory / "2")
  damage(damaged)
  with caplog.at_level(logging.WARNING, logger="reasoning_rl"):
    with Checkpointer(directory) as ckpt:
      step, state, meta = ckpt.restore_latest(_abstract())
      assert ckpt.all_steps() == [1]
  assert (step, meta) == (1, {"step": 1})
  np.testing.assert_array_equal(state["params"]["w"], _state(1.0)["params"]["w"])
  assert sorted(p.name for p in directory.iterdir()) == ["1", "corrupt-2"]
  assert (directory / "corrupt-2" / damaged.relative_to(directory / "2")).exists()  # kept
  assert "corrupt-2" in caplog.text and damaged.name in caplog.text


def test_a_save_that_fails_in_the_background_is_one_checkpoint_error(tmp_path, monkeypatch):
  """Orbax writes asynchronously: its failure surfaces in wait() / close(), named with the step
  and the newest complete checkpoint (a rerun resumes from there)."""
  import orbax.checkpoint as ocp

  directory = _saved(tmp_path, [1])
  ckpt = Checkpointer(directory, keep=5)
  ckpt.save(2, _state(2.0), {"step": 2}, force=True)
  ckpt.wait()
  real_wait = ocp.CheckpointManager.wait_until_finished

  def disk_full(self):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", disk_full)
  ckpt._saving = 3  # as after save(3): the failed write is the newest one started
  with pytest.raises(CheckpointError) as error:
    ckpt.close()
  assert str(error.value) == (
      f"checkpoint {directory.absolute()}/3 could not be written ([Errno 28] No space left on "
      f"device); last complete checkpoint: step 2 ({directory.absolute()}/2); free space or fix "
      "the path, then rerun on the same workdir to resume from it")
  monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", real_wait)


def _train_with_file_size_limit(workdir, limit_kib, *overrides):
  """launch/train.py with every file it writes capped at `limit_kib` KiB (the shell's
  `ulimit -f`, RLIMIT_FSIZE: writes past it fail with EFBIG, as writes to a full disk fail with
  ENOSPC; Python ignores the SIGXFSZ that comes with it). sh's `ulimit -f` counts 512-byte
  blocks, hence twice the KiB."""
  command = [sys.executable, str(REPO_ROOT / "launch" / "train.py"),
             "--config=configs/debug_cpu.py", f"--config.workdir={workdir}",
             "--config.logging.progress_bar=False", *overrides]
  if limit_kib:
    command = ["sh", "-c", f'ulimit -f {2 * limit_kib} && exec "$@"', "sh", *command]
  # the launcher's own compilation cache, in this test's directory: its writes fail under the cap
  # too, and the launcher must keep JAX's warnings about them off the one line of stderr checked
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["REASONING_RL_COMPILATION_CACHE"] = str(pathlib.Path(workdir).parent / "jax_cache")
  return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                        env=env)


@pytest.mark.parametrize("limit_kib, overrides, first_line", [
    # the first checkpoint's data files exceed 145 KiB: Orbax's background save fails
    (145, ["--config.total_steps=12"], "error: CheckpointError: checkpoint "),
    # no checkpoint before the last step; a file of rollouts / metrics reaches 8 KiB first (the
    # run's config, about 4 KiB, fits)
    (8, ["--config.total_steps=12", "--config.checkpoint.every_steps=100"],
     "error: StorageError: "),
])
def test_a_write_failure_ends_the_run_in_one_line_with_exit_4_and_the_rerun_completes(
    tmp_path, limit_kib, overrides, first_line):
  failed = _train_with_file_size_limit(tmp_path, limit_kib, *overrides)
  lines = [line for line in failed.stderr.splitlines() if line.strip()]
  assert failed.returncode == 4, failed.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith(first_line), lines
  assert "File too large" in lines[0] and lines[0].endswith(
      "; last complete checkpoint: none yet; free space or fix the path, then rerun on the same "
      "workdir to resume from it")
  assert "run finished" not in failed.stdout  # no success summary after a failure
  rerun = _train_with_file_size_limit(tmp_path, 0, *overrides)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows] == list(range(1, 13))


def test_direct_restore_of_a_damaged_step_names_the_file(tmp_path):
  directory = _saved(tmp_path, [3])
  damaged = _largest_data_file(directory / "3")
  _flip_bytes(damaged)
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointCorruptError, match=f"{damaged.name} does not match its digest"):
      ckpt.restore(3, _abstract())
  assert (directory / "3").is_dir()  # only restore_latest moves steps


def test_nonfinite_values_are_refused_naming_the_leaf(tmp_path):
  bad = _state(2.0)
  bad["params"]["w"] = bad["params"]["w"].at[5].set(jnp.nan)
  directory = _saved(tmp_path, [1, 2], step_2=bad)
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointCorruptError, match=r"leaf params/w holds NaN or inf"):
      ckpt.restore(2, _abstract())
    step, _, _ = ckpt.restore_latest(_abstract())
  assert step == 1 and (directory / "corrupt-2").is_dir()


def test_no_intact_step_is_an_error_then_a_rerun_starts_fresh(tmp_path):
  directory = _saved(tmp_path, [1, 2])
  for step in (1, 2):
    _flip_bytes(_largest_data_file(directory / str(step)))
  (directory / "corrupt-2").mkdir()  # left by an earlier incident: never overwritten
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*'corrupt-2\.2', 'corrupt-1'"):
      ckpt.restore_latest(_abstract())
  with Checkpointer(directory) as ckpt:
    assert ckpt.restore_latest(_abstract()) is None
  assert sorted(p.name for p in directory.iterdir()) == ["corrupt-1", "corrupt-2", "corrupt-2.2"]


def test_step_without_checksums_is_restored_with_a_warning(tmp_path, caplog):
  directory = _saved(tmp_path, [4])
  (directory / "4" / CHECKSUMS_FILE).unlink()  # as written before checksums existed
  with caplog.at_level(logging.WARNING, logger="reasoning_rl"):
    with Checkpointer(directory) as ckpt:
      step, state, _ = ckpt.restore_latest(_abstract())
  assert step == 4 and int(state["count"]) == 4
  assert f"has no {CHECKSUMS_FILE}" in caplog.text


# ------------------------------------------------------------------------------ model loads


def test_safetensors_with_a_nan_tensor_is_refused_naming_it(tmp_path):
  from safetensors.numpy import load_file, save_file

  write_tiny_model("qwen2", tmp_path)
  load_hf_weights(tmp_path)  # intact: loads
  tensors = load_file(tmp_path / "model.safetensors")
  tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = np.inf
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor "
                     r"'model\.layers\.1\.mlp\.up_proj\.weight' holds NaN or inf"):
    load_hf_weights(tmp_path)


def _write_tiny_gguf(path, nan_tensor=None):
  hidden, heads, kv_heads, head_dim, ff, vocab = 8, 2, 1, 4, 16, 16
  shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
            "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
            "blk.0.attn_q.weight": (heads * head_dim, hidden),
            "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
            "blk.0.attn_v.weight": (kv_heads * head_dim, hidden),
            "blk.0.attn_output.weight": (hidden, heads * head_dim),
            "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden),
            "blk.0.ffn_down.weight": (hidden, ff)}
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(1)
  writer.add_context_length(64)
  writer.add_embedding_length(hidden)
  writer.add_feed_forward_length(ff)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_vocab_size(vocab)
  rng = np.random.RandomState(0)
  for name, shape in shapes.items():
    weight = rng.normal(size=shape).astype(np.float32)
    if name == nan_tensor:
      weight.flat[weight.size // 2] = np.nan
    writer.add_tensor(name, weight)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_gguf_with_a_nan_tensor_is_refused_naming_it(tmp_path):
  load_gguf_weights(_write_tiny_gguf(tmp_path / "intact.gguf"))
  path = _write_tiny_gguf(tmp_path / "damaged.gguf", nan_tensor="blk.0.ffn_down.weight")
  with pytest.raises(CheckpointError,
                     match=r"damaged\.gguf: tensor 'blk\.0\.ffn_down\.weight' holds NaN or inf"):
    load_gguf_weights(path)


def test_run_checkpoint_with_nan_or_damaged_files_is_refused(tmp_path):
  model, _ = load_model(_run_workdir(tmp_path / "intact", nan=False))
  assert model.config.num_layers == 1
  with pytest.raises(CheckpointError, match=r"parameter final_norm/scale/value holds NaN"):
    load_model(_run_workdir(tmp_path / "nan", nan=True))
  step_dir = _run_workdir(tmp_path / "damaged", nan=False) / "checkpoints" / "6"
  damaged = _largest_data_file(step_dir)
  _flip_bytes(damaged)
  with pytest.raises(CheckpointError, match=f"{damaged.name} does not match .*load an earlier"):
    load_model(step_dir.parent.parent)


# ------------------------------------------------------------------------------ signals


@pytest.fixture
def stop_handlers():
  stop_signals.clear_preemption_request()
  uninstall = stop_signals.install_preemption_handler()
  yield
  uninstall()
  stop_signals.clear_preemption_request()


def _deliver(signum):
  os.kill(os.getpid(), signum)
  for _ in range(100):  # the handler runs between bytecodes of the main thread
    time.sleep(0.001)


def test_sigint_requests_a_stop_with_130_and_a_second_aborts(stop_handlers):
  assert not stop_signals.preemption_requested()
  _deliver(signal.SIGINT)
  assert stop_signals.preemption_requested()
  assert stop_signals.interrupt_exit_code() == ExitCode.INTERRUPTED == 130
  _deliver(signal.SIGTERM)  # a later SIGTERM neither aborts nor changes the code
  assert stop_signals.interrupt_exit_code() == 130
  with pytest.raises(KeyboardInterrupt):
    _deliver(signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_requests_a_stop_with_143(stop_handlers):
  _deliver(signal.SIGTERM)
  assert stop_signals.preemption_requested()
  assert stop_signals.interrupt_exit_code() == ExitCode.PREEMPTED == 143
  stop_signals.clear_preemption_request()
  stop_signals._preemption_event.set()  # set without a signal (as tests of the loop do)
  assert stop_signals.interrupt_exit_code() == 143


def test_uninstall_restores_the_previous_handlers():
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  stop_signals.install_preemption_handler()()
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# ------------------------------------------------------------------------------ workdir lock


_HOLD_LOCK = """
import sys, time
from reasoning_rl.workdir import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_live_holder_refuses_and_a_dead_one_is_taken_over(tmp_path, caplog):
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  child = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], env=env,
                           stdout=subprocess.PIPE, text=True)
  try:
    assert child.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=rf"in use by another trainer \(host "
                       rf"{socket.gethostname()}, PID {child.pid}, started "):
      WorkdirLock(tmp_path).acquire()
  finally:
    child.kill()
    child.wait()
  # The holder died without releasing: its record is still in the file, the kernel lock is gone.
  assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == child.pid
  with caplog.at_level(logging.WARNING, logger="reasoning_rl"):
    with WorkdirLock(tmp_path):
      assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
      with pytest.raises(ConfigError, match=f"PID {os.getpid()}"):  # a second lock, same process
        WorkdirLock(tmp_path).acquire()
  assert f"PID {child.pid}" in caplog.text and "taking over" in caplog.text
  assert (tmp_path / LOCK_FILE).read_text() == ""  # released cleanly
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="reasoning_rl"), WorkdirLock(tmp_path):
    pass
  assert "taking over" not in caplog.text


def test_a_refused_start_removes_the_lock_file_and_a_taker_locks_the_file_at_the_path(
    tmp_path, monkeypatch):
  lock = WorkdirLock(tmp_path).acquire()
  lock.release(remove=True)  # a start refused before training, that created the file
  assert not (tmp_path / LOCK_FILE).exists()
  # A taker whose file is replaced between its open and its flock (a refused start removed it,
  # another start made a new one) must end up locking the file now at the path.
  import fcntl  # pylint: disable=import-outside-toplevel

  from reasoning_rl import workdir as workdir_lib  # pylint: disable=import-outside-toplevel

  real_flock, calls = fcntl.flock, []

  def flock_after_a_replacement(fd, operation):
    if not calls and operation & fcntl.LOCK_EX:
      (tmp_path / LOCK_FILE).unlink()
      (tmp_path / LOCK_FILE).write_text("")
    calls.append(operation)
    return real_flock(fd, operation)

  monkeypatch.setattr(workdir_lib.fcntl, "flock", flock_after_a_replacement)
  taker = WorkdirLock(tmp_path).acquire()
  try:
    assert os.fstat(taker._fd).st_ino == os.stat(tmp_path / LOCK_FILE).st_ino
    assert calls.count(fcntl.LOCK_EX | fcntl.LOCK_NB) == 2  # it locked twice: the old, the new
  finally:
    taker.release()


# ------------------------------------------------------------------------------ fingerprint


def _config(**changes):
  """The base config as a dict, with `a__b=v` setting field a.b."""
  config = base_config()
  config.workdir = "/runs/a"
  config.update_from_flattened_dict({k.replace("__", "."): v for k, v in changes.items()})
  return config.to_dict()


def test_fingerprint_written_then_matched(tmp_path):
  assert check_or_write_fingerprint(tmp_path, _config()) == []
  saved = json.loads((tmp_path / FINGERPRINT_FILE).read_text())
  assert saved["rollout"]["num_samples"] == 4 and saved["guards"]["max_kl"] == "inf"
  assert check_or_write_fingerprint(tmp_path, _config()) == []  # inf and tuples compare equal


def test_changed_fields_are_refused_listing_old_and_new(tmp_path):
  check_or_write_fingerprint(tmp_path, _config())
  changed = _config(rollout__num_samples=8, optim__learning_rate=3e-4, logging__tensorboard=False)
  with pytest.raises(ConfigError) as error:
    check_or_write_fingerprint(tmp_path, changed)
  message = str(error.value)
  assert "optim.learning_rate: 0.001 -> 0.0003" in message
  assert "rollout.num_samples: 4 -> 8" in message
  assert "logging" not in message and len(message.splitlines()) == 1
  # Nothing was rewritten: the original config still rules.
  assert json.loads((tmp_path / FINGERPRINT_FILE).read_text())["rollout"]["num_samples"] == 4


def test_allowed_changes_pass_and_become_the_reference(tmp_path):
  check_or_write_fingerprint(tmp_path, _config())
  moved = _config(total_steps=50, eval__every_steps=5, logging__tensorboard=False)
  moved["workdir"] = "/runs/moved"
  with pytest.raises(ConfigError, match=r"eval\.every_steps: 0 -> 5") as error:
    check_or_write_fingerprint(tmp_path, moved, allow_changes=("total_steps",))
  assert "total_steps" not in str(error.value)
  allowed = check_or_write_fingerprint(tmp_path, moved, allow_changes=("total_steps", "eval.*"))
  assert allowed == ["eval.every_steps: 0 -> 5", "logging.tensorboard: true -> false",
                     "total_steps: 10 -> 50", 'workdir: "/runs/a" -> "/runs/moved"']
  assert json.loads((tmp_path / FINGERPRINT_FILE).read_text())["total_steps"] == 50


def test_added_and_removed_fields_count_as_changes(tmp_path):
  check_or_write_fingerprint(tmp_path, {"a": {"b": 1}, "gone": 2})
  with pytest.raises(ConfigError, match=r'a\.c: "<absent>" -> 3; gone: 2 -> "<absent>"'):
    check_or_write_fingerprint(tmp_path, {"a": {"b": 1, "c": 3}})


def test_a_run_from_before_a_field_existed_resumes_when_it_keeps_the_default(tmp_path):
  """A field added since the run started ran as its default; a retyped field's old value means
  its current one (algo.remat False = "none"). A non-default new value is still a change."""
  older = _config()
  del older["model"]["scan_layers"], older["rollout"]["backend"]
  older["algo"]["remat"] = False
  check_or_write_fingerprint(tmp_path, older)
  assert check_or_write_fingerprint(tmp_path, _config()) == []
  with pytest.raises(ConfigError, match=r'model\.scan_layers: "<absent>" -> true\. ') as error:
    check_or_write_fingerprint(tmp_path, _config(model__scan_layers=True, algo__remat="full"))
  assert 'algo.remat: false -> "full"' in str(error.value)


def test_unreadable_fingerprint_names_the_file(tmp_path):
  (tmp_path / FINGERPRINT_FILE).write_text("{not json")
  with pytest.raises(ConfigError, match=f"{FINGERPRINT_FILE}: unreadable"):
    check_or_write_fingerprint(tmp_path, _config())


# ------------------------------------------------------------------------------ writability


def test_unwritable_workdirs_are_one_line_config_errors(tmp_path, monkeypatch):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  with pytest.raises(ConfigError, match=r"workdir=.*a_file: is a file"):
    check_workdir_writable(a_file)
  with pytest.raises(ConfigError, match=r"a_file/run: cannot be written"):
    check_workdir_writable(a_file / "run")
  assert check_workdir_writable(tmp_path / "new" / "run").is_dir()

  def read_only(self, data):
    raise OSError(30, "Read-only file system")  # EROFS, as on a read-only mount

  monkeypatch.setattr(pathlib.Path, "write_bytes", read_only)
  with pytest.raises(ConfigError, match=r"cannot be written \(read-only file system\)"):
    check_workdir_writable(tmp_path / "mounted")


def test_output_file_checks(tmp_path):
  with pytest.raises(ConfigError, match=r"--output .*: directory .*missing does not exist"):
    check_output_file_writable(tmp_path / "missing" / "out.jsonl")
  with pytest.raises(ConfigError, match="is a directory"):
    check_output_file_writable(tmp_path)
  assert check_output_file_writable(tmp_path / "out.jsonl") == tmp_path / "out.jsonl"


# ------------------------------------------------------------------------------ generate.py


def test_generate_refuses_a_missing_output_dir_before_loading(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt_ids": [1, 2]}\n')
  # The checkpoint does not exist either: the output error shows the output was checked first.
  child = subprocess.run(
      [sys.executable, str(REPO_ROOT / "launch" / "generate.py"), "--checkpoint",
       str(tmp_path / "no_model"), "--prompts_file", str(prompts), "--max_new_tokens", "4",
       "--output", str(tmp_path / "missing_dir" / "out.jsonl")],
      env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True, timeout=120)
  assert child.returncode == 2
  assert len(child.stderr.strip().splitlines()) == 1
  assert "missing_dir does not exist" in child.stderr and "no_model" not in child.stderr


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
  """A tiny Qwen2 whose context is 48 tokens."""
  directory = tmp_path_factory.mktemp("short_context")
  torch.manual_seed(0)
  config = transformers.Qwen2Config(**SMALL, max_position_embeddings=48)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
  write_word_tokenizer(directory)
  return directory


def _generate(tmp_path, model_dir, prompts, *flags):
  rows = tmp_path / "prompts.jsonl"
  rows.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
  output = tmp_path / "out.jsonl"
  code = generate.main(["--checkpoint", str(model_dir), "--prompts_file", str(rows),
                        "--output", str(output), "--max_new_tokens", "16", *flags])
  return code, ([json.loads(line) for line in output.read_text().splitlines()]
                if code == 0 else None)


def test_too_long_prompt_is_refused_or_left_truncated(tmp_path, short_context_model, capsys):
  long_prompt = list(range(1, 41))  # 40 tokens + 16 new > 48
  code, _ = _generate(tmp_path, short_context_model, [[5, 6], long_prompt], "--temperature", "0")
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1
  assert "prompt_id 1: 40 tokens, more than the 32" in err and "--truncate_prompts" in err
  assert not (tmp_path / "out.jsonl.partial").exists()

  code, rows = _generate(tmp_path, short_context_model, [[5, 6], long_prompt], "--temperature",
                         "0", "--truncate_prompts")
  assert code == 0 and [r["prompt_truncated"] for r in rows] == [False, True]
  code, reference = _generate(tmp_path, short_context_model, [long_prompt[-32:]],
                              "--temperature", "0")
  assert rows[1]["completion_ids"] == reference[0]["completion_ids"]
  assert rows[1]["prompt"] == " ".join(f"t{i}" for i in long_prompt[-32:])

  code, _ = _generate(tmp_path, short_context_model, [[5]], "--max_new_tokens", "48")
  assert code == 2 and "must be below the model's context of 48" in capsys.readouterr().err


def test_batches_do_not_change_the_samples(tmp_path, short_context_model):
  prompts = [[3, 4, 5], [9], [10, 11, 12, 13, 14], [20, 21]]
  flags = ("--num_samples", "2", "--seed", "3")
  code, together = _generate(tmp_path, short_context_model, prompts, *flags)
  assert code == 0
  code, one_by_one = _generate(tmp_path, short_context_model, prompts, *flags, "--batch_prompts",
                               "1")
  assert code == 0 and len(one_by_one) == len(together)
  for batched, alone in zip(together, one_by_one):
    # Other slot counts and prefill shapes round differently in the last float bit or so.
    np.testing.assert_allclose(alone.pop("logprobs"), batched.pop("logprobs"), atol=1e-5)
    assert alone == batched
  assert [(r["prompt_id"], r["sample_index"]) for r in together] == [
      (p, g) for p in range(4) for g in range(2)]


def test_nonfinite_numbers_are_written_as_null():
  line = generate.json_line({"logprobs": [-0.5, float("nan"), float("-inf")],
                             "nested": {"x": float("inf")}, "ok": 1.0})

  def refuse(constant):
    raise ValueError(f"non-standard JSON constant {constant}")

  assert json.loads(line, parse_constant=refuse) == {
      "logprobs": [-0.5, None, None], "nested": {"x": None}, "ok": 1.0}
