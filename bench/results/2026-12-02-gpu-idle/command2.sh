# second device call (nvidia-h200), carry [".whl", ".snap"]: batch growth after a sync point
set -u
cd .snap
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/structlog-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_nccl > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . > /tmp/native.log 2>&1 || tail -n 5 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so dtorch_core/ 2>/dev/null || echo "native not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
python3 -m dtorch_core info 2>&1 | grep -i -E "native|path" | head -5
run() { echo "=== model_steps $*"; timeout -k 5 100 python3 bench/model_steps.py --runner process --issue-times --sizes large --steps 8 --warmup 3 --families dit,gpt2 "$@" 2>&1 | grep -E "^(gpt2|dit)|rror"; }
run
run --flush-first 4 --flush-growth 2
run --flush-first 1 --flush-growth 2
run --flush-first 2 --flush-growth 2 --flush-batch 16
run
run --flush-first 1 --flush-growth 2
echo "=== gpu_idle first 1 growth 2"; timeout -k 5 120 python3 bench/gpu_idle.py --families dit,gpt2 --size large --steps 3 --warmup 3 --top 6 --flush-first 1 --flush-growth 2 2>&1 | grep -v -E "USDT|warn"
