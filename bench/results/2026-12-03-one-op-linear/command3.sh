# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# the spread: DiT/GPT-2 large and Flux full, twice each, at the final commit of the session
set -u
cd .snap
source bench/device_env.sh
MS="python3 bench/model_steps.py --runner process --issue-times --steps 8 --warmup 3"
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
REPO=$PWD
for i in 1 2; do
  cd $REPO
  echo "=== large dit,gpt2 run $i"; timeout -k 5 120 $MS --families dit,gpt2 --sizes large --json $OUT/large_$i.json 2>&1 | grep -E "^(gpt2|dit)|rror"
  cd /tmp
  echo "=== hf_models flux full run $i"; timeout -k 5 150 python3 $HF --runner process --models flux --sizes full --json $OUT/hf_flux_full_$i.json 2>&1 | grep -v -E "USDT|warn" | tail -3
done
