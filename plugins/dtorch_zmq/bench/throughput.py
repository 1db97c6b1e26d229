"""Transport throughput to 4 workers on loopback: the remote runner's ZMQ transport (one copy per
node, and one copy per worker) against the process runner's shared-memory channel, in one run.

    python plugins/dtorch_zmq/bench/throughput.py [--world 4] [--batches 400] [--batch 256] [--rounds 3] [--no-e2e]

Transport rows: pre-encoded batches of real small instructions (the ``Call`` instructions the session
emits for ``x + 1``, 256 per batch) go to ``--world`` stand-in worker processes
(``_standin.py``), then one ``Stats`` each answers:

  instr/s        instructions delivered per second (each to every worker), until all answered
  decoded/s      instr/s x workers: instructions the workers decoded per second in all
  latency us     one batch of a single ``Stats`` out and every worker's answer back (median)

``ack`` rows do the same with workers that take each batch without decoding it (only the
final ``Stats`` is decoded): the transport's own ceiling. The end-to-end rows (real workers,
``dt`` ops) give the controller's CPU per op, remote against process (``--rounds`` sessions of
each, alternating; the median). The bench checks that every remote worker reports the native
per-op path and decoder (``dtorch_core.worker.native``) in its HELLO. Target (issue 16):
>= 200k instructions/s to 4 workers; controller cost per op within 1.2x of the process runner.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from controller_scale import free_address
from dtorch_zmq import frames as fr
from dtorch_zmq.keys import write_key

import dtorch_core as dt
from dtorch_core.controller.session import current_session
from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Call, Stats
from dtorch_core.transport.channel import create_channel

HERE = os.path.dirname(os.path.abspath(__file__))
STANDIN = [sys.executable, os.path.join(HERE, "_standin.py")]


def small_batch(n: int) -> bytes:
    return wire.encode([Call(3, (10 + i % 7,), (11 + i % 7,), ("train.py", 40 + i % 5)) for i in range(n)])


def drive(send, wait_all, batches: int, batch: bytes, count: int, rounds: int = 50) -> dict:
    """``send(data)`` to every worker; ``wait_all(rid)`` until each answered a Stats(rid)."""
    rid = iter(range(1000, 10 ** 9))
    for _ in range(20):  # warm up
        send(batch)
    r = next(rid)
    send(wire.encode([Stats(r, memory=False)]))
    wait_all(r)
    start = time.perf_counter()
    for _ in range(batches):
        send(batch)
    r = next(rid)
    send(wire.encode([Stats(r, memory=False)]))
    wait_all(r)
    took = time.perf_counter() - start
    lat = []
    for _ in range(rounds):
        r = next(rid)
        t = time.perf_counter()
        send(wire.encode([Stats(r, memory=False)]))
        wait_all(r)
        lat.append(time.perf_counter() - t)
    return {"instr/s": batches * count / took, "latency us": 1e6 * statistics.median(lat)}


def remote_rows(world: int, key: str, batches: int, batch: bytes, count: int, fanout: bool, decode: bool) -> dict:
    address = free_address()
    env = dict(os.environ, DTORCH_STANDIN_DECODE="1" if decode else "0")
    procs = [subprocess.Popen(STANDIN + ["--address", address, "--key-file", key, "--ranks", str(r), str(r + 1)],
                              env=env, stdin=subprocess.DEVNULL) for r in range(world)]
    try:
        dt.init(world_size=world, runner="remote", listen=address, key_file=key, fanout=fanout, startup_timeout=120)
        runner = current_session().runner
        _check_native(runner, world)
        targets = runner.leaders if fanout else [runner._conns[r] for r in range(world)]

        def send(data) -> None:  # what RemoteRunner.submit does after encoding
            payload = fr.Payload([data])
            for conn in targets:
                conn.credit.acquire(payload.nbytes, runner.timeout, lambda: False)
            runner.endpoint.send_to(targets, fr.BATCH, payload)

        row = drive(send, lambda r: runner.wait_replies(r, world, 60.0), batches, batch, count)
    finally:
        dt.shutdown()
        codes = [p.wait(60) for p in procs]
    assert codes == [0] * world, codes
    return row


def _check_native(runner, world: int) -> None:
    """Every worker's HELLO says which per-op path and decoder it uses (dtorch_core.worker.native)."""
    paths = {runner._conns[r].native for r in range(world)}
    NATIVE_PATHS.update(paths)
    if os.environ.get("DTORCH_NATIVE_WORKER", "1") != "0" and paths != {"native"}:
        raise SystemExit(f"the workers do not use the native decoder: {sorted(paths)}")


NATIVE_PATHS: set = set()


def channel_rows(world: int, batches: int, batch: bytes, count: int, decode: bool) -> dict:
    """The process runner's transport: one core channel pair per worker process."""
    downs, ups, procs = [], [], []
    env = dict(os.environ, DTORCH_STANDIN_DECODE="1" if decode else "0")
    spin = {}
    if (os.cpu_count() or 1) <= world:  # as the process runner does: spinning ends take the cores
        env["DTORCH_CHANNEL_SPIN_US"] = "0"
        spin = {"spin_us": 0.0}
    for r in range(world):
        down, down_spec = create_channel("send", **spin)
        up, up_spec = create_channel("recv", **spin)
        procs.append(subprocess.Popen(STANDIN + ["--channel", down_spec.encode(), up_spec.encode(), "--rank", str(r)],
                                      env=env, stdin=subprocess.DEVNULL, pass_fds=down_spec.pass_fds + up_spec.pass_fds))
        down.child_started(procs[-1].pid)
        up.child_started(procs[-1].pid)
        downs.append(down)
        ups.append(up)

    def send(data) -> None:
        for ch in downs:
            ch.send(data)

    def wait_all(rid: int) -> None:
        for ch in ups:
            reply = wire.decode(ch.recv(60.0))
            assert reply.request_id == rid, reply

    try:
        row = drive(send, wait_all, batches, batch, count)
    finally:
        for ch in downs:
            ch.send(b"")
        codes = [p.wait(60) for p in procs]
        for ch in downs + ups:
            ch.close()
    assert codes == [0] * world, codes
    return row


def e2e_cpu_per_op(world: int, runner: str, key: str, ops: int) -> float:
    """Controller CPU per op of ``x + 1`` through the session, real workers."""
    procs = []
    options = {}
    if runner == "remote":
        address = free_address()
        script = os.path.join(os.path.dirname(sys.executable), "dtorch")
        procs = [subprocess.Popen([script, "worker", "--controller", address, "--key-file", key, "--rank", str(r)],
                                  stdin=subprocess.DEVNULL) for r in range(world)]
        options = {"listen": address, "key_file": key}
    try:
        dt.init(world_size=world, runner=runner, **options)
        if runner == "remote":
            _check_native(current_session().runner, world)
        mesh = dt.init_device_mesh("cpu", (world,))
        x = dt.distribute_tensor(torch.zeros(64 * world, 64), mesh, [dt.Shard(0)])
        for _ in range(256):
            x = x + 1
        dt.synchronize()
        cpu = time.process_time()
        for _ in range(ops):
            x = x + 1
        dt.synchronize()
        cpu = time.process_time() - cpu
        assert x.full_tensor()[0, 0].item() == ops + 256
    finally:
        dt.shutdown()
        for p in procs:
            p.wait(60)
    return 1e6 * cpu / ops


def e2e_rows(world: int, key: str, ops: int, rounds: int) -> dict:
    """``rounds`` sessions of each runner, alternating; each runner's list of controller CPU us/op."""
    out = {"process": [], "remote": []}
    for _ in range(rounds):
        for runner, figures in out.items():
            figures.append(e2e_cpu_per_op(world, runner, key, ops))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ops", type=int, default=4096, help="end-to-end ops")
    parser.add_argument("--rounds", type=int, default=3, help="end-to-end sessions per runner (alternating)")
    parser.add_argument("--no-e2e", action="store_true")
    args = parser.parse_args()
    batch = small_batch(args.batch)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        key = os.path.join(tmp, "key")
        write_key(key)
        for decode in (True, False):
            mode = "decode" if decode else "ack"
            rows[f"process channel, {mode}"] = channel_rows(args.world, args.batches, batch, args.batch, decode)
            rows[f"zmq one copy per node, {mode}"] = remote_rows(args.world, key, args.batches, batch, args.batch,
                                                                 True, decode)
            rows[f"zmq one copy per worker, {mode}"] = remote_rows(args.world, key, args.batches, batch, args.batch,
                                                                   False, decode)
        e2e = {} if args.no_e2e else e2e_rows(args.world, key, args.ops, args.rounds)
    print(f"world {args.world}, {args.batches} batches of {args.batch} instructions ({len(batch)} bytes), "
          f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")
    print(f"  the remote workers' per-op path and decoder (their HELLO): {', '.join(sorted(NATIVE_PATHS))}")
    for name, row in rows.items():
        anchor = rows[f"process channel, {name.rsplit(', ', 1)[1]}"]["instr/s"]
        print(f"  {name:32s} instr/s {row['instr/s']:>10,.0f}  decoded/s {row['instr/s'] * args.world:>10,.0f}  "
              f"latency us {row['latency us']:>7,.0f}  vs process channel {row['instr/s'] / anchor:.2f}x")
    best = max(row["instr/s"] for name, row in rows.items() if name.startswith("zmq") and name.endswith("decode"))
    print(f"  >= 200k instructions/s to {args.world} workers (decoded): {best:,.0f} "
          f"({'met' if best >= 200_000 else 'NOT met'})")
    if e2e:
        med = {r: statistics.median(v) for r, v in e2e.items()}
        ratio = med["remote"] / med["process"]
        for r, v in e2e.items():
            print(f"  end to end, controller CPU per op, {r}: " + ", ".join(f"{x:.1f}" for x in v) + " us")
        print(f"  end to end, controller CPU per op (median of {args.rounds}): process {med['process']:.1f} us, "
              f"remote {med['remote']:.1f} us, remote/process {ratio:.2f}x "
              f"(target <= 1.2x: {'met' if ratio <= 1.2 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
