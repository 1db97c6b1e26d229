# one device call, carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# this session's baseline on the lent card: model_steps large (process runner), DiT's GPU idle,
# Flux and SD3 4 blocks (checked against diffusers) and full, against their anchors in the same run
set -u
cd .snap
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
B=$PWD/bench
cd /tmp
echo "=== model_steps large"; timeout -k 5 200 python3 $B/model_steps.py --runner process --issue-times --sizes large --steps 8 --warmup 3 --json $OUT/steps_large.json 2>&1 | grep -v -E "USDT|warn|^    "
echo "=== gpu_idle dit"; timeout -k 5 120 python3 $B/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --json $OUT/idle_dit.json 2>&1 | grep -v -E "USDT|warn" | head -60
echo "=== hf_models cut --check"; timeout -k 5 150 python3 $HF --runner process --models flux,sd3 --sizes cut --check --json $OUT/hf_cut.json 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|checks|issued"
echo "=== sync_latency dit large"; timeout -k 5 70 python3 $B/sync_latency.py --device cuda --rounds 100 --step dit --size large 2>&1 | grep -v -E "USDT|warn"
