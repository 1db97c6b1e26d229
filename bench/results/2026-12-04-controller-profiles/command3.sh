# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# where the controller's time goes in SD3/Flux eager steps (py-spy on the main thread, diffusers vs dtorch),
# and GPU idle of DiT large with the kernel count fixed (record_function ranges are not kernels)
set -u
cd .snap
source bench/device_env.sh
export PATH=/tmp/site/bin:$PATH
REPO=$PWD
cd /tmp
echo "=== controller_profile sd3 full"; timeout -k 5 200 python3 $REPO/plugins/dtorch_hf/bench/controller_profile.py --models sd3 --size full --seconds 6 --top 30 --json $OUT/ctl_sd3_full.json 2>&1 | grep -v -E "USDT|warn"
echo "=== controller_profile flux cut"; timeout -k 5 150 python3 $REPO/plugins/dtorch_hf/bench/controller_profile.py --models flux --size cut --seconds 6 --top 30 --json $OUT/ctl_flux_cut.json 2>&1 | grep -v -E "USDT|warn"
cd $REPO
echo "=== gpu_idle"; timeout -k 5 150 python3 bench/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 6 --kernel-diff 8 --json $OUT/idle3.json 2>&1 | grep -v -E "USDT|warn"
