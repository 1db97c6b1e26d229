#!/bin/bash
# The plugin's GPU run in one device call: install dtorch_nccl, dtorch_hf and dtorch_sage_attn
# (--no-deps) and the wheels in .whl/ (structlog, diffusers 0.42.1, importlib_metadata, and
# sageattention 1.0.6 where present), then bench/gpu_check.py and bench/flux_step.py (options
# after the script's name go to flux_step.py). Logs under $OUT. From the checkout's root:
#   device run, carry [".whl"]:  bash plugins/dtorch_sage_attn/bench/gpu_run.sh [flux_step.py options]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_sage_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 1
REPO=$PWD
WHL=${WHL:-$REPO/.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHL"/structlog-*.whl "$WHL"/diffusers-0.42.1-*.whl "$WHL"/importlib_metadata-*.whl $(ls "$WHL"/sageattention-*.whl 2>/dev/null) || exit 1
for p in dtorch_nccl dtorch_hf dtorch_sage_attn; do
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/$p > /tmp/pip_$p.log 2>&1 \
    || { cat /tmp/pip_$p.log; exit 1; }
done
export PYTHONPATH=/tmp/plug:/tmp/site:$REPO DTORCH_ATTENTION_CACHE=$OUT/attention-cache
cd /tmp || exit 1  # not the checkout's root: its plugins/ folder is no package to import
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 "$REPO/plugins/dtorch_sage_attn/bench/gpu_check.py" 2>&1 | tee "$OUT/gpu_check.log"
python3 "$REPO/plugins/dtorch_sage_attn/bench/flux_step.py" "$@" 2>&1 | tee "$OUT/flux_step.log"
python3 -m dtorch_core info 2>/dev/null | sed -n '/attention kernels/,$p' | tee "$OUT/info.log" || true
