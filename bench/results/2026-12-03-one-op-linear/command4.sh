# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# SD3 at full depth, at the session's final code
set -u
cd .snap
source bench/device_env.sh
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
echo "=== hf_models sd3 full"; timeout -k 5 200 python3 $HF --runner process --models sd3 --sizes full --json $OUT/hf_sd3_full.json 2>&1 | grep -v -E "USDT|warn" | tail -3
