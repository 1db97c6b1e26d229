# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# where SD3's controller time goes at the session's final code (py-spy, diffusers vs dtorch)
set -u
cd .snap
source bench/device_env.sh
export PATH=/tmp/site/bin:$PATH
REPO=$PWD
cd /tmp
echo "=== controller_profile sd3 full"; timeout -k 5 200 python3 $REPO/plugins/dtorch_hf/bench/controller_profile.py --models sd3 --size full --seconds 5 --top 25 --json $OUT/ctl_final.json 2>&1 | grep -v -E "USDT|warn"
