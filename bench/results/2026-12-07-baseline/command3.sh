# one device call, carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# the one call this session's device time allows: issue 14 (DiT and GPT-2 large, default channel
# spin against a 1 ms spin, DiT's time before the first kernel split) and issue 15 (Flux and SD3
# 4 blocks against diffusers, checked)
set -u
cd .snap
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
B=$PWD/bench
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
steps() { timeout -k 5 100 python3 $B/model_steps.py --runner process --issue-times --families dit,gpt2 --sizes large --steps 8 --warmup 3 --json $OUT/$1 2>&1 | grep -v -E "USDT|warn|^    "; }
echo "=== model_steps dit,gpt2 large, spin default (50 us)"; steps steps_a.json
echo "=== model_steps dit,gpt2 large, spin 1000 us"; DTORCH_CHANNEL_SPIN_US=1000 steps steps_b.json
echo "=== gpu_idle dit"; timeout -k 5 75 python3 $B/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 3 --json $OUT/idle_dit.json 2>&1 | grep -v -E "USDT|warn" | grep -v "^ *controller\|^ *in " | head -16
echo "=== hf_models cut --check"; timeout -k 5 150 python3 $HF --runner process --models flux,sd3 --sizes cut --check --json $OUT/hf_cut.json 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|checks|issued"
