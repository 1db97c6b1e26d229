#!/bin/bash
# Issue 7 on the nvidia-h200-x2 machine, in ONE device call of about 6 minutes at most:
#   (a) plugin tests (sessions, graphs; SKIP_PLUGIN_TESTS=1 skips)   cap  60 s
#   (b) bench/tp_scaling.py, tp 1 and 2, d=8192 bf16 block            cap 120 s
#   (c) bench/collectives.py, 1 MiB .. 1 GiB, world 2                 cap  90 s
#   (d) bench/train_gpt_devices.py: examples/train_gpt.py dp1xtp2 and
#       dp2xtp1 on the 2 GPUs (process runner) vs --device-count 1    cap  60 s
# Every step has its own `timeout`, so one hang costs its cap and no more; each writes its log
# under $OUT (at most 8 files come back: setup.log, a_plugin_tests.log, b_tp_scaling.log,
# b_tp_scaling.json, c_collectives.log, c_collectives.json, d_train_gpt.log) and the key lines to
# stdout.
#
# The device tool's command (carry .whl):
#   bash bench/gpu_x2.sh
#
# Wheels carried in .whl/ (the machine has no registry; KINDS.md lists what it already has:
# torch 2.11, pluggy, attrs, safetensors, numpy, tqdm, matplotlib, pytest, pytest-timeout,
# scikit-build-core, nanobind, cmake, ninja, setuptools):
#   structlog-26.1.0-py3-none-any.whl   (dtorch-core and dtorch-nccl need it; the only one missing)
# made here with
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl structlog==26.1.0
#
# Installs, as the earlier GPU runs of issue 6 did (.gpu/run1.sh): the wheels into /tmp/site, the
# plugin (non-editable, for its entry point) into /tmp/plug, dtorch-core from the checkout on
# PYTHONPATH (no build: the process runner uses its pipe channel, as in those runs). With
# NATIVE=1 the native channel (dtorch_core._native, nanobind + cmake, both on the machine) is
# built in the background while (a) runs (cap 100 s) and copied into the checkout's dtorch_core/
# before (b); if that fails the pipe channel is used (setup.log says which).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_x2_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
stamp() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
PY=python3

stamp setup
{
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/plug plugins/dtorch_nccl
} > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
NATIVE=${NATIVE:-0}
NATIVE_PID=
if [ "$NATIVE" = 1 ]; then
  ( timeout 100 $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
      --target /tmp/core . > /tmp/native.log 2>&1; echo "native build rc=$?" >> /tmp/native.log ) &
  NATIVE_PID=$!
fi
{
  nvidia-smi -L
  nvidia-smi topo -m
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
  $PY -m dtorch_core.cli info
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
} >> "$OUT/setup.log" 2>&1
grep -E "GPU [0-9]|^torch|communicators|NVLS|MULTICAST" "$OUT/setup.log"

if [ "${SKIP_PLUGIN_TESTS:-0}" != 1 ]; then
  stamp "(a) plugin tests: sessions or graphs"
  timeout -k 15 60 $PY -m pytest -q -x -p no:cacheprovider plugins/dtorch_nccl/tests -k "sessions or graphs" -rfEs \
    --tb=short > "$OUT/a_plugin_tests.log" 2>&1
  echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/a_plugin_tests.log" | tail -n 15
fi

if [ -n "$NATIVE_PID" ]; then
  wait $NATIVE_PID 2>/dev/null
  cat /tmp/native.log >> "$OUT/setup.log"
  if cp /tmp/core/dtorch_core/_native*.so dtorch_core/ 2>/dev/null; then
    $PY -c "import dtorch_core._native as n; print('native channel built:', n.__file__)" 2>&1 | tee -a "$OUT/setup.log"
  else
    echo "native channel NOT built (pipe channel used): $(tail -n 3 /tmp/native.log | tr '\n' ' ')" | tee -a "$OUT/setup.log"
  fi
else
  if $PY -c "import dtorch_core._native" 2>/dev/null; then
    echo "process runner channel: native (already built)" | tee -a "$OUT/setup.log"
  else
    echo "process runner channel: pipe (NATIVE=1 builds the native one while (a) runs)" | tee -a "$OUT/setup.log"
  fi
fi

stamp "(b) tp_scaling: tp 1 2, d=8192 heads 64, batch 4 seq 2048, bf16"
timeout -k 15 120 $PY bench/tp_scaling.py --device cuda --tp 1 2 --d-model 8192 --heads 64 --batch 4 --seq-len 2048 \
  --dtype bfloat16 --steps 10 --rounds 3 --json "$OUT/b_tp_scaling.json" > "$OUT/b_tp_scaling.log" 2>&1
echo "rc=$?"; tail -n 16 "$OUT/b_tp_scaling.log"

stamp "(c) collectives: world 2, 1 MiB 16 MiB 256 MiB 1 GiB, float32"
timeout -k 15 90 $PY bench/collectives.py --device cuda --world-size 2 --sizes 1M 16M 256M 1G --iters 20 --big-iters 5 \
  --rounds 3 --json "$OUT/c_collectives.json" > "$OUT/c_collectives.log" 2>&1
echo "rc=$?"; grep -v "^round " "$OUT/c_collectives.log" | tail -n 24

stamp "(d) examples/train_gpt.py on 2 GPUs (dp1xtp2, dp2xtp1; process runner) vs --device-count 1, 30 steps"
NVIDIA_TF32_OVERRIDE=0 timeout -k 15 60 $PY bench/train_gpt_devices.py --device-type cuda --runner process \
  --layouts 1x2 2x1 --steps 30 > "$OUT/d_train_gpt.log" 2>&1
echo "rc=$?"; tail -n 8 "$OUT/d_train_gpt.log"
stamp done
