"""Installs google-jetstream into a side directory without TensorFlow, for the interop test.

    .venv/bin/python tests/jetstream_side_install.py

google-jetstream 0.2.2 (the newest release) declares seqio (which pulls TensorFlow, about 2.4 GB)
and tiktoken, yet the orchestrator only imports a few of their names. So the package goes in with
`pip --no-deps` into `.jetstream_deps/` (git-ignored; the environment variable named by `ENV_VAR`
overrides the place), next to the two small packages it really needs that this project does not
install (grpcio, shortuuid; protobuf, prometheus_client, flax, jax and numpy come from the
project's own dependencies) and two stand-in packages that define the imported names and refuse to
be used. tests/test_sampler_interop.py finds the directory and imports JetStream from it.

The pins are exact, wheels only (a grpcio source build would take an hour). Re-running is quick:
an install whose stamp matches `PINS` and `STAND_INS` is left alone. A new install is built in a
scratch directory, checked by importing the orchestrator in a fresh interpreter, and only then moved
into place, so a failed pip run or import raises and never leaves a half-made directory behind.
"""

import os
import pathlib
import shutil
import subprocess
import sys

ENV_VAR = "REASONING_RL_JETSTREAM_DEPS"
DEFAULT_DIR = pathlib.Path(__file__).resolve().parent.parent / ".jetstream_deps"
PINS = ("google-jetstream==0.2.2", "grpcio==1.85.1", "shortuuid==1.0.13")
SETUP_COMMAND = ".venv/bin/python tests/jetstream_side_install.py"

_REFUSAL = "raise ImportError('stand-in installed by tests/jetstream_side_install.py: {}')"
STAND_INS = {
    "seqio/__init__.py": '"""Stand-in: JetStream imports seqio.vocabularies\' names only."""\n',
    "seqio/vocabularies.py": (
        '"""Stand-in for the two names JetStream imports; SentencePiece refuses use."""\n\n\n'
        "class Vocabulary:\n  pass\n\n\n"
        "class SentencePieceVocabulary(Vocabulary):\n\n  def __init__(self, *args, **kwargs):\n"
        "    " + _REFUSAL.format("seqio is not installed") + "\n"),
    "tiktoken/__init__.py": '"""Stand-in: JetStream imports tiktoken for a Llama 3 tokenizer."""\n',
    "tiktoken/load/__init__.py": (
        '"""Stand-in for the one name JetStream imports; it refuses use."""\n\n\n'
        "def load_tiktoken_bpe(*args, **kwargs):\n"
        "  " + _REFUSAL.format("tiktoken is not installed") + "\n"),
}
STAMP = "INSTALLED"


def side_dir() -> pathlib.Path:
  """Where the side install lives: $REASONING_RL_JETSTREAM_DEPS, else `.jetstream_deps/`."""
  override = os.environ.get(ENV_VAR)
  return pathlib.Path(override).resolve() if override else DEFAULT_DIR


def _manifest() -> str:
  return "\n".join(PINS + tuple(f"{path}\n{text}" for path, text in sorted(STAND_INS.items())))


def is_installed(directory: pathlib.Path) -> bool:
  stamp = directory / STAMP
  return stamp.is_file() and stamp.read_text() == _manifest()


def install(directory: pathlib.Path) -> None:
  """Makes `directory` hold `PINS` and `STAND_INS`; nothing to do when it already does."""
  if is_installed(directory):
    print(f"{directory}: JetStream side install already up to date")
    return
  scratch = directory.with_name(directory.name + ".partial")
  shutil.rmtree(scratch, ignore_errors=True)
  subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                  "--only-binary", ":all:", "--target", str(scratch), *PINS], check=True)
  # The wheel also ships JetStream's benchmark scripts as a top-level `benchmarks` package, a name
  # this repository uses for its own folder; the orchestrator does not need them.
  shutil.rmtree(scratch / "benchmarks")
  for path, text in STAND_INS.items():
    (scratch / path).parent.mkdir(parents=True, exist_ok=True)
    (scratch / path).write_text(text)
  subprocess.run([sys.executable, "-c", "import sys; sys.path.append(sys.argv[1]); "
                  "import jetstream.core.orchestrator", str(scratch)], check=True)
  (scratch / STAMP).write_text(_manifest())
  shutil.rmtree(directory, ignore_errors=True)
  scratch.rename(directory)
  print(f"{directory}: installed {', '.join(PINS)} and stand-ins for seqio and tiktoken")


if __name__ == "__main__":
  install(side_dir())
