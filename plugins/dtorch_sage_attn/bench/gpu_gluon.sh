#!/bin/bash
# The Gluon kernel's first GPU run, in one device call (carry [".whl"]): the compiled CUDA cases of
# test_triton_sage.py (each case also through the Gluon kernel), where each call's GPU time goes
# (kernel_times.py), and a sweep of the Triton defaults against Gluon configs at the four shapes
# with the table after it (attention.py --sweep --apply). Logs under $OUT. From the checkout's root:
#   bash plugins/dtorch_sage_attn/bench/gpu_gluon.sh
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_gluon_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 1
R=$PWD
B=$R/plugins/dtorch_sage_attn/bench
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/sageattention-1.0.6-py3-none-any.whl .whl/structlog-*.whl || exit 1
export PYTHONPATH=/tmp/site:$R:$R/plugins/dtorch_sage_attn PYTHONUNBUFFERED=1
cd /tmp || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.log"
timeout 170 python3 -m pytest -q -p no:cacheprovider -x -k "(cuda or hopper) and not cpu" \
  "$R/plugins/dtorch_sage_attn/tests/test_triton_sage.py" 2>&1 | tail -25 | tee "$OUT/pytest.log"
timeout 80 python3 "$B/kernel_times.py" 2>&1 | tee "$OUT/kernel_times.log"
timeout "${SWEEP_TIMEOUT:-270}" python3 "$B/attention.py" --sweep --apply --deadline "${SWEEP_DEADLINE:-150}" \
  --shapes flux,sd3_cfg,prefill_causal_gqa,short \
  --configs "${SWEEP_CONFIGS:-64,128,4,2,0,0,0,168,0;64,128,4,3,1,0,0,0,0;64,128,4,2,1,0,0,0,1;64,64,4,2,1,0,0,0,1;64,128,4,2,0,0,0,0,1;64,128,4,2,1,0,0,168,1}" \
  --json "$OUT/sweep_table.json" 2>&1 | tee "$OUT/sweep_table.log"
