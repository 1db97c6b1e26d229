# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
set -u
cd .snap
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/structlog-*.whl ../.whl/py_spy-*.whl ../.whl/diffusers-0.42.1-*.whl ../.whl/importlib_metadata-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_nccl plugins/dtorch_hf > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . > /tmp/native.log 2>&1 || tail -n 5 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so dtorch_core/ 2>/dev/null || echo "native not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
python3 -m dtorch_core info 2>&1 | grep -i -E "native|path" | head -5
nproc; uptime
echo "=== op_costs cuda"; timeout -k 5 120 python3 bench/op_costs.py --device cuda 2>&1 | grep -v -E "USDT|warn"
echo "=== op_costs cuda, Python dispatcher"; DTORCH_NATIVE_DISPATCH=0 timeout -k 5 120 python3 bench/op_costs.py --device cuda 2>&1 | grep -v -E "USDT|warn"
REPO=$PWD
cd /tmp
echo "=== small-op chain (issue 18)"; CUDA_VISIBLE_DEVICES=0 timeout -k 10 90 python3 $REPO/plugins/dtorch_nccl/bench/cuda_block.py --only chain --rounds 5 --json $OUT/chain_native.json 2>&1 | tail -n 12
echo "=== hf_models flux full"; timeout -k 5 240 python3 $REPO/plugins/dtorch_hf/bench/hf_models.py --runner process --models flux --sizes full --json $OUT/hf_flux_full.json 2>&1 | grep -v -E "USDT|warn" | tail -6
