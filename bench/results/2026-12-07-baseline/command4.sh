# one device call, carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# the channel spin (DTORCH_CHANNEL_SPIN_US, default 50) against 1000 us, alternating in pairs:
# DiT and GPT-2 large steps, then Flux and SD3 4 blocks against diffusers
set -u
cd .snap
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
B=$PWD/bench
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
steps() { timeout -k 5 80 python3 $B/model_steps.py --runner process --issue-times --families dit,gpt2 --sizes large --steps 8 --warmup 3 --json $OUT/$1 2>&1 | grep -E "^(dit|gpt2)"; }
for i in 1 2; do
  echo "=== pair $i: spin 50"; steps steps_${i}_50.json
  echo "=== pair $i: spin 1000"; DTORCH_CHANNEL_SPIN_US=1000 steps steps_${i}_1000.json
done
hf() { timeout -k 5 100 python3 $HF --runner process --models flux,sd3 --sizes cut --json $OUT/$1 2>&1 | grep -E "^(flux|sd3)|issued"; }
echo "=== hf cut spin 50"; hf hf_50.json
echo "=== hf cut spin 1000"; DTORCH_CHANNEL_SPIN_US=1000 hf hf_1000.json
