# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# where Flux's and SD3's 4-block eager steps leave the GPU idle (plugins/dtorch_hf/bench/hf_gpu_idle.py)
set -u
cd .snap
source bench/device_env.sh
echo "=== hf_gpu_idle cut"; timeout -k 5 170 python3 plugins/dtorch_hf/bench/hf_gpu_idle.py --models flux,sd3 --size cut --steps 3 --warmup 3 --top 5 --kernel-diff 5 --json $OUT/hf_idle_cut.json 2>&1 | grep -v -E "USDT|warn"
