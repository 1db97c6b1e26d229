#!/bin/bash
# Issue 18's GPU figures in one device call (about 8 minutes, one H200): the small-op chain
# (plugins/dtorch_nccl/bench/cuda_block.py --only chain) with the native paths and with both
# switched off, the worker's per-op overhead (bench/worker_ops.py --device cuda), and the eager
# Flux/SD3 steps against diffusers (plugins/dtorch_hf/bench/hf_models.py, process runner).
# From the checkout's root, with the wheels of structlog, diffusers 0.42.1 and importlib_metadata
# in .whl/:   device run, carry [".whl"]:  bash bench/gpu_hot_path.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_hot_path_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
T0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/structlog-*.whl .whl/diffusers-0.42.1-*.whl .whl/importlib_metadata-*.whl || exit 1
for p in dtorch_nccl dtorch_hf; do
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/$p > /tmp/pip_$p.log 2>&1 \
    || { cat /tmp/pip_$p.log; exit 1; }
done
stamp "native extensions"
timeout 240 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . \
  > /tmp/native.log 2>&1 || tail -n 20 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so "$REPO/dtorch_core/" || echo "native extensions not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$REPO
cd /tmp || exit 1  # not the checkout's root: its plugins/ folder is no package to import
python3 -m dtorch_core.cli info 2>&1 | grep -iE "channel|hot path|op path" | tee "$OUT/info.txt"
stamp "1. small-op chain, native paths"
CUDA_VISIBLE_DEVICES=0 timeout -k 10 90 python3 "$REPO/plugins/dtorch_nccl/bench/cuda_block.py" --only chain --rounds 5 \
  --json "$OUT/chain_native.json" > "$OUT/chain_native.log" 2>&1; echo "rc=$?"; tail -n 12 "$OUT/chain_native.log"
stamp "1b. small-op chain, Python paths"
CUDA_VISIBLE_DEVICES=0 DTORCH_NATIVE_DISPATCH=0 DTORCH_NATIVE_WORKER=0 timeout -k 10 90 python3 \
  "$REPO/plugins/dtorch_nccl/bench/cuda_block.py" --only chain --rounds 5 --json "$OUT/chain_python.json" \
  > "$OUT/chain_python.log" 2>&1; echo "rc=$?"; tail -n 12 "$OUT/chain_python.log"
stamp "2. worker per-op overhead"
timeout -k 10 90 python3 "$REPO/bench/worker_ops.py" --device cuda --rounds 9 > "$OUT/worker_ops.log" 2>&1
echo "rc=$?"; tail -n 20 "$OUT/worker_ops.log"
stamp "3. Flux/SD3 eager and replay vs diffusers (process runner)"
timeout -k 10 ${HF_LIMIT:-230} python3 "$REPO/plugins/dtorch_hf/bench/hf_models.py" --runner process \
  --json "$OUT/hf_models.json" > "$OUT/hf_models.log" 2>&1; echo "rc=$?"; tail -n 30 "$OUT/hf_models.log"
stamp done
