"""Checkpointer: round trips onto shardings, keep-N, atomicity, bad input, SIGTERM preemption.

Damaged checkpoints, non-finite values and SIGINT are in test_faults.py."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reasoning_rl import stop_signals
from reasoning_rl.checkpointing import Checkpointer
from reasoning_rl.errors import ExitCode
from reasoning_rl.errors import CheckpointError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mesh():
  return jax.make_mesh((2, 4), ("data", "fsdp"))


def _state(mesh, scale=1.0):
  """A training-state-like tree: sharded params, optimizer moments, counters, typed keys."""
  w_sharding = jax.NamedSharding(mesh, jax.P("data", "fsdp"))
  replicated = jax.NamedSharding(mesh, jax.P())
  w = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * scale, w_sharding)
  return {
      "params": {"w": w, "b": jax.device_put(jnp.full((8,), 0.5 * scale, jnp.bfloat16), replicated)},
      "opt": {"mu": jax.device_put(w * 0.1, w_sharding), "count": jnp.int32(7)},
      "rng": jax.random.key(42),
      "role_keys": jax.device_put(jax.random.split(jax.random.key(5), 8),
                                  jax.NamedSharding(mesh, jax.P(("data", "fsdp")))),
  }


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert got.dtype == want.dtype and got.shape == want.shape
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


META = {"data_position": 123, "policy_version": 4, "carry_over": [[1, 2], [3]],
        "config": {"lr": 1e-6, "name": "debug"}}


def test_round_trip_onto_8_device_shardings(tmp_path):
  assert jax.device_count() == 8
  mesh = _mesh()
  state = _state(mesh)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.restore_latest(_abstract(state)) is None
    assert ckpt.save(3, state, META)
    ckpt.wait()
    step, restored, meta = ckpt.restore_latest(_abstract(state))
  assert step == 3 and meta == META
  _assert_trees_equal(restored, state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert got.sharding == want.sharding
  # The restored key is usable and draws what the original draws.
  np.testing.assert_array_equal(jax.random.uniform(restored["rng"], (3,)),
                                jax.random.uniform(state["rng"], (3,)))


def test_restore_onto_a_different_sharding(tmp_path):
  mesh = _mesh()
  state = _state(mesh)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, META)
    target = _abstract(state)
    other = jax.NamedSharding(mesh, jax.P("fsdp", "data"))
    target["params"]["w"] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=other)
    _, restored, _ = ckpt.restore_latest(target)
  assert restored["params"]["w"].sharding == other
  np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])


def test_keep_n_and_interval_and_latest(tmp_path):
  mesh = _mesh()
  with Checkpointer(tmp_path, keep=2, save_interval_steps=2) as ckpt:
    saved = [ckpt.save(step, _state(mesh, float(step)), {"step": step}) for step in range(1, 7)]
    assert saved == [False, True, False, True, False, True]
    assert ckpt.save(5, _state(mesh, 5.0), {"step": 5}, force=True)
    assert not ckpt.save(5, _state(mesh, 5.0), {"step": 5}, force=True)  # already saved: no-op
    ckpt.wait()
    assert ckpt.all_steps() == [5, 6] and ckpt.latest_step() == 6
    state, meta = ckpt.restore(5, _abstract(_state(mesh)))
  assert meta == {"step": 5}
  _assert_trees_equal(state, _state(mesh, 5.0))


def test_incomplete_checkpoint_is_ignored(tmp_path):
  mesh = _mesh()
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(2, _state(mesh, 2.0), {"step": 2})
  # What a crash in the middle of saving step 3 leaves behind: a temporary step directory with
  # part of the arrays and no commit.
  partial = tmp_path / "3.orbax-checkpoint-tmp-1763780000123456"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "half_written").write_bytes(b"\x00" * 100)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 2
    step, state, meta = ckpt.restore_latest(_abstract(_state(mesh)))
    assert (step, meta) == (2, {"step": 2})
    _assert_trees_equal(state, _state(mesh, 2.0))
    # A new save of step 3 succeeds despite the debris.
    assert ckpt.save(3, _state(mesh, 3.0), {"step": 3})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
  assert not partial.exists()


def test_unwritable_directory(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(CheckpointError, match=r"a_file/ckpt is not writable"):
    Checkpointer(blocker / "ckpt")


@pytest.mark.parametrize("change, pattern", [
    (lambda t: t["params"].pop("b"), r"leaves not in the checkpoint \[\]"),
    (lambda t: t["params"].update(extra=jax.ShapeDtypeStruct((2,), jnp.float32)),
     r"leaves not in the checkpoint \['params/extra'\]"),
    (lambda t: t["params"].update(w=jax.ShapeDtypeStruct((8, 4), jnp.float32)),
     r"leaf params/w is float32\[8, 8\] in the checkpoint but float32\[8, 4\]"),
    (lambda t: t["opt"].update(count=jax.ShapeDtypeStruct((), jnp.float32)),
     r"leaf opt/count is int32\[\] in the checkpoint but float32\[\]"),
    (lambda t: t.update(rng=jax.ShapeDtypeStruct((2,), jnp.uint32)),
     r"leaf rng is a typed PRNG key on one side only"),
])
def test_mismatched_restore_target(tmp_path, change, pattern):
  mesh = _mesh()
  state = _state(mesh)
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    ckpt.save(1, state, META)
    target = _abstract(state)
    change(target)
    with pytest.raises(CheckpointError, match=pattern):
      ckpt.restore_latest(target)


def test_bad_meta_and_missing_step(tmp_path):
  mesh = _mesh()
  with Checkpointer(tmp_path, async_save=False) as ckpt:
    with pytest.raises(CheckpointError, match="meta is not plain JSON"):
      ckpt.save(1, _state(mesh), {"x": np.arange(3)})
    with pytest.raises(CheckpointError, match="meta is not plain JSON"):
      ckpt.save(1, _state(mesh), {"x": float("nan")})
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 9 .*available: \[\]"):
      ckpt.restore(9, _abstract(_state(mesh)))
    with pytest.raises(CheckpointError, match="keep must be"):
      Checkpointer(tmp_path / "other", keep=0)


_LOOP = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp
    from reasoning_rl import checkpointing, stop_signals
    workdir = sys.argv[1]
    stop_signals.install_preemption_handler()
    ckpt = checkpointing.Checkpointer(workdir, keep=2, save_interval_steps=1000)
    state = {"counter": jnp.int32(0), "rng": jax.random.key(0)}
    for step in range(1, 100000):
      state = {"counter": state["counter"] + 1, "rng": jax.random.fold_in(state["rng"], step)}
      if step == 1:
        open(os.path.join(workdir, "running"), "w").close()
      if stop_signals.preemption_requested():
        ckpt.save(step, state, {"preempted_at": step}, force=True)
        ckpt.close()
        print(step, flush=True)
        sys.exit(stop_signals.interrupt_exit_code())
      time.sleep(0.005)
    sys.exit(3)
""")


def test_sigterm_saves_and_exits_cleanly(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu")
  child = subprocess.Popen([sys.executable, "-c", _LOOP, str(tmp_path)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60
  while not (tmp_path / "running").exists():
    assert child.poll() is None, child.stderr.read()
    assert time.monotonic() < deadline, "child loop never started"
    time.sleep(0.05)
  child.send_signal(signal.SIGTERM)
  stdout, stderr = child.communicate(timeout=60)
  assert child.returncode == ExitCode.PREEMPTED == 143, stderr
  last_step = int(stdout.strip())
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [last_step]
    abstract = {"counter": jax.ShapeDtypeStruct((), jnp.int32),
                "rng": jax.eval_shape(lambda: jax.random.key(0))}
    step, state, meta = ckpt.restore_latest(abstract)
  assert step == last_step and meta == {"preempted_at": last_step}
  assert int(state["counter"]) == last_step
  expected_rng = jax.random.key(0)
  for i in range(1, last_step + 1):
    expected_rng = jax.random.fold_in(expected_rng, i)
  np.testing.assert_array_equal(jax.random.key_data(state["rng"]), jax.random.key_data(expected_rng))


def test_preemption_flag_in_process():
  seen = []
  stop_signals.clear_preemption_request()
  uninstall = stop_signals.install_preemption_handler(seen.append)
  try:
    assert not stop_signals.preemption_requested()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop_signals.preemption_requested() and seen == [signal.SIGTERM]
  finally:
    uninstall()
    stop_signals.clear_preemption_request()
