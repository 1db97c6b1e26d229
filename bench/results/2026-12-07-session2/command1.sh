# one device call, carry [".whl", ".snap"]; .snap = `git archive <commit> | tar -x -C .snap`
# (.whl adds pyzmq, grpcio-health-checking and protobuf for the remote runner's benchmarks)
# 1. DiT / GPT-2 large steps with the workers' heap frozen (the default now) and without
#    (DTORCH_GC_FREEZE=0), alternating; 2. the controller's per-op cost on a host whose cores are
#    not all taken by the bench (issue 16: remote/process; issue 18: process/DTensor);
# 3. the 1,024-worker start-up on 16 cores (issue 16); 4. DiT's idle split again, with the
#    worker reading a step's frames whole in C++ (read_batch: the first frame's 98 us decode)
set -u
cd .snap
source bench/device_env.sh > /dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ../.whl/pyzmq-*.whl ../.whl/grpcio_health_checking-*.whl ../.whl/protobuf-*.whl || echo "zmq wheels failed"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_zmq > /tmp/pipz.log 2>&1 || tail -3 /tmp/pipz.log
nvidia-smi --query-gpu=name --format=csv,noheader
B=$PWD/bench
Z=$PWD/plugins/dtorch_zmq/bench
cd /tmp
steps() { timeout -k 5 75 python3 $B/model_steps.py --runner process --issue-times --families dit,gpt2 --sizes large --steps 8 --warmup 3 --json $OUT/$1 2>&1 | grep -E "^(dit|gpt2)"; }
echo "=== heap frozen"; steps steps_1_frozen.json
echo "=== DTORCH_GC_FREEZE=0"; DTORCH_GC_FREEZE=0 steps steps_2_nofreeze.json
echo "=== heap frozen"; steps steps_3_frozen.json
echo "=== dispatch remote+process"; timeout -k 5 100 python3 $B/dispatch.py --runner remote --ops 10000 --rounds 5 --json $OUT/dispatch_remote.json 2>&1 | tail -16
echo "=== controller_scale 1,8,64,1024"; timeout -k 5 120 python3 $Z/controller_scale.py --worlds 1,64,1024 2>&1 | tail -8
echo "=== gpu_idle dit"; timeout -k 5 65 python3 $B/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 0 --json $OUT/idle_dit.json 2>&1 | grep -E "before the first|eager  \||torch  \||decod"
