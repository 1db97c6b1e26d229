#!/bin/bash
# bench/hf_models.py on one GPU in one device call (a few minutes): install dtorch_nccl and
# dtorch_hf (--no-deps: the device's transformers is older than the plugin's pin, and the
# diffusers models do not need it), then
#   1. a profiled run with the thread runner (the profiler sees the worker's kernels in this
#      process), while dtorch-core's native channel builds in the background;
#   2. the timed run with the process runner (the headline figures), native channel if it built,
#      then (after the timing) a cProfile of the controller issuing one eager step and the aten
#      ops it plans (no worker thread competes for the GIL there);
#   3. the timed run again on the mesh $ALSO_MESH (default sp=1: on one device the Flux/SD3
#      families then apply no tp plan, so the tp styles' redistributions over a mesh dim of size 1,
#      each a copy of the whole tensor, drop out; ALSO_MESH= skips it).
# Logs and JSON under $OUT. From the checkout's root, with the wheels of structlog, diffusers
# 0.42.1 and importlib_metadata in .whl/:
#   device run, carry [".whl"]:  bash plugins/dtorch_hf/bench/gpu_hf_models.sh [extra hf_models.py options]
# WHL=<folder> takes the wheels from elsewhere (e.g. when this runs in a snapshot of a commit
# carried beside the checkout). A dry run of the shell logic on a CPU machine:
#   OUT=/tmp/dry bash plugins/dtorch_hf/bench/gpu_hf_models.sh --tiny --device cpu --sizes cut
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_hf_models_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 1
REPO=$PWD
WHL=${WHL:-$REPO/.whl}
BENCH=$REPO/plugins/dtorch_hf/bench/hf_models.py
T0=$(date +%s); stamp() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
# by name: .whl/ may hold other wheels, and two versions of one package stop pip
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHL"/structlog-*.whl "$WHL"/diffusers-0.42.1-*.whl "$WHL"/importlib_metadata-*.whl || exit 1
for p in dtorch_nccl dtorch_hf; do
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/$p > /tmp/pip_$p.log 2>&1 \
    || { cat /tmp/pip_$p.log; exit 1; }
done
export PYTHONPATH=/tmp/plug:/tmp/site:$REPO
( timeout 200 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . \
    > /tmp/native.log 2>&1 ) &
NATIVE_PID=$!
cd /tmp || exit 1  # not the checkout's root: its plugins/ folder is no package to import
python3 -c "import torch, diffusers, transformers, dtorch_core, dtorch_hf; print('torch', torch.__version__, \
'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'dtorch_core at', dtorch_core.__file__)" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

stamp "1. profile (thread runner)"
timeout -k 10 ${PROFILE_LIMIT:-200} python3 "$BENCH" --runner thread --profile --top 12 --warmup 4 --rounds 1 --iters 3 \
  --json "$OUT/profile.json" "$@" > "$OUT/profile.log" 2>&1; echo "rc=$?"
grep -vE "^ +[0-9/]+ +[0-9.]+ +[0-9.]+ " "$OUT/profile.log" | head -n 150  # the cProfile tables: in the log

stamp "native channel"
wait $NATIVE_PID
cp /tmp/core/dtorch_core/_*.so "$REPO/dtorch_core/" 2>/dev/null || echo "native extensions not built (pipe channel, Python dispatcher): $(tail -n 3 /tmp/native.log)"
python3 -m dtorch_core.cli info 2>&1 | grep -iE "native|channel|hot path" | head -4

stamp "2. timed run (process runner)"
timeout -k 10 ${TIME_LIMIT:-200} python3 "$BENCH" --runner process --profile --top 12 --json "$OUT/timed.json" "$@" 2>&1 | tee "$OUT/timed.log"
echo "rc=${PIPESTATUS[0]}"
if [ -n "${ALSO_MESH-sp=1}" ]; then
  stamp "3. timed run, mesh ${ALSO_MESH-sp=1} (process runner)"
  timeout -k 10 ${ALSO_LIMIT:-150} python3 "$BENCH" --runner process --mesh "${ALSO_MESH-sp=1}" --json "$OUT/timed_also.json" "$@" 2>&1 \
    | tee "$OUT/timed_also.log"
  echo "rc=${PIPESTATUS[0]}"
fi
stamp done
