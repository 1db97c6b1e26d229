# one device call (nvidia-h200), carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
set -u
cd .snap
source bench/device_env.sh
echo "=== op_costs cuda"; timeout -k 5 120 python3 bench/op_costs.py --device cuda 2>&1 | grep -v -E "USDT|warn"
echo "=== op_costs cuda, Python dispatcher"; DTORCH_NATIVE_DISPATCH=0 timeout -k 5 120 python3 bench/op_costs.py --device cuda 2>&1 | grep -v -E "USDT|warn"
REPO=$PWD
cd /tmp
echo "=== small-op chain (issue 18)"; CUDA_VISIBLE_DEVICES=0 timeout -k 10 90 python3 $REPO/plugins/dtorch_nccl/bench/cuda_block.py --only chain --rounds 5 --json $OUT/chain_native.json 2>&1 | tail -n 12
echo "=== hf_models flux full"; timeout -k 5 240 python3 $REPO/plugins/dtorch_hf/bench/hf_models.py --runner process --models flux --sizes full --json $OUT/hf_flux_full.json 2>&1 | grep -v -E "USDT|warn" | tail -6
