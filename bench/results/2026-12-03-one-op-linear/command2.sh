# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# after the one-op Linear and Flux's one-op rotary embedding: every block at both sizes, the hf models
set -u
cd .snap
source bench/device_env.sh
MS="python3 bench/model_steps.py --runner process --issue-times --steps 8 --warmup 3"
echo "=== large, all families"; timeout -k 5 220 $MS --sizes large --json $OUT/large_all.json 2>&1 | grep -E "^(gpt2|dit|llama|t5)|rror"
echo "=== small dit,gpt2,llama"; timeout -k 5 100 $MS --sizes small --families dit,gpt2,llama --json $OUT/small.json 2>&1 | grep -E "^(gpt2|dit|llama)|rror"
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
echo "=== hf_models cut"; timeout -k 5 120 python3 $HF --runner process --sizes cut --json $OUT/hf_cut.json 2>&1 | grep -v -E "USDT|warn" | tail -8
echo "=== hf_models flux full"; timeout -k 5 200 python3 $HF --runner process --models flux --sizes full --json $OUT/hf_flux_full.json 2>&1 | grep -v -E "USDT|warn" | tail -4
