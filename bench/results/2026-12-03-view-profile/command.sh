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
L=bench/results/2026-12-03-view-profile/view_loop.py
for dev in cuda cpu; do for op in view add; do
  echo "=== $dev $op"
  /tmp/site/bin/py-spy record --native --rate 1000 --format raw --output $OUT/${dev}_${op}.txt -- python3 $L $dev $op 8 > $OUT/${dev}_${op}.log 2>&1 || tail -3 $OUT/${dev}_${op}.log
  ls -la $OUT/${dev}_${op}.txt 2>&1 | tail -1
done; done
ls /tmp/site/bin | head
