#!/usr/bin/env bash
# The whole training loop on a lent GPU beside TRL's GRPOTrainer, as one prepared script (about
# 10 minutes on an H200 with every part: more than one call of the device tool may run, so PARTS
# splits it). No weights travel (SmolLM2's GGUF is over the size that does): both
# sides load the same random-weight checkpoints, made there from SmolLM2's tokenizer files.
#
# Here, once (both folders are then ignored through .git/info/exclude and carried):
#   bash benchmarks/device_wheels.sh .whl
#   python -m benchmarks.random_checkpoint --export_tokenizer .tok
#   printf '/.whl/\n/.tok/\n' >> .git/info/exclude
# There (the device tool's run, carry [".whl", ".tok"]):
#   PARTS="train rl_demo rl_long" bash benchmarks/device_loop.sh     # logs under $OUT
#   PARTS=prefill bash benchmarks/device_loop.sh                      # a second call
#
# 1. `launch/train.py` on the CPU demo's config (configs/smollm2_arithmetic.py) at SmolLM2's
#    shape, bfloat16 compute, 3 steps, 32 held-out examples: the launcher as users start it.
# 2. `benchmarks.rl_step` at the demo's settings (4 prompts × 8 samples, 128 new tokens, β 0).
# 3. `benchmarks.rl_step` on long sequences: a 1.5 B shape, 8 prompts × 8 samples × 2,048 new
#    tokens (random weights seldom stop early, so most completions run to the budget).
# 4. `benchmarks.prefill` at 256 rows: prompt by prompt vs 8, 64 and 256 prompts per prefill call.
# Each part has its own time limit (TIME_<PART>), so a failing one leaves time to the others;
# PARTS picks which run (default all four, in that order: train rl_demo rl_long prefill), so a
# lease too short for all of them can take them in two calls. The demo run's metrics and report
# come back under $OUT too.
#
# A check of the script on a CPU (the venv's python as python3, no wheels to install):
#   mkdir -p /tmp/py && printf '#!/bin/sh\nexec %s "$@"\n' "$PWD/.venv/bin/python" >/tmp/py/python3
#   chmod +x /tmp/py/python3
#   PATH=/tmp/py:$PATH NO_WHEELS=1 DEMO_SHAPE=tiny LONG_SHAPE=tiny LONG_TOKENS=16 \
#     PREFILL_MODEL=small PREFILL_ROWS=16 bash benchmarks/device_loop.sh
set -uo pipefail
out="${OUT:-/tmp/device_loop}"
mkdir -p "$out"
parts="${PARTS:-train rl_demo rl_long prefill}"
demo_shape="${DEMO_SHAPE:-smollm2}" long_shape="${LONG_SHAPE:-1.5b}"
long_tokens="${LONG_TOKENS:-2048}"
wants() { [[ " $parts " == *" $1 "* ]]; }
if [[ -z "${NO_WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl ||
    exit 1
fi
export PYTHONPATH=".:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# Both sides share one GPU in one process: JAX takes memory as it needs it instead of 75 % up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if wants train || wants rl_demo; then
  python3 -m benchmarks.random_checkpoint --shape "$demo_shape" --tokenizer .tok \
    --out /tmp/device_loop_demo || exit 1
fi
if wants rl_long; then
  python3 -m benchmarks.random_checkpoint --shape "$long_shape" --tokenizer .tok \
    --out /tmp/device_loop_long || exit 1
fi

if wants train; then
  # The held-out set cut to 32 examples: three wordings are evaluated before step 1 and after
  # the last, which at 100 would take most of this part's time.
  rm -rf /tmp/device_loop_run  # a workdir left by an earlier run would be resumed, not trained
  timeout "${TIME_TRAIN:-110}" python3 launch/train.py --config=configs/smollm2_arithmetic.py \
    --config.model.path=/tmp/device_loop_demo --config.model.dtype=bfloat16 \
    --config.total_steps=3 --config.eval.num_examples=32 --config.workdir=/tmp/device_loop_run \
    > "$out/train_demo.log" 2>&1
  echo "launch/train.py: exit $?"; tail -4 "$out/train_demo.log"
  cp /tmp/device_loop_run/metrics.jsonl "$out/train_metrics.jsonl" 2>/dev/null
fi

if wants rl_demo; then
  timeout "${TIME_RL_DEMO:-140}" python3 -m benchmarks.rl_step --model_dir /tmp/device_loop_demo \
    --dtype bfloat16 --beta 0 --steps 2 > "$out/rl_step_demo.log" 2>&1
  echo "rl_step, demo settings: exit $?"; grep -E '^\||x as fast|peak' "$out/rl_step_demo.log"
fi

if wants rl_long; then
  timeout "${TIME_RL_LONG:-270}" python3 -m benchmarks.rl_step --model_dir /tmp/device_loop_long \
    --dtype bfloat16 --beta 0 --prompts 8 --samples 8 --max_new_tokens "$long_tokens" \
    --micro_batches 8 --steps 1 > "$out/rl_step_long.log" 2>&1
  echo "rl_step, $long_shape x $long_tokens tokens: exit $?"
  grep -E '^\||x as fast|peak' "$out/rl_step_long.log"
fi

if wants prefill; then
  timeout "${TIME_PREFILL:-120}" python3 -m benchmarks.prefill --model "${PREFILL_MODEL:-smollm2_shape}" \
    --dtype bfloat16 --rows "${PREFILL_ROWS:-256}" --prefill_batches one,8,64,256 \
    > "$out/prefill.log" 2>&1
  echo "prefill: exit $?"; grep -E '^\|' "$out/prefill.log"
fi
