# one device call, carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# issue 15 on the lent card: Flux and SD3 4 blocks (checked against diffusers) and full, eager and
# replay against diffusers in the same run (the one-op blocks of 2026-12-04, first measured here)
set -u
cd .snap
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
run() { echo "=== $1"; shift; timeout -k 5 "$@" 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|issued|checks"; }
run "cut --check" 150 python3 $HF --runner process --models flux,sd3 --sizes cut --check --json $OUT/hf_cut.json
run "sd3 full" 150 python3 $HF --runner process --models sd3 --sizes full --json $OUT/sd3_full.json
run "flux full" 190 python3 $HF --runner process --models flux --sizes full --json $OUT/flux_full.json
