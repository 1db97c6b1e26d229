# one device call, carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# this session's baseline on the lent card (issue 14): model_steps large (process runner), DiT's
# GPU idle with the time before the first kernel split, the sync at DiT's step start; then the
# same with the channel's spin raised to 1 ms (DTORCH_CHANNEL_SPIN_US=1000; default 50)
set -u
cd .snap
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
B=$PWD/bench
cd /tmp
echo "=== model_steps large"; timeout -k 5 170 python3 $B/model_steps.py --runner process --issue-times --sizes large --steps 8 --warmup 3 --json $OUT/steps_large.json 2>&1 | grep -v -E "USDT|warn|^    "
echo "=== gpu_idle dit"; timeout -k 5 80 python3 $B/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 4 --json $OUT/idle_dit.json 2>&1 | grep -v -E "USDT|warn" | head -30
echo "=== sync_latency dit large"; timeout -k 5 60 python3 $B/sync_latency.py --device cuda --rounds 100 --step dit --size large 2>&1 | grep -v -E "USDT|warn"
export DTORCH_CHANNEL_SPIN_US=1000
echo "=== SPIN 1000: model_steps dit,gpt2 large"; timeout -k 5 90 python3 $B/model_steps.py --runner process --issue-times --families dit,gpt2 --sizes large --steps 8 --warmup 3 --json $OUT/steps_spin.json 2>&1 | grep -v -E "USDT|warn|^    "
echo "=== SPIN 1000: gpu_idle dit"; timeout -k 5 80 python3 $B/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 4 --json $OUT/idle_dit_spin.json 2>&1 | grep -v -E "USDT|warn" | head -30
