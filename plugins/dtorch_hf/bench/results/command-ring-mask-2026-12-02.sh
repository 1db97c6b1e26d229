# device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
set -u
cd .snap
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ../.whl/structlog-*.whl ../.whl/diffusers-0.42.1-*.whl ../.whl/importlib_metadata-*.whl || exit 1
for p in dtorch_nccl dtorch_hf; do
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/$p > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
done
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
REPO=$PWD; cd /tmp
echo "=== ring mask"; timeout -k 5 150 python3 $REPO/plugins/dtorch_hf/bench/gpu_ring_check.py --mask 2>&1 | grep -v -i warn | tail -n 12
echo "=== ring"; timeout -k 5 150 python3 $REPO/plugins/dtorch_hf/bench/gpu_ring_check.py 2>&1 | grep -v -i warn | tail -n 12
