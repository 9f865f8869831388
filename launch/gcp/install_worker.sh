#!/usr/bin/env bash
# Installs or updates reasoning_rl with its own Python (>= 3.11) environment on one host: a Cloud
# TPU VM worker (launch/gcp/commands.py copies this file to every worker), a container image
# (Dockerfile) or a notebook runtime. The TPU VM images (v2-alpha-tpuv5, tpu-ubuntu2204-base) are
# Ubuntu 22.04 with Python 3.10, too old for flax >= 0.11 and jax >= 0.7, so the system Python is
# only used to fetch uv; uv makes the environment.
#
#   bash install_worker.sh SOURCE [ROOT]
#
# SOURCE: a git URL (REASONING_RL_REF picks a branch, tag or commit, default the remote's HEAD;
#   the TPU VM recipe pins the commit it resolved when it was made, so that every reinstall of a
#   run gets the same code), a local directory holding the project (used in place: ROOT/src
#   becomes a link to it), or a .tar.gz / .zip of it (REASONING_RL_SHA256, when set, must be its
#   sha256 digest: a changed archive is refused).
# ROOT: default ~/reasoning_rl. The project is at ROOT/src, the environment at ROOT/venv, so every
#   host runs `cd ROOT/src && ROOT/venv/bin/python launch/train.py ...`.
# Environment: REASONING_RL_JAX (default 'jax[tpu]==0.10.2': the jax the project is tested with,
#   whose tpu extra pins the matching libtpu), REASONING_RL_PYTHON (Python that uv downloads when
#   the host has no 3.11-3.13, default 3.12).
#
# Idempotent: a second run updates the checkout (fetch + reset, never a second clone) and the
# packages, and reuses the environment. Ends with one line naming what is installed; any failure
# ends with one line starting "error: install_worker.sh:" and a nonzero exit.
set -euo pipefail

SOURCE="${1:?usage: install_worker.sh SOURCE [ROOT]}"
ROOT="${2:-$HOME/reasoning_rl}"
JAX_SPEC="${REASONING_RL_JAX:-jax[tpu]==0.10.2}"
DOWNLOAD_PYTHON="${REASONING_RL_PYTHON:-3.12}"

fail() { echo "error: install_worker.sh: $*" >&2; exit 1; }

mkdir -p "$ROOT"
ROOT="$(cd "$ROOT" && pwd)"

# 1. uv: from PATH, or installed once under ROOT/tools with the system Python's pip (--target
#    needs no virtual environment and no write access outside ROOT).
if command -v uv > /dev/null 2>&1; then
  UV="$(command -v uv)"
elif [ -x "$ROOT/tools/bin/uv" ]; then
  UV="$ROOT/tools/bin/uv"
else
  command -v python3 > /dev/null 2>&1 || fail "neither uv nor python3 found; install uv and rerun"
  python3 -m pip install --quiet --disable-pip-version-check --target "$ROOT/tools" uv \
      > "$ROOT/tools.log" 2>&1 \
    || fail "could not install uv with python3 -m pip (see $ROOT/tools.log); install uv and rerun"
  UV="$ROOT/tools/bin/uv"
fi

# 2. The environment: kept when it already has Python >= 3.11; else made from a Python 3.11-3.13
#    the host has, else from one uv downloads (needs access to uv's Python downloads).
PYTHON="$ROOT/venv/bin/python"
if ! { [ -x "$PYTHON" ] && "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; }; then
  rm -rf "$ROOT/venv"
  "$UV" venv --quiet --no-python-downloads --python '>=3.11,<3.14' "$ROOT/venv" 2> /dev/null \
    || "$UV" venv --quiet --python "$DOWNLOAD_PYTHON" "$ROOT/venv" > "$ROOT/python.log" 2>&1 \
    || fail "no Python >= 3.11 on this host and uv could not download Python $DOWNLOAD_PYTHON" \
            "(see $ROOT/python.log); install python3.11+ or give uv network access, and rerun"
fi

# 3. The project at ROOT/src.
SRC="$ROOT/src"
if [ -d "$SOURCE" ]; then
  SOURCE="$(cd "$SOURCE" && pwd)"
  [ -f "$SOURCE/setup.cfg" ] || fail "$SOURCE holds no setup.cfg: give the project's directory"
  if [ "$(cd "$SRC" 2> /dev/null && pwd -P)" != "$(cd "$SOURCE" && pwd -P)" ]; then
    rm -rf "$SRC"
    ln -s "$SOURCE" "$SRC"
  fi
elif [[ "$SOURCE" == *.tar.gz || "$SOURCE" == *.tgz || "$SOURCE" == *.zip ]]; then
  [ -f "$SOURCE" ] || fail "archive $SOURCE not found"
  if [ -n "${REASONING_RL_SHA256:-}" ]; then
    digest="$(sha256sum "$SOURCE" | cut -d' ' -f1)"
    [ "$digest" = "$REASONING_RL_SHA256" ] || fail "archive $SOURCE has sha256 $digest, not" \
      "the $REASONING_RL_SHA256 the run was started from: give that archive"
  fi
  unpacked="$(mktemp -d)"
  if [[ "$SOURCE" == *.zip ]]; then
    python3 -m zipfile -e "$SOURCE" "$unpacked"
  else
    tar -xzf "$SOURCE" -C "$unpacked"
  fi
  top="$(dirname "$(find "$unpacked" -name setup.cfg -print | sort | head -n 1)")"
  [ -f "$top/setup.cfg" ] || fail "archive $SOURCE holds no setup.cfg"
  rm -rf "$SRC"
  mv "$top" "$SRC"
  rm -rf "$unpacked"
else
  command -v git > /dev/null 2>&1 || fail "git not found (needed to fetch $SOURCE)"
  if [ ! -d "$SRC/.git" ] || [ -L "$SRC" ]; then  # not our own clone (never a linked checkout)
    rm -rf "$SRC"
    git init --quiet "$SRC"
    git -C "$SRC" remote add origin "$SOURCE"
  fi
  git -C "$SRC" remote set-url origin "$SOURCE"
  # a branch, a tag or a commit alike (a commit by its id: git's protocol v2 serves any commit
  # the remote can reach, GitHub too)
  git -C "$SRC" fetch --quiet --depth=1 origin "${REASONING_RL_REF:-HEAD}" \
    || fail "git fetch of $SOURCE ${REASONING_RL_REF:-HEAD} failed"
  git -C "$SRC" reset --quiet --hard FETCH_HEAD
  COMMIT="$(git -C "$SRC" rev-parse HEAD)"  # what the closing line names (git sources only)
fi

# 4. The packages: the project (editable, so an update of ROOT/src is what runs) with every runtime
#    dependency of setup.cfg, and the pinned jax build.
"$UV" pip install --quiet --python "$PYTHON" -e "$SRC" "$JAX_SPEC" > "$ROOT/install.log" 2>&1 \
  || fail "package install failed (see $ROOT/install.log)"
"$PYTHON" -W ignore - "$SRC" "${COMMIT:-}" << 'EOF' || fail "the environment cannot import the trainer's modules"
import importlib.metadata as metadata
import sys

import importlib.util

import jax, math_verify, reasoning_rl  # noqa: F401,E401  what every run imports
assert importlib.util.find_spec("reasoning_gym"), "reasoning_gym"  # its import takes seconds
try:
  libtpu = metadata.version("libtpu")
except metadata.PackageNotFoundError:
  libtpu = "none"
at = f" at {sys.argv[2]}" if sys.argv[2] else ""
print(f"installed: reasoning_rl from {sys.argv[1]}{at} on Python {sys.version.split()[0]}, "
      f"jax {jax.__version__}, libtpu {libtpu}")
EOF
