"""Stand-in workers for the benchmarks: the real remote-worker protocol (hello, welcome, node
fan-out over shared memory, credit, heartbeats, goodbye), but batches are only decoded and
acknowledged: a ``Stats`` or ``Fetch`` is answered with an empty reply, nothing runs.

    python _standin.py --address tcp://127.0.0.1:PORT --key-file KEY --ranks 0 64 [--node-size 8]

hosts ranks [0, 64) as threads of this one process; rank r reports node ``sim{r // node-size}``
(so a node's leader and its followers share the process, and only the leader keeps a ZMQ
connection). ``--processes P`` imports once, then forks P processes, each hosting whole nodes of
the ranks (the scale bench: 16 processes that each imported torch took 16 x ~2.5 s of CPU before
the first hello, on 2 cores, where a real node's workers import in parallel on their own cores);
each forked process then does what a worker does at start-up (its own ZMQ context and
connection, hello, welcome, the node's shared-memory channels). ``--channel SPEC`` instead serves one core channel (the process runner's transport)
for :mod:`throughput`: it decodes what arrives and answers on the reply channel.
``DTORCH_STANDIN_DECODE=0``: batches over 256 bytes are taken without decoding them (the
transport's own ceiling; the small ``Stats`` batches that ask for answers are still decoded).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dtorch_zmq import frames as fr
from dtorch_zmq.fanout import decode_local
from dtorch_zmq.keys import frame_key, read_key
from dtorch_zmq.worker import connect, serve_batches

from dtorch_core.ir import wire
from dtorch_core.ir.instructions import Fetch, Reply, Stats
from dtorch_core.runners.process import READY

DECODE = os.environ.get("DTORCH_STANDIN_DECODE", "1") != "0"
SMALL = 256


def take(data, rank: int, reply) -> None:
    if DECODE or type(data) is tuple or len(data) <= SMALL:
        acknowledge(decode_local(data, rank), rank, reply)


def acknowledge(batch, rank: int, reply) -> int:
    """Answer what asks for an answer; the number of instructions."""
    for ins in batch:
        if type(ins) in (Stats, Fetch):
            reply(Reply(ins.request_id, rank, value=None))
    return len(batch)


def serve_rank(address: str, key: bytes, rank: int, node: str, codes: list) -> None:
    # dozens of ranks share this process's GIL: generous silences (controller_scale.SILENCE_S)
    endpoint, config = connect(address, key, rank, silence_s=300.0, connect_s=300.0, node=node)
    if endpoint is None:
        codes[rank] = config
        return

    def reply(r: Reply) -> None:
        endpoint.send(fr.REPLY, fr.payload_parts(wire.encode_parts(r)))

    try:
        reply(Reply(READY, rank, value=None))
        codes[rank] = serve_batches(endpoint, rank, lambda data: take(data, rank, reply), reply)
    finally:
        endpoint.close()


def serve_channel(spec_down: str, spec_up: str, rank: int) -> int:
    """The process runner's channel: decode each batch, answer Stats/Fetch; b"" ends."""
    from dtorch_core.transport.channel import ChannelSpec, open_channel

    down = open_channel(ChannelSpec.decode(spec_down))
    up = open_channel(ChannelSpec.decode(spec_up))
    send = up.send
    while True:
        data = down.recv(None)
        if len(data) == 0:
            break
        take(data, rank, lambda r: send(wire.encode(r)))
    up.close()
    down.close()
    return 0


def serve_ranks(address: str, key: bytes, first: int, end: int, node_size: int) -> int:
    """Ranks [first, end) as threads of this process until each is told to exit; 0 if all ended well."""
    codes = [None] * end
    threads = [threading.Thread(target=serve_rank, args=(address, key, r, f"sim{r // node_size}", codes),
                                daemon=True, name=f"standin-{r}") for r in range(first, end)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = {r: c for r, c in enumerate(codes[first:end], first) if c != 0}
    if bad:
        print(f"stand-in ranks ended badly: {bad}", file=sys.stderr)
    return 1 if bad else 0


def node_blocks(first: int, end: int, node_size: int, processes: int) -> list[tuple[int, int]]:
    """[first, end) cut into at most ``processes`` blocks of whole nodes (as even as they come)."""
    nodes = -(-(end - first) // node_size)
    per = -(-nodes // max(1, processes))
    return [(first + n * node_size, min(end, first + (n + per) * node_size)) for n in range(0, nodes, per)]


def forked(blocks, serve) -> int:
    """``serve(first, end)`` in a forked process per block; the worst exit status."""
    # what every rank imports on its first hello and welcome, once here instead of in each child
    from dtorch_zmq import node, runner  # noqa: F401
    from dtorch_zmq.worker import _native_path, _shm_available

    from dtorch_core.worker_main import _die_with_parent

    _native_path()
    _shm_available()
    gc.freeze()  # the children's collections leave the imported objects alone: their pages stay shared
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    parent = os.getpid()
    for first, end in blocks:
        pid = os.fork()
        if pid == 0:  # the child: no thread runs in this process yet
            code = 1
            try:
                # it goes with the process that forked it: a caller that kills that one (a test
                # stopping stand-ins whose controller is gone) leaves no rank waiting for ever
                _die_with_parent()
                if os.getppid() != parent:
                    os._exit(1)
                code = serve(first, end)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    worst = 0
    for pid in pids:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            print(f"stand-in process {pid} exited with {code}", file=sys.stderr)
            worst = worst or (code if code > 0 else 1)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address")
    parser.add_argument("--key-file")
    parser.add_argument("--ranks", type=int, nargs=2, metavar=("FIRST", "END"))
    parser.add_argument("--node-size", type=int, default=8)
    parser.add_argument("--processes", type=int, default=1, help="fork this many processes, each hosting whole nodes")
    parser.add_argument("--channel", nargs=2, metavar=("DOWN", "UP"), help="serve core channels instead")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    if args.channel:
        return serve_channel(*args.channel, args.rank)
    key = frame_key(read_key(args.key_file))
    first, end = args.ranks

    def serve(lo: int, hi: int) -> int:
        return serve_ranks(args.address, key, lo, hi, args.node_size)

    blocks = node_blocks(first, end, args.node_size, args.processes)
    code = serve(first, end) if len(blocks) == 1 else forked(blocks, serve)
    sys.stdout.flush()
    os._exit(code)  # the threads' sockets are closed; skip the interpreter's teardown


if __name__ == "__main__":
    main()
