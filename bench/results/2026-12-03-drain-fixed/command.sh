# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
set -u
cd .snap
source bench/device_env.sh
MS="python3 bench/model_steps.py --runner process --issue-times --steps 8 --warmup 3"
for i in 1; do
  for v in 1 0; do
    echo "=== large DTORCH_FLUSH_ON_DRAIN=$v run $i"; DTORCH_FLUSH_ON_DRAIN=$v timeout -k 5 200 $MS --families dit,gpt2 --sizes large --json $OUT/large_drain${v}_$i.json 2>&1 | grep -E "^(gpt2|dit)|rror"
  done
done
for v in 1 0; do
  echo "=== small DTORCH_FLUSH_ON_DRAIN=$v"; DTORCH_FLUSH_ON_DRAIN=$v timeout -k 5 150 $MS --sizes small --families dit,gpt2,llama --json $OUT/small_drain${v}.json 2>&1 | grep -E "^(gpt2|dit|llama)|rror"
done
echo "=== sync_latency dit, drain 1"; DTORCH_FLUSH_ON_DRAIN=1 timeout -k 5 120 python3 bench/sync_latency.py --step dit --size large --steps 8 2>&1 | grep -v -E "USDT|warn"
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
for v in 1 0; do
  echo "=== hf_models cut DTORCH_FLUSH_ON_DRAIN=$v"; DTORCH_FLUSH_ON_DRAIN=$v timeout -k 5 200 python3 $HF --runner process --sizes cut --json $OUT/hf_cut_drain$v.json 2>&1 | grep -v -E "USDT|warn" | tail -8
done
