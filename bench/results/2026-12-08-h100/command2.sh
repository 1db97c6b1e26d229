# command1.sh of 2026-12-07-session2 again, trimmed to fit the session's last device minutes, with
# every line of output kept under $OUT (command1's grep hid why its steps printed nothing: the
# dtorch_zmq plugin failed to load, grpcio-health-checking 1.85.1 wants grpcio >= 1.85.1 and the
# device has 1.84.0; .whl now carries 1.84.0). carry [".whl", ".snap"] (.snap = git archive d30a757)
set -u
cd .snap
source bench/device_env.sh > $OUT/env.log 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ../.whl/pyzmq-*.whl ../.whl/grpcio_health_checking-*.whl ../.whl/protobuf-*.whl >> $OUT/env.log 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plug plugins/dtorch_zmq >> $OUT/env.log 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
B=$PWD/bench
cd /tmp
python3 -c "from dtorch_core.plugins import get_plugins; get_plugins(); print('plugins load')" 2>&1 | tail -2
steps() { timeout -k 5 75 python3 $B/model_steps.py --runner process --issue-times --families dit,gpt2 --sizes large --steps 8 --warmup 3 --json $OUT/$1.json > $OUT/$1.log 2>&1; grep -E "^(dit|gpt2)" $OUT/$1.log || tail -5 $OUT/$1.log; }
echo "=== heap frozen"; steps steps_1_frozen
echo "=== DTORCH_GC_FREEZE=0"; DTORCH_GC_FREEZE=0 steps steps_2_nofreeze
echo "=== dispatch remote+process"; timeout -k 5 100 python3 $B/dispatch.py --runner remote --ops 10000 --rounds 5 --json $OUT/dispatch_remote.json > $OUT/dispatch.log 2>&1; tail -16 $OUT/dispatch.log
echo "=== gpu_idle dit"; timeout -k 5 65 python3 $B/gpu_idle.py --families dit --size large --steps 3 --warmup 3 --top 0 --json $OUT/idle_dit.json > $OUT/idle.log 2>&1; grep -E "before the first|eager  \||torch  \||decod" $OUT/idle.log || tail -5 $OUT/idle.log
