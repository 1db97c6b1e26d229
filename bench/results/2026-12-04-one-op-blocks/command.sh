# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# the one-op adaLN-Zero blocks (gates, second norms) and joint-attention layout: Flux and SD3,
# cut and full, dtorch eager/replay against diffusers in the same run
set -u
cd .snap
source bench/device_env.sh
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
run() { echo "=== $1"; shift; timeout -k 5 "$@" 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|issued|checks"; }
run "cut" 150 python3 $HF --runner process --models flux,sd3 --sizes cut --json $OUT/cut.json
run "sd3 full" 150 python3 $HF --runner process --models sd3 --sizes full --json $OUT/sd3_full.json
run "flux full" 190 python3 $HF --runner process --models flux --sizes full --json $OUT/flux_full.json
run "cut again" 90 python3 $HF --runner process --models flux,sd3 --sizes cut --json $OUT/cut2.json
