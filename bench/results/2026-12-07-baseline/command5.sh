# one device call, carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# the rest of the table on the lent card: DiT's start with the first frame's decoding split out,
# Llama and T5 large steps, SD3 full against diffusers
set -u
cd .snap
source bench/device_env.sh > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
B=$PWD/bench
HF=$PWD/plugins/dtorch_hf/bench/hf_models.py
cd /tmp
echo "=== gpu_idle dit"; timeout -k 5 70 python3 $B/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 0 --json $OUT/idle_dit.json 2>&1 | grep -E "before the first|eager  \||torch  \|"
echo "=== llama,t5 large"; timeout -k 5 100 python3 $B/model_steps.py --runner process --issue-times --families llama,t5 --sizes large --steps 6 --warmup 3 --json $OUT/steps_llama_t5.json 2>&1 | grep -E "^(llama|t5)"
echo "=== sd3 full"; timeout -k 5 130 python3 $HF --runner process --models sd3 --sizes full --iters 3 --rounds 2 --json $OUT/sd3_full.json 2>&1 | grep -E "^(flux|sd3)|issued"
