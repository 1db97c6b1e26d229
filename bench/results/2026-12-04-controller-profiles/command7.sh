# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# does flush on drain (tiny batches while the GPU waits) leave SD3's worker behind its controller?
# SD3 full and cut, Flux cut, with DTORCH_FLUSH_ON_DRAIN=0 and the default, back to back
set -u
cd .snap
source bench/device_env.sh
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
for drain in 0 1; do
  echo "=== flush on drain $drain: sd3 full"; DTORCH_FLUSH_ON_DRAIN=$drain timeout -k 5 150 python3 $HF --runner process --models sd3 --sizes full --json $OUT/sd3_full_drain$drain.json 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|issued"
  echo "=== flush on drain $drain: cut"; DTORCH_FLUSH_ON_DRAIN=$drain timeout -k 5 150 python3 $HF --runner process --models flux,sd3 --sizes cut --json $OUT/cut_drain$drain.json 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|issued"
done
