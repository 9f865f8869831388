"""Bad input to a launcher: one line on stderr, the documented exit code, nothing half-written.

Each case here ended in a traceback (exit 1) before, or left a stray file behind: a config file
that does not load, a task file with binary bytes (which also left the lock and the log in the
workdir), prompt ids past int32 (an empty .partial), a read-only output directory (the right
error, then a traceback from removing the .partial), replay and report on a missing or unreadable
workdir.
"""

import json
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

from reasoning_rl.errors import ExitCode

REPO = pathlib.Path(__file__).resolve().parents[1]
BAD, STORAGE = int(ExitCode.BAD_INPUT), int(ExitCode.STORAGE)


def launch(script: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
  return subprocess.run([*prefix, sys.executable, str(REPO / "launch" / script), *args],
                        capture_output=True, text=True, timeout=300, cwd=REPO)


def one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == code, proc.stderr
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  for needle in needles:
    assert needle in lines[0], lines[0]
  return lines[0]


def _read_only_mount_works() -> bool:
  unshare = shutil.which("unshare", path="/usr/bin:/bin")
  if unshare is None:
    return False
  probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
                          "mount -t tmpfs -o ro tmpfs /mnt"], capture_output=True, timeout=30)
  return probe.returncode == 0


needs_read_only_mount = pytest.mark.skipif(
    not _read_only_mount_works(),
    reason="no user + mount namespaces here to make a read-only mount")


def read_only(directory: pathlib.Path, populate_from: pathlib.Path | None = None) -> tuple:
  """A command prefix that runs the launcher with `directory` on a read-only tmpfs (holding a copy
  of `populate_from`), in its own user and mount namespaces (no privilege needed)."""
  setup = f"mount -t tmpfs tmpfs {shlex.quote(str(directory))}"
  if populate_from is not None:
    setup += f" && cp -r {shlex.quote(str(populate_from))}/. {shlex.quote(str(directory))}"
  setup += f" && mount -o remount,ro {shlex.quote(str(directory))} && exec \"$@\""
  return ("unshare", "--user", "--map-root-user", "--mount", "sh", "-c", setup, "sh")


# ------------------------------------------------------------------------------------ train


@pytest.mark.parametrize("source, needle", [
    ("def get_config(:\n", "SyntaxError: invalid syntax (config.py, line 1)"),
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import no_such_module_here\n", "No module named 'no_such_module_here'"),
    ("def get_config():\n  return 1 / 0\n", "get_config() raised ZeroDivisionError"),
    ("import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict({'x': 1})\n",
     "the config lacks"),
])
def test_a_config_file_that_does_not_load_is_one_line(tmp_path, source, needle):
  config = tmp_path / "config.py"
  config.write_text(source)
  workdir = tmp_path / "run"
  proc = launch("train.py", f"--config={config}", f"--config.workdir={workdir}")
  one_line(proc, BAD, "--config=", needle)
  assert not workdir.exists()


def _jsonl_config(tmp_path: pathlib.Path, data: pathlib.Path) -> pathlib.Path:
  config = tmp_path / "jsonl_config.py"
  config.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
                    "from configs import debug_cpu\n"
                    "def get_config():\n  c = debug_cpu.get_config()\n"
                    f"  c.data.train = dict(kind='jsonl', path={str(data)!r})\n  return c\n")
  return config


def test_a_binary_task_file_is_refused_and_the_workdir_left_as_it_was(tmp_path):
  data = tmp_path / "tasks.jsonl"
  data.write_bytes(b'{"prompt": "1 + 1", "answer": "2"}\n\x00\xff\xfe binary\n')
  config = _jsonl_config(tmp_path, data)
  fresh = tmp_path / "fresh" / "run"  # neither exists yet
  one_line(launch("train.py", f"--config={config}", f"--config.workdir={fresh}"), BAD,
           f"{data}:2: not UTF-8 text")
  assert not fresh.parent.exists()  # no lock, no log, no directory
  # a workdir that already had a log keeps it byte for byte, and gets no lock file
  earlier = tmp_path / "earlier"
  (earlier / "logs").mkdir(parents=True)
  (earlier / "logs" / "train.log").write_text("a line of an earlier start\n")
  one_line(launch("train.py", f"--config={config}", f"--config.workdir={earlier}"), BAD,
           "not UTF-8 text")
  assert sorted(p.relative_to(earlier).as_posix() for p in earlier.rglob("*")) == [
      "logs", "logs/train.log"]
  assert (earlier / "logs" / "train.log").read_text() == "a line of an earlier start\n"


# --------------------------------------------------------------------------------- generate


def test_prompt_ids_past_int32_are_one_line_and_leave_no_partial_file(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt_ids": [1, 2**31]}) + "\n")
  output = tmp_path / "out" / "completions.jsonl"
  output.parent.mkdir()
  proc = launch("generate.py", "--checkpoint", str(tmp_path / "any_model"), "--prompts_file",
                str(prompts), "--output", str(output), "--max_new_tokens", "2")
  one_line(proc, BAD, "prompts.jsonl:1", "2147483648")
  assert list(output.parent.iterdir()) == []


@needs_read_only_mount
def test_a_read_only_output_directory_is_one_line(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n")
  output_dir = tmp_path / "out"
  output_dir.mkdir()
  proc = launch("generate.py", "--checkpoint", str(tmp_path / "any_model"), "--prompts_file",
                str(prompts), "--output", str(output_dir / "completions.jsonl"),
                "--max_new_tokens", "2", prefix=read_only(output_dir))
  one_line(proc, BAD, "--output", "read-only file system")


# ----------------------------------------------------------------------------------- replay


@pytest.fixture
def rewards_config(tmp_path):
  config = tmp_path / "rewards_config.py"
  config.write_text("import ml_collections\ndef get_config():\n  c = ml_collections.ConfigDict()\n"
                    "  c.rewards = ml_collections.ConfigDict({'correct': {'weight': 1.0}})\n"
                    "  return c\n")
  return config


def test_replay_refuses_bad_workdirs_and_configs_in_one_line(tmp_path, rewards_config):
  one_line(launch("replay.py", f"--workdir={tmp_path / 'nowhere'}", f"--config={rewards_config}"),
           BAD, "nowhere/rollouts is not a directory")
  binary = tmp_path / "binary"
  (binary / "rollouts").mkdir(parents=True)
  (binary / "rollouts" / "step_00000001.jsonl").write_bytes(b"\xff\xfe\x00 not text\n")
  one_line(launch("replay.py", f"--workdir={binary}", f"--config={rewards_config}"), BAD,
           "rollouts/step_00000001.jsonl:1: not a JSON line")
  no_rewards = tmp_path / "no_rewards.py"
  no_rewards.write_text("import ml_collections\ndef get_config():\n"
                        "  return ml_collections.ConfigDict({'seed': 1})\n")
  one_line(launch("replay.py", f"--workdir={binary}", f"--config={no_rewards}"), BAD,
           "no `rewards` field")
  one_line(launch("replay.py", f"--workdir={binary}", f"--config={rewards_config}",
                  f"--output={tmp_path / 'missing' / 'replay.json'}"), BAD,
           "does not exist; create it first")
  one_line(launch("replay.py", f"--config={rewards_config}"), BAD, "--workdir=DIR")


# ----------------------------------------------------------------------------------- report


def test_report_refuses_a_missing_or_unreadable_workdir_and_writes_nothing(tmp_path):
  one_line(launch("report.py", f"--workdir={tmp_path / 'nowhere'}"), BAD, "not a directory")
  for name, content in (("binary", b"\xff\xfe\x00\n"), ("not_rows", b"5\n")):
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_bytes(content)
    one_line(launch("report.py", f"--workdir={workdir}"), BAD, f"{workdir}/metrics.jsonl")
    assert [p.name for p in workdir.iterdir()] == ["metrics.jsonl"]
  one_line(launch("report.py", f"--workdir={tmp_path}", "--num_samples=-1"), BAD, "num_samples")


@needs_read_only_mount
def test_report_on_a_read_only_workdir_is_a_storage_error(tmp_path):
  source = tmp_path / "source"
  source.mkdir()
  (source / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
  workdir = tmp_path / "workdir"
  workdir.mkdir()
  proc = launch("report.py", f"--workdir={workdir}", prefix=read_only(workdir, source))
  one_line(proc, STORAGE, "StorageError", "Read-only file system")


@pytest.mark.parametrize("script", ["train.py", "evaluate.py", "replay.py", "report.py",
                                    "redteam.py"])
def test_an_unknown_flag_is_one_line(script, tmp_path, rewards_config):
  config = "configs/debug_cpu.py" if script in ("train.py", "evaluate.py") else str(rewards_config)
  args = [f"--config={config}"] if script != "report.py" else [f"--workdir={tmp_path}"]
  one_line(launch(script, *args, "--no_such_flag=1"), BAD, "no_such_flag")

