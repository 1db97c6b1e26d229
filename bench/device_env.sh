# Sourced by the device commands under bench/results/ (one H200; carry [".whl", ".snap"], where
# .snap = `git archive <commit> | tar -x -C .snap`): from .snap's root, installs the wheels of
# .whl/ (structlog, py-spy, diffusers 0.42.1, importlib_metadata) and the dtorch_nccl and dtorch_hf
# plugins, builds the native extensions into the snapshot and puts all of it on PYTHONPATH.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ../.whl/structlog-*.whl ../.whl/py_spy-*.whl ../.whl/diffusers-0.42.1-*.whl ../.whl/importlib_metadata-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_nccl plugins/dtorch_hf \
  > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . \
  > /tmp/native.log 2>&1 || tail -n 5 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so dtorch_core/ 2>/dev/null || echo "native not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
python3 -m dtorch_core info 2>&1 | grep -i -E "native|path" | head -5
nproc; uptime
