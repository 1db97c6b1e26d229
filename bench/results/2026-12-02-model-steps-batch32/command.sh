set -u
cd .snap
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/structlog-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_nccl > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 200 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/core . > /tmp/native.log 2>&1 || tail -n 5 /tmp/native.log
cp /tmp/core/dtorch_core/_*.so dtorch_core/ 2>/dev/null || echo "native not built"
export PYTHONPATH=/tmp/plug:/tmp/site:$PWD
timeout -k 5 200 python3 bench/model_steps.py --runner process --issue-times --sizes large --steps 8 --warmup 3 --json $OUT/steps_torch.json 2>&1 | grep -E "^(llama|gpt2|t5|dit|model)"
for fam in gpt2 dit; do for mode in eager eager-b16 eager-b256; do
  timeout -k 5 60 python3 bench/_scratch_gpu_profile.py $fam $mode 12 2>&1 | grep -E "RESULT|Error|error" | head -3
done; done
# (run in a snapshot of commit 9b6493c: `git archive 9b6493c | tar -x -C .snap`, device call with carry [".whl", ".snap"];
#  bench/_scratch_gpu_profile.py was an uncommitted one-side timing loop: 3 warm-up steps, then the median of 12
#  (process runner, world 1, bf16, torch.optim.AdamW(foreach=True)); eager-b16/-b256 patched ProcessRunner.flush_policy)
# output:
# llama  large  | torch    57.14 ms  1.00x | eager    58.74 ms  1.03x (issued in 11.31) | replay    54.84 ms  0.96x (issued in 0.27)
# gpt2   large  | torch    29.05 ms  1.00x | eager    30.32 ms  1.04x (issued in 18.02) | replay    26.51 ms  0.91x (issued in 0.26)
# t5     large  | torch    61.06 ms  1.00x | eager    62.61 ms  1.03x (issued in 17.32) | replay    58.01 ms  0.95x (issued in 0.25)
# dit    large  | torch    25.30 ms  1.00x | eager    27.24 ms  1.08x (issued in 15.19) | replay    20.71 ms  0.82x (issued in 0.26)
# RESULT gpt2 large eager: step 29.73 ms issue 15.31 ms
# RESULT gpt2 large eager-b16: step 29.71 ms issue 14.57 ms
# RESULT gpt2 large eager-b256: step 30.97 ms issue 13.44 ms
# RESULT dit large eager: step 27.07 ms issue 15.13 ms
# RESULT dit large eager-b16: step 26.85 ms issue 16.97 ms
# RESULT dit large eager-b256: step 29.64 ms issue 18.24 ms
