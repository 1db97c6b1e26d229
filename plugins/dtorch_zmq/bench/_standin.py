"""Stand-in workers for the benchmarks: the real remote-worker protocol (hello, welcome, node
fan-out over shared memory, credit, heartbeats, goodbye), but batches are only decoded and
acknowledged: a ``Stats`` or ``Fetch`` is answered with an empty reply, nothing runs.

    python _standin.py --address tcp://127.0.0.1:PORT --key-file KEY --ranks 0 64 [--node-size 8]

hosts ranks [0, 64) as threads of this one process; rank r reports node ``sim{r // node-size}``
(so a node's leader and its followers share the process, and only the leader keeps a ZMQ
connection). ``--channel SPEC`` instead serves one core channel (the process runner's transport)
for :mod:`throughput`: it decodes what arrives and answers on the reply channel.
``DTORCH_STANDIN_DECODE=0``: batches over 256 bytes are taken without decoding them (the
transport's own ceiling; the small ``Stats`` batches that ask for answers are still decoded).
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address")
    parser.add_argument("--key-file")
    parser.add_argument("--ranks", type=int, nargs=2, metavar=("FIRST", "END"))
    parser.add_argument("--node-size", type=int, default=8)
    parser.add_argument("--channel", nargs=2, metavar=("DOWN", "UP"), help="serve core channels instead")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    if args.channel:
        return serve_channel(*args.channel, args.rank)
    key = frame_key(read_key(args.key_file))
    first, end = args.ranks
    codes = [None] * end
    threads = [threading.Thread(target=serve_rank, args=(args.address, key, r, f"sim{r // args.node_size}", codes),
                                daemon=True, name=f"standin-{r}") for r in range(first, end)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = {r: c for r, c in enumerate(codes[first:end], first) if c != 0}
    if bad:
        print(f"stand-in ranks ended badly: {bad}", file=sys.stderr)
    sys.stdout.flush()
    os._exit(1 if bad else 0)  # the threads' sockets are closed; skip the interpreter's teardown


if __name__ == "__main__":
    main()
