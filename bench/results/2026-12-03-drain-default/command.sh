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
MS="python3 bench/model_steps.py --runner process --issue-times --steps 8 --warmup 3"
for i in 1 2; do
  for v in 1 0; do
    echo "=== large DTORCH_FLUSH_ON_DRAIN=$v run $i"; DTORCH_FLUSH_ON_DRAIN=$v timeout -k 5 130 $MS --families dit,gpt2 --sizes large --json $OUT/large_drain${v}_$i.json 2>&1 | grep -E "^(gpt2|dit)|rror"
  done
done
echo "=== large llama,t5 (default: flush on drain on)"; timeout -k 5 170 $MS --families llama,t5 --sizes large --json $OUT/large_llama_t5.json 2>&1 | grep -E "^(llama|t5)|rror"
