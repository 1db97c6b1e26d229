"""The remote runner's controller against world size: stand-in workers, 8 per simulated node.

    python plugins/dtorch_zmq/bench/controller_scale.py [--worlds 1,8,64,256,1024] [--ops 2048] [--ops-per-batch N]
        [--node-size 8] [--pin] [--fixed-policy]

For each world size the real controller (``dt.init(runner="remote")``, one copy per node) drives
stand-in workers (``_standin.py``: the real protocol and node fan-out, but batches are only
decoded and acknowledged) hosted as threads of a few processes on this machine; each simulated
node's leader holds the node's only ZMQ connection and hands batches to its 7 followers over
shared memory (``--node-size``: workers per node; with the world in one node the controller
sends one message per batch, which separates the session's own cost of a larger mesh from the
per-node work). Rows, per world size:

  start s        launching the stand-in processes until ``dt.init`` returned, of which
  launch s       until the first HELLO arrived (the stand-ins' imports: one process imports and
                 forks the others; ``--import-each`` starts each on its own, 16 torch imports)
  hellos s       from the first HELLO to the last (every stand-in's ZMQ context and connection)
  join s         from the last HELLO until ``dt.init`` returned (welcomes, followers opening
                 their leader's shared-memory channels, every rank's READY)
  ctl CPU us/op  controller process CPU (main, flusher and I/O threads) per op, from the first of
                 ``--ops`` elementwise ops on a Shard(0) tensor (each a Call to every rank) until
                 ZMQ has every message (not the wait for the stand-ins that follows)
  main thread    of which the thread that issues the ops (the session, the encoding, the sends);
                 then the flusher's (the session's timer thread, which submits most batches), the
                 transport's I/O thread's and libzmq's own threads' (each thread's on-CPU time)
  wall us/op     wall time until every stand-in has taken every op (they share the 2 cores: an
                 upper bound of the controller's)
  B/op           batch bytes the controller sent per op (all nodes), B/op/node the same per node
  ops/batch      ops per batch the session flushed (each batch is one message per node)
  policy         the flush policy's batch size and timer interval for this many nodes
  round trip ms  one op then ``dt.synchronize()`` (every stand-in answers), median of 5

The runner's flush policy (``dtorch_zmq.runner.flush_policy_for``) grows batches and the timer
with the node count past 32 nodes (256 ops or 2 ms up to there); ops/batch follows how fast the
controller runs on the loaded cores; ``--fixed-policy`` keeps 256 ops / 2 ms at every size (the
policy before it grew), and ``--ops-per-batch N`` flushes every N ops instead (no timer), the
same batches at every world size. The stand-ins share the cores with
the controller and inflate its CPU time (a thread that shares its core with hundreds of busy
ones runs slower); ``--pin`` keeps them apart: the controller on the first CPU, the stand-ins on
the others.

Targets (issue 16): flat per op (here: the largest CPU us/op within 1.5x the smallest), bytes per
batch proportional to nodes (B/op/node within 10% across sizes), 1,024 workers start in < 30 s.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from _standin import node_blocks
from dtorch_zmq.keys import write_key

import dtorch_core as dt
from dtorch_core.controller.session import FlushPolicy, current_session

HERE = os.path.dirname(os.path.abspath(__file__))
SILENCE_S = 300.0


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def launch(address: str, key: str, world: int, processes: int, node: int, cpus: str | None,
           import_each: bool = False) -> list[subprocess.Popen]:
    """``processes`` stand-in processes, each hosting whole nodes of ``node`` workers (on ``cpus``
    if given): forked from one that imported once, or (``import_each``) each started on its own."""
    env = dict(os.environ, DTORCH_FANOUT_RING_BYTES=str(64 << 10))
    pin = ["taskset", "-c", cpus] if cpus else []
    standin = [*pin, "nice", "-n", "5", sys.executable, os.path.join(HERE, "_standin.py"), "--address", address,
               "--key-file", key, "--node-size", str(node)]
    blocks = node_blocks(0, world, node, processes) if import_each else [(0, world)]
    return [subprocess.Popen([*standin, "--ranks", str(first), str(end), "--processes", str(1 if import_each else processes)],
                             env=env, stdin=subprocess.DEVNULL) for first, end in blocks]


def thread_cpu() -> dict[str, int]:
    """On-CPU nanoseconds of each thread of this process so far (``/proc``'s schedstat: ns, not
    the 10 ms ticks of ``stat``), keyed by what the thread is: the session's main thread, its
    flusher, the transport's I/O thread, libzmq's own background threads, or other."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), comm)
        role = ("main" if name == "MainThread" else "flusher" if name == "dtorch-flush"
                else "I/O" if name == "dtorch-zmq-controller" else "libzmq" if comm.startswith("ZMQbg") else "other")
        out[role] = out.get(role, 0) + ns
    return out


def measure(world: int, ops: int, key: str, processes: int, node: int, cpus: str | None, import_each: bool) -> dict:
    address = free_address()
    start = time.monotonic()
    procs = launch(address, key, world, processes, node, cpus, import_each)
    try:
        # dozens of stand-in workers share one process and its GIL (and on a loaded machine a
        # thread may wait many seconds for it): a 5 s heartbeat would call them lost
        dt.init(world_size=world, runner="remote", listen=address, key_file=key, startup_timeout=300,
                heartbeat_timeout=SILENCE_S)
        started = time.monotonic()
        hellos = sorted(c.hello_at for c in current_session().runner._conns.values())
        split = {"launch s": hellos[0] - start, "hellos s": hellos[-1] - hellos[0], "join s": started - hellos[-1]}
        started -= start
        mesh = dt.init_device_mesh("cpu", (world,))
        x = dt.distribute_tensor(torch.zeros(4 * world), mesh, [dt.Shard(0)])
        for _ in range(256):  # warm up (plans cached)
            x = x + 1
        dt.synchronize()
        endpoint = current_session().runner.endpoint
        sent, messages = endpoint.batch_bytes, endpoint.batches_sent
        threads = thread_cpu()
        cpu, main_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
        for _ in range(ops):
            x = x + 1
        main_cpu = time.thread_time() - main_cpu
        current_session().flush()
        while endpoint.loop._outbox:  # every message handed to ZMQ: the controller's work is done
            time.sleep(0.0005)
        cpu = time.process_time() - cpu  # not the wait below, when only heartbeats tick
        threads = {k: v - threads.get(k, 0) for k, v in thread_cpu().items()}
        dt.synchronize()
        wall = time.perf_counter() - wall
        sent = endpoint.batch_bytes - sent
        messages = endpoint.batches_sent - messages
        nodes = len(current_session().runner.leaders)
        trips = []
        for _ in range(5):  # one small op, then a sync point: the policy's timer plays no part
            tick = time.perf_counter()
            x = x + 1
            dt.synchronize()
            trips.append(time.perf_counter() - tick)
        policy = current_session().runner.flush_policy
    finally:
        dt.shutdown()
        codes = [p.wait(60) for p in procs]
    if codes != [0] * len(procs):  # stand-ins starved of their GIL miss the goodbye's grace: say so
        print(f"  (world {world}: stand-in processes exited with {codes}; 3 = a rank still busy 3 s after goodbye)")
    return {"world": world, "nodes": nodes, "policy": f"{policy.batch_size}/{policy.interval * 1e3:g}ms", "start s": started, **split, "ctl CPU us/op": 1e6 * cpu / ops, "main thread us/op": 1e6 * main_cpu / ops,
            **{f"{k} us/op": v / 1e3 / ops for k, v in sorted(threads.items()) if k != "main"},
            "wall us/op": 1e6 * wall / ops, "B/op": sent / ops, "B/op/node": sent / ops / nodes,
            "ops/batch": ops * nodes / max(1, messages), "round trip ms": 1e3 * sorted(trips)[len(trips) // 2]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,8,64,256,1024")
    parser.add_argument("--ops", type=int, default=2048)
    parser.add_argument("--processes", type=int, default=16, help="stand-in processes (each hosts whole nodes)")
    parser.add_argument("--import-each", action="store_true",
                        help="start each stand-in process on its own (each imports torch) instead of forking them from one")
    parser.add_argument("--node-size", type=int, default=8, help="stand-in workers per simulated node")
    parser.add_argument("--ops-per-batch", type=int, default=0, help="flush every N ops, no timer (0: the runner's policy)")
    parser.add_argument("--fixed-policy", action="store_true",
                        help="the base flush policy (256 ops, 2 ms) at every size, not the one grown with the nodes")
    parser.add_argument("--pin", action="store_true",
                        help="the controller on CPU 0, the stand-ins on the others (needs taskset and 2+ CPUs)")
    args = parser.parse_args()
    standin_cpus = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        os.sched_setaffinity(0, {cpus[0]})  # before dt.init: its threads (I/O, libzmq, flusher) inherit it
        standin_cpus = ",".join(map(str, cpus[1:]))
    if args.ops_per_batch or args.fixed_policy:
        from dtorch_zmq import runner

        fixed = (FlushPolicy(batch_size=args.ops_per_batch, interval=0.0) if args.ops_per_batch
                 else runner.BASE_FLUSH_POLICY)
        runner.flush_policy_for = lambda messages: fixed
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        key = os.path.join(tmp, "key")
        write_key(key)
        for world in (int(w) for w in args.worlds.split(",")):
            rows.append(measure(world, args.ops, key, args.processes, args.node_size, standin_cpus, args.import_each))
            print("  ".join(f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()),
                  flush=True)
    batching = (f"a batch every {args.ops_per_batch} ops" if args.ops_per_batch
                else "the base flush policy at every size" if args.fixed_policy else "the runner's flush policy")
    if standin_cpus:
        batching += f", the controller on CPU {min(os.sched_getaffinity(0))} and the stand-ins on {standin_cpus}"
    print(f"\n{args.ops} ops per world, {batching}, {args.node_size} stand-in workers per simulated node, {os.cpu_count()} CPU cores")
    cpu = [r["ctl CPU us/op"] for r in rows]
    per_node = [r["B/op/node"] for r in rows]
    flat = max(cpu) / min(cpu)
    spread = max(per_node) / min(per_node)
    print(f"  controller CPU per op, largest/smallest: {flat:.2f}x  (target <= 1.5x: {'met' if flat <= 1.5 else 'NOT met'})")
    print(f"  bytes per op per node, largest/smallest: {spread:.2f}x  "
          f"(target: proportional to nodes, <= 1.1x: {'met' if spread <= 1.1 else 'NOT met'})")
    big = [r for r in rows if r["world"] >= 1024]
    if big:
        took = big[0]["start s"]
        print(f"  start-up of {big[0]['world']} workers: {took:.1f}s  (target < 30 s: {'met' if took < 30 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
