# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# Flux with the one-op rotary tables (dtorch_hf::flux_pos_embed) and plain_input without a GPU sync:
# Flux cut (checked against diffusers on copied weights) and full, SD3 cut, the controller profile of
# Flux cut again, and the DiT/GPT-2 large spread
set -u
cd .snap
source bench/device_env.sh
export PATH=/tmp/site/bin:$PATH
REPO=$PWD
HF=$REPO/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
echo "=== hf_models flux cut --check"; timeout -k 5 150 python3 $HF --runner process --models flux --sizes cut --check --json $OUT/hf_flux_cut.json 2>&1 | grep -v -E "USDT|warn" | tail -4
echo "=== hf_models sd3 cut"; timeout -k 5 120 python3 $HF --runner process --models sd3 --sizes cut --json $OUT/hf_sd3_cut.json 2>&1 | grep -v -E "USDT|warn" | tail -3
echo "=== controller_profile flux cut"; timeout -k 5 120 python3 $REPO/plugins/dtorch_hf/bench/controller_profile.py --models flux --size cut --seconds 5 --top 12 --json $OUT/ctl_flux_cut.json 2>&1 | grep -v -E "USDT|warn"
echo "=== hf_models flux full"; timeout -k 5 200 python3 $HF --runner process --models flux --sizes full --json $OUT/hf_flux_full.json 2>&1 | grep -v -E "USDT|warn" | tail -3
cd $REPO
echo "=== model_steps large"; timeout -k 5 120 python3 bench/model_steps.py --runner process --issue-times --families dit,gpt2 --sizes large --steps 8 --warmup 3 --json $OUT/steps.json 2>&1 | grep -E "^(gpt2|dit)|rror"
echo "=== gpu_idle dit, one-op Linear off (is the slower grad GEMM ours?)"; DTORCH_ONE_OP_LINEAR=0 timeout -k 5 120 python3 bench/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 3 --kernel-diff 6 --json $OUT/idle_linear0.json 2>&1 | grep -v -E "USDT|warn"
echo "=== gpu_idle dit, one-op Linear on"; timeout -k 5 120 python3 bench/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 3 --kernel-diff 6 --json $OUT/idle_linear1.json 2>&1 | grep -v -E "USDT|warn"
