# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
set -u
cd .snap
source bench/device_env.sh
MS="python3 bench/model_steps.py --runner process --issue-times --steps 8 --warmup 3"
for i in 1 2; do
  for v in 1 0; do
    echo "=== large DTORCH_FLUSH_ON_DRAIN=$v run $i"; DTORCH_FLUSH_ON_DRAIN=$v timeout -k 5 130 $MS --families dit,gpt2 --sizes large --json $OUT/large_drain${v}_$i.json 2>&1 | grep -E "^(gpt2|dit)|rror"
  done
done
echo "=== large llama,t5 (default: flush on drain on)"; timeout -k 5 170 $MS --families llama,t5 --sizes large --json $OUT/large_llama_t5.json 2>&1 | grep -E "^(llama|t5)|rror"
