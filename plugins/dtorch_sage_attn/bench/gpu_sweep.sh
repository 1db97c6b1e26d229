#!/bin/bash
# The kernel's GPU run in one device call: the sweep of our launch configs and numeric variants
# at the four shapes, the choice per (head_dim, causal), the table with the chosen configs
# (attention.py --sweep --apply), then test_triton_sage.py's compiled CUDA cases. Logs and JSON
# under $OUT. From the checkout's root:
#   device run, carry [".whl"]:  bash plugins/dtorch_sage_attn/bench/gpu_sweep.sh
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_sweep_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 1
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/sageattention-1.0.6-py3-none-any.whl .whl/structlog-*.whl || exit 1
export PYTHONPATH=/tmp/site:$R:$R/plugins/dtorch_sage_attn PYTHONUNBUFFERED=1
cd /tmp || exit 1  # not the checkout's root: its plugins/ folder is no package to import
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv | tee "$OUT/gpu.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.log"
# SWEEP_CONFIGS="a,b,c,d,e,f,g,h;..." sweeps those LaunchConfigs instead of sweep.SWEEP_CONFIGS
timeout "${SWEEP_TIMEOUT:-330}" python3 "$R/plugins/dtorch_sage_attn/bench/attention.py" --sweep --apply \
  --deadline "${SWEEP_DEADLINE:-200}" --shapes "${SWEEP_SHAPES:-flux,sd3_cfg,prefill_causal_gqa,short}" \
  ${SWEEP_CONFIGS:+--configs "$SWEEP_CONFIGS"} --json "$OUT/sweep_table.json" 2>&1 | tee "$OUT/sweep_table.log"
if [ -n "${GRAPH_SHAPES:-}" ]; then  # the table again as CUDA-graph replays (no launch gaps)
  timeout 120 python3 "$R/plugins/dtorch_sage_attn/bench/attention.py" --graph --kernels ours --shapes "$GRAPH_SHAPES" \
    --json "$OUT/graph_table.json" 2>&1 | tee "$OUT/graph_table.log"
fi
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider -k "(cuda or hopper) and not cpu" \
  "$R/plugins/dtorch_sage_attn/tests/test_triton_sage.py" 2>&1 | tee "$OUT/pytest.log"
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv | tee -a "$OUT/gpu.log"
