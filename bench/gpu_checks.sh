#!/bin/bash
# After bench/gpu_model_steps.sh in the same device call: the model-op, norm, foreach and
# optimizer-replay tests on CUDA (thread runner with 4 workers on GPU 0; process runner, 1 worker).
set -u
OUT=${OUT:-/tmp/gpu_model_steps_out}
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD NVIDIA_TF32_OVERRIDE=0
TESTS="tests/test_model_ops.py tests/test_ops_nn.py tests/test_ops_foreach.py tests/test_optim_replay.py tests/test_losses.py tests/test_capture.py"
for cfg in "thread 4" "process 1"; do
  set -- $cfg
  CUDA_VISIBLE_DEVICES=0 DTORCH_TEST_DEVICE=cuda DTORCH_TEST_RUNNERS=$1 DTORCH_TEST_WORLD_SIZE=$2 \
    timeout -k 10 ${TIME_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider $TESTS -n 8 -rfEs --tb=short > "$OUT/tests_$1_w$2.log" 2>&1
  echo "tests $1 w$2: rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_$1_w$2.log" | tail -n 15
done
