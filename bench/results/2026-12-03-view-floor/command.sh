# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
set -u
cd .snap
source bench/device_env.sh
echo "=== torch's own subclass floor"; timeout -k 5 60 python3 bench/results/2026-12-03-view-floor/floor.py cpu cuda
REPO=$PWD
cd /tmp
echo "=== hf_models flux full, second run"; timeout -k 5 240 python3 $REPO/plugins/dtorch_hf/bench/hf_models.py --runner process --models flux --sizes full --json $OUT/hf_flux_full_2.json 2>&1 | grep -v -E "USDT|warn" | tail -6
