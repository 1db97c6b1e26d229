# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
set -u
cd .snap
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/structlog-*.whl ../.whl/py_spy-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_nccl > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . > /tmp/native.log 2>&1 || tail -n 5 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so dtorch_core/ 2>/dev/null || echo "native not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
python3 -m dtorch_core info 2>&1 | grep -i -E "native|path" | head -5
nproc; uptime
for fam in dit gpt2; do
  echo "=== sync_latency $fam"; timeout -k 5 120 python3 bench/sync_latency.py --step $fam --size large --steps 8 2>&1 | grep -v -E "USDT|warn"
done
echo "=== model_steps"; timeout -k 5 150 python3 bench/model_steps.py --runner process --issue-times --sizes large --steps 8 --warmup 3 --families dit,gpt2 --json $OUT/steps.json 2>&1 | grep -E "^(gpt2|dit)|rror|eager|replay"
