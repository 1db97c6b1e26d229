set -u
cd .snap
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/structlog-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_nccl > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . > /tmp/native.log 2>&1 || tail -n 5 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so dtorch_core/ 2>/dev/null || echo "native not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
python3 -m dtorch_core info 2>&1 | grep -i -E "native|path" | head -5
timeout -k 5 170 python3 bench/model_steps.py --runner process --issue-times --sizes large --steps 8 --warmup 3 --families dit,gpt2,llama,t5 --json $OUT/steps.json 2>&1 | grep -E "^(llama|gpt2|t5|dit|model)|rror"
# (run in a snapshot of commit d465e5d: `git archive d465e5d | tar -x -C .snap`, device call with carry [".whl", ".snap"])
# output:
#   native extension: active / local channel: native-shm / op hot path: native / worker op path: native
# dit    large  | torch    25.75 ms  1.00x | eager    27.52 ms  1.07x (issued in 15.56) | replay    20.69 ms  0.80x (issued in 0.28)
# gpt2   large  | torch    29.02 ms  1.00x | eager    30.51 ms  1.05x (issued in 13.89) | replay    27.09 ms  0.93x (issued in 0.33)
# llama  large  | torch    57.72 ms  1.00x | eager    59.56 ms  1.03x (issued in 14.22) | replay    55.37 ms  0.96x (issued in 0.33)
# t5     large  | torch    61.65 ms  1.00x | eager    63.55 ms  1.03x (issued in 24.66) | replay    58.22 ms  0.94x (issued in 0.30)
