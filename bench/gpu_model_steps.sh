#!/bin/bash
# bench/model_steps.py on one GPU in one device call: step times with the process runner, then
# kernel counts with the thread runner (the profiler sees the workers' kernels in this process).
# From the checkout's root, with structlog's wheel in .whl/:
#   device run, carry [".whl"]:  bash bench/gpu_model_steps.sh [extra model_steps.py options]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_model_steps_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_nccl > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
stamp "native extensions (the Python paths are used if the build fails)"
timeout 240 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . \
  > /tmp/native.log 2>&1 || tail -n 20 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so dtorch_core/ 2>/dev/null || echo "native extensions not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
(cd /tmp && python3 -m dtorch_core.cli info 2>&1) | grep -iE "channel|hot path|op path" | tee "$OUT/info.txt"
stamp "step times (process runner)"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${TIME_LIMIT:-240} python3 bench/model_steps.py --runner process --issue-times --json "$OUT/steps.json" "$@" 2>&1 | tee "$OUT/steps.log" | grep -v "^    "
stamp "kernel counts (thread runner)"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 ${TIME_LIMIT:-240} python3 bench/model_steps.py --runner thread --profile --top 12 --steps 3 --json "$OUT/kernels.json" "$@" > "$OUT/kernels.log" 2>&1
cat "$OUT/kernels.log"
stamp done
