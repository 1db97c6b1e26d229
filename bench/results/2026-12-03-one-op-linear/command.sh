# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# A/B of the one-op Linear (DTORCH_ONE_OP_LINEAR=1 is the default, 0 runs torch's F.linear)
set -u
cd .snap
source bench/device_env.sh
MS="python3 bench/model_steps.py --runner process --issue-times --steps 8 --warmup 3"
for v in 1 0; do
  echo "=== large dit,gpt2 DTORCH_ONE_OP_LINEAR=$v"; DTORCH_ONE_OP_LINEAR=$v timeout -k 5 150 $MS --families dit,gpt2 --sizes large --json $OUT/large_linear${v}.json 2>&1 | grep -E "^(gpt2|dit)|rror"
done
echo "=== op_costs cuda"; timeout -k 5 90 python3 bench/op_costs.py --device cuda 2>&1 | grep -v -E "USDT|warn"
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
for v in 1 0; do
  echo "=== hf_models cut DTORCH_ONE_OP_LINEAR=$v"; DTORCH_ONE_OP_LINEAR=$v timeout -k 5 150 python3 $HF --runner process --sizes cut --json $OUT/hf_cut_linear$v.json 2>&1 | grep -v -E "USDT|warn" | tail -8
done
