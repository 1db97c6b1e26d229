# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# the one-op adaLN-Zero modulated norm too (dtorch_hf::norm_modulate, Flux and SD3): both models' cut
# (checked against diffusers on copied weights) and full, twice the cut
set -u
cd .snap
source bench/device_env.sh
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
echo "=== hf_models cut --check"; timeout -k 5 200 python3 $HF --runner process --models flux,sd3 --sizes cut --check --json $OUT/hf_cut.json 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|checks|issued"
echo "=== hf_models full"; timeout -k 5 300 python3 $HF --runner process --models flux,sd3 --sizes full --json $OUT/hf_full.json 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|issued"
echo "=== hf_models cut again"; timeout -k 5 150 python3 $HF --runner process --models flux,sd3 --sizes cut --json $OUT/hf_cut2.json 2>&1 | grep -v -E "USDT|warn" | grep -E "^(flux|sd3)|issued"
