#!/usr/bin/env bash
# The whole training loop on a lent GPU beside TRL's GRPOTrainer, as one prepared script. No
# weights travel (SmolLM2's GGUF is over the size that does): both sides load the same
# random-weight checkpoints, made there from SmolLM2's tokenizer files.
#
# Here, once (both folders are then ignored through .git/info/exclude and carried):
#   bash benchmarks/device_wheels.sh .whl
#   python -m benchmarks.random_checkpoint --export_tokenizer .tok
#   printf '/.whl/\n/.tok/\n' >> .git/info/exclude
# There (the device tool's run, carry [".whl", ".tok"]), a lease of 15 minutes holding about one
# full call and a short one:
#   PARTS="rl_demo rl_scan prefill" bash benchmarks/device_loop.sh   # ~9 minutes; logs in $OUT
#   PARTS=train bash benchmarks/device_loop.sh                 # what is left
#
# Parts (PARTS picks them, in this order; each under its own limit, TIME_<PART> seconds, so a
# failing one leaves time to the others):
#   rl_demo  `benchmarks.rl_step` at the CPU demo's settings (4 prompts × 8 samples, 128 new
#            tokens, β 0) at SmolLM2's shape, bfloat16: the loop against TRL (270 s).
#   rl_scan  the same, ours only, with `model.scan_layers` (a 28-layer step compiled 14× faster
#            scanned on the H200, 2026-11-26): what compiling costs either way (150 s).
#   prefill  `benchmarks.prefill` at 256 rows: prompt by prompt vs 8, 64 and 256 prompts per
#            prefill call, the slots placed by `insert_many` (120 s).
#   train    `launch/train.py` on the demo's config (configs/smollm2_arithmetic.py), 3 steps, 32
#            held-out examples: the launcher as users start it (240 s).
#   rl_long  `benchmarks.rl_step` on long sequences: a 1.5 B shape, 8 prompts × 8 samples × 2,048
#            new tokens (random weights seldom stop early) (540 s: a call of its own).
# The first lease (2026-11-30, benchmarks/RESULTS.md) gave the loop 110-140 s and no step
# finished: on a GPU compiling is most of a short run, so every part logs each XLA compilation
# (JAX_LOG_COMPILES) and its summary line gives the programs compiled and their seconds.
#
# A check of the script on a CPU (the venv's python as python3, no wheels to install):
#   mkdir -p /tmp/py && printf '#!/bin/sh\nexec %s "$@"\n' "$PWD/.venv/bin/python" >/tmp/py/python3
#   chmod +x /tmp/py/python3
#   PATH=/tmp/py:$PATH NO_WHEELS=1 DEMO_SHAPE=tiny LONG_SHAPE=tiny LONG_TOKENS=16 \
#     PREFILL_MODEL=small PREFILL_ROWS=16 bash benchmarks/device_loop.sh
set -uo pipefail
out="${OUT:-/tmp/device_loop}"
mkdir -p "$out"
parts="${PARTS:-rl_demo rl_scan prefill train rl_long}"
demo_shape="${DEMO_SHAPE:-smollm2}" long_shape="${LONG_SHAPE:-1.5b}"
long_tokens="${LONG_TOKENS:-2048}"
wants() { [[ " $parts " == *" $1 "* ]]; }
compiles() {  # LOG: how many programs XLA compiled, their seconds, and the three slowest
  grep -o 'Finished XLA compilation of .* in [0-9.e-]* sec' "$1" |
    awk '{seconds = $(NF - 1); total += seconds; print seconds, $5} END {
           printf "TOTAL %d programs, %.1f s\n", NR, total > "/dev/stderr"}' |
    sort -gr | head -3 | awk '{printf "  slowest: %s %.1f s\n", $2, $1}'
}
started() { echo "== $1 at $(date +%T)"; }
if [[ -z "${NO_WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    2>/dev/null || exit 1
fi
export PYTHONPATH=".:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export JAX_LOG_COMPILES=1 PYTHONWARNINGS=ignore::SyntaxWarning
# Both sides share one GPU in one process: JAX takes memory as it needs it instead of 75 % up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if wants train || wants rl_demo || wants rl_scan; then
  python3 -m benchmarks.random_checkpoint --shape "$demo_shape" --tokenizer .tok \
    --out /tmp/device_loop_demo > /dev/null || exit 1
fi
if wants rl_long; then
  python3 -m benchmarks.random_checkpoint --shape "$long_shape" --tokenizer .tok \
    --out /tmp/device_loop_long > /dev/null || exit 1
fi

if wants rl_demo; then
  started rl_demo
  timeout "${TIME_RL_DEMO:-270}" python3 -m benchmarks.rl_step --model_dir /tmp/device_loop_demo \
    --dtype bfloat16 --beta 0 --steps 2 > "$out/rl_step_demo.log" 2>&1
  echo "rl_step, demo settings: exit $?"
  grep -E '^\||x as fast|peak|^  compiling' "$out/rl_step_demo.log"
  compiles "$out/rl_step_demo.log" 2>&1
fi

if wants rl_scan; then
  started rl_scan
  timeout "${TIME_RL_SCAN:-150}" python3 -m benchmarks.rl_step --model_dir /tmp/device_loop_demo \
    --dtype bfloat16 --beta 0 --steps 2 --scan_layers --skip_trl > "$out/rl_step_scan.log" 2>&1
  echo "rl_step, demo settings, scanned layers: exit $?"
  grep -E '^β|^  compiling|^  sampling|peak' "$out/rl_step_scan.log"
  compiles "$out/rl_step_scan.log" 2>&1
fi

if wants prefill; then
  started prefill
  timeout "${TIME_PREFILL:-120}" python3 -m benchmarks.prefill \
    --model "${PREFILL_MODEL:-smollm2_shape}" --dtype bfloat16 --rows "${PREFILL_ROWS:-256}" \
    --prefill_batches one,8,64,256 > "$out/prefill.log" 2>&1
  echo "prefill: exit $?"; grep -E '^\|' "$out/prefill.log"
  compiles "$out/prefill.log" 2>&1
fi

if wants train; then
  started train
  rm -rf /tmp/device_loop_run  # a workdir left by an earlier run would be resumed, not trained
  timeout "${TIME_TRAIN:-240}" python3 launch/train.py --config=configs/smollm2_arithmetic.py \
    --config.model.path=/tmp/device_loop_demo --config.model.dtype=bfloat16 \
    --config.total_steps=3 --config.eval.num_examples=32 --config.workdir=/tmp/device_loop_run \
    > "$out/train_demo.log" 2>&1
  echo "launch/train.py: exit $?"; grep -v "Finished\|Compiling" "$out/train_demo.log" | tail -4
  cp /tmp/device_loop_run/metrics.jsonl "$out/train_metrics.jsonl" 2>/dev/null
  compiles "$out/train_demo.log" 2>&1
fi

if wants rl_long; then
  started rl_long
  timeout "${TIME_RL_LONG:-540}" python3 -m benchmarks.rl_step --model_dir /tmp/device_loop_long \
    --dtype bfloat16 --beta 0 --prompts 8 --samples 8 --max_new_tokens "$long_tokens" \
    --micro_batches 8 --steps 1 > "$out/rl_step_long.log" 2>&1
  echo "rl_step, $long_shape x $long_tokens tokens: exit $?"
  grep -E '^\||x as fast|peak|^  compiling' "$out/rl_step_long.log"
  compiles "$out/rl_step_long.log" 2>&1
fi
