# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# which kernels the process worker runs beyond torch's in a DiT large step (gpu_idle --kernel-diff)
set -u
cd .snap
source bench/device_env.sh
echo "=== gpu_idle"; timeout -k 5 150 python3 bench/gpu_idle.py --families dit,gpt2 --size large --steps 3 --warmup 3 --top 4 --kernel-diff 25 --json $OUT/idle2.json 2>&1 | grep -v -E "USDT|warn"
