# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# where DiT large's eager step still loses to torch: kernels per step (thread runner, profiled) and GPU idle
set -u
cd .snap
source bench/device_env.sh
echo "=== kernels, thread runner"; timeout -k 5 150 python3 bench/model_steps.py --runner thread --profile --top 25 --families dit --sizes large --steps 4 --warmup 3 --json $OUT/kernels_thread.json 2>&1 | grep -v -E "USDT|warn"
echo "=== gpu_idle"; timeout -k 5 150 python3 bench/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 12 --json $OUT/idle.json 2>&1 | grep -v -E "USDT|warn"
echo "=== model_steps process"; timeout -k 5 120 python3 bench/model_steps.py --runner process --issue-times --families dit,gpt2 --sizes large --steps 8 --warmup 3 --json $OUT/steps.json 2>&1 | grep -E "^(gpt2|dit)|rror"
